#!/usr/bin/env python3
"""Everything GPU-specific, checked in one go on a machine with NVIDIA GPUs (tools/gpu_check.sh).

Each check runs the real command line (torchrun + fl_megatron.pretrain, the converter) in a
subprocess with a time limit, on CUDA (FL_MEGATRON_DEVICE=cuda, NCCL), and judges what it left
behind. One line per check, then `N passed, N failed, N skipped`; exit 1 if any failed. Without a
GPU every check is skipped and it exits 0 (CI runs it so).

Checks needing more GPUs than the machine has are skipped, naming how many they need: a
federated sync needs 2 (one rank per group), FL+HSDP with overlap 4, elastic mode 2 (each group's
job on its own GPU: NCCL takes one GPU per rank of the groups' exchange).
"""

import argparse
import dataclasses
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--model", "llama-tiny", "--num-layers", "2", "--hidden-size", "128", "--ffn-hidden-size", "352",
         "--vocab-size", "4096", "--seq-length", "64", "--micro-batch-size", "2", "--log-interval", "1",
         "--eval-iters", "0", "--mock-data", "--optimizer", "adamw", "--lr", "1e-3", "--lr-decay-style", "constant"]


@dataclass
class Check:
    name: str
    gpus: int                              # GPUs it needs
    run: Callable[[Path, int], str]        # (work dir, GPUs) -> "" when it passed, else why not


def pretrain(work: Path, name: str, nproc: int, *flags: str, env: dict | None = None,
             timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "fl_megatron.pretrain", *SMALL, "--run-dir", str(work / name), *flags]
    full_env = {**os.environ, "FL_MEGATRON_DEVICE": "cuda", "FL_MEGATRON_CACHE": str(work / "cache"), **(env or {})}
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


def losses(run_dir: Path) -> list[float]:
    from fl_megatron.training.run_files import logged_steps

    return [r["loss"] for r in logged_steps(run_dir)]


def _failed(proc: subprocess.CompletedProcess) -> str:
    text = (proc.stderr or proc.stdout).strip()
    return f"exit {proc.returncode}: {text.splitlines()[-1][:200] if text else ''}"


def backend_step(backend: str) -> Callable[[Path, int], str]:
    """Forward, backward and step in bf16 on CUDA, one rank per GPU (up to 2), 3 steps."""
    def run(work: Path, gpus: int) -> str:
        n = min(gpus, 2)
        proc = pretrain(work, f"step-{backend}", n, "--backend", backend, "--bf16", "--train-iters", "3",
                        *(["--fl-group-size", "1", "--fl-sync-interval", "2"] if n > 1 else []))
        if proc.returncode:
            return _failed(proc)
        got = losses(work / f"step-{backend}")
        return "" if len(got) == 3 and all(math.isfinite(x) for x in got) else f"losses {got}"
    return run


def sync_mode(*flags: str, nproc: int = 2) -> Callable[[Path, int], str]:
    """A federated run with these sync flags: finite losses, and identical groups after the last sync."""
    def run(work: Path, gpus: int) -> str:
        name = "sync-" + "-".join(f.strip("-") for f in flags) if flags else "sync-fp32"
        proc = pretrain(work, name, nproc, "--train-iters", "6", "--fl-sync-interval", "2", "--bf16",
                        "--fl-group-size", str(nproc // 2), *flags, "--save", str(work / name / "ckpt"))
        if proc.returncode:
            return _failed(proc)
        from fl_megatron.checkpoint.reader import CheckpointReader
        import torch

        reader = CheckpointReader(work / name / "ckpt")
        same = all(torch.equal(reader.tensor(n, 0), reader.tensor(n, g)) for n in reader.names for g in reader.groups)
        finite = all(math.isfinite(x) for x in losses(work / name))
        return "" if same and finite else f"groups identical after the last sync: {same}, finite losses: {finite}"
    return run


def exact_resume(work: Path, gpus: int) -> str:
    """Save at step 2 on CUDA, resume to 4: the same losses as 4 uninterrupted steps, then HF export."""
    flags = ["--train-iters", "4", "--bf16"]
    ref = pretrain(work, "ref", 1, *flags)
    first = pretrain(work, "resumed", 1, *flags, "--save", str(work / "ckpt"), "--exit-interval", "2")
    second = pretrain(work, "resumed", 1, *flags, "--save", str(work / "ckpt"), "--load", str(work / "ckpt"))
    for proc in (ref, first, second):
        if proc.returncode:
            return _failed(proc)
    if losses(work / "resumed") != losses(work / "ref"):
        return f"resumed {losses(work / 'resumed')} != uninterrupted {losses(work / 'ref')}"
    export = subprocess.run([sys.executable, str(ROOT / "tools" / "convert_checkpoint_to_hf.py"), "--checkpoint",
                             str(work / "ckpt"), "--output", str(work / "hf")], capture_output=True, text=True,
                            timeout=240)
    return _failed(export) if export.returncode else ""


def dead_rank(work: Path, gpus: int) -> str:
    """A rank killed during a sync on NCCL: the job ends (no hang) within the timeout."""
    start = time.monotonic()
    proc = pretrain(work, "dead", 2, "--train-iters", "8", "--fl-group-size", "1", "--fl-sync-interval", "2",
                    "--distributed-timeout-minutes", "1", env={"FL_MEGATRON_FAULT": "kill:sync:4:1"}, timeout=300)
    took = time.monotonic() - start
    return "" if proc.returncode != 0 and took < 240 else f"exit {proc.returncode} after {took:.0f} s"



def elastic_commands(work: Path, name: str, groups: int, *flags: str) -> list:
    """tools/elastic_launch.py's commands: a lighthouse, then one torchrun job of 1 rank per group
    (every group needed for a sync), group g on the g-th visible GPU, on CUDA."""
    sys.path.insert(0, str(ROOT / "tools"))
    import elastic_launch

    commands = elastic_launch.elastic_commands(groups, 1, groups, [*SMALL, "--run-dir", str(work / name), *flags],
                                               lighthouse=f"127.0.0.1:{elastic_launch.free_port()}", max_restarts=0,
                                               python=sys.executable)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    gpu = [visible[g] if len(visible) > g and visible[g] else str(g) for g in range(groups)]
    env = {"FL_MEGATRON_DEVICE": "cuda", "FL_MEGATRON_CACHE": str(work / "cache")}
    return commands[:1] + [dataclasses.replace(c, env={**c.env, **env, "CUDA_VISIBLE_DEVICES": gpu[g]})
                           for g, c in enumerate(commands[1:])]


def elastic(work: Path, name: str, groups: int, *flags: str, timeout: float = 300) -> dict:
    """Run elastic_commands(...) with tools/elastic_launch.py; {group name: exit code}, logs in
    work/name/launch/."""
    import elastic_launch  # on the path since elastic_commands

    commands = elastic_commands(work, name, groups, *flags)
    return elastic_launch.run_elastic(commands, work / name / "launch", timeout, {})


def elastic_sync(work: Path, gpus: int) -> str:
    """Elastic mode on NCCL: 2 groups, each its own torchrun job on its own GPU, meeting at syncs
    through the lighthouse: both finish, every sync has both, and their shards agree bit for bit
    after each (fp32 FedAvg, --fl-sync-digest)."""
    from fl_megatron.training.run_files import read_jsonl

    codes = elastic(work, "elastic", 2, "--train-iters", "6", "--fl-sync-interval", "2", "--bf16", "--fl-sync-digest")
    if not codes or any(code != 0 for code in codes.values()):
        logs = sorted((work / "elastic" / "launch").glob("group_*.log"))
        last = [log.read_text().strip().splitlines()[-1:] for log in logs]
        return f"exit codes {codes}: {[line[0][:160] for line in last if line]}"
    records = [read_jsonl(work / "elastic" / f"group_{g:05d}" / "metrics.jsonl") for g in range(2)]
    syncs = [{r["step"]: r for r in rs if "groups" in r} for rs in records]
    if not sorted(syncs[0]) == sorted(syncs[1]) == [2, 4, 6]:
        return f"sync steps {[sorted(s) for s in syncs]}, expected [2, 4, 6] in both groups"
    for step in (2, 4, 6):
        if [s[step]["groups"] for s in syncs] != [[0, 1], [0, 1]]:
            return f"step {step}: the groups met as {[s[step]['groups'] for s in syncs]}"
        if syncs[0][step]["shard_digests"] != syncs[1][step]["shard_digests"]:
            return f"the groups' shards differ after the sync of step {step}"
    finite = all(math.isfinite(r["loss"]) for rs in records for r in rs if "loss" in r)
    return "" if finite else "a loss is not finite"


CHECKS = [
    Check("fsdp2 step (bf16)", 1, backend_step("fsdp2")),
    Check("deepspeed step (bf16)", 1, backend_step("deepspeed")),
    Check("megatron step (bf16)", 1, backend_step("megatron")),
    Check("save, exact resume and HF export", 1, exact_resume),
    Check("sync fp32", 2, sync_mode()),
    Check("sync bf16", 2, sync_mode("--fl-sync-dtype", "bf16")),
    Check("sync int8 + error feedback", 2, sync_mode("--fl-sync-dtype", "int8", "--fl-error-feedback")),
    Check("sync int4 + error feedback", 2, sync_mode("--fl-sync-dtype", "int4", "--fl-error-feedback")),
    Check("sync nesterov", 2, sync_mode("--fl-outer-optimizer", "nesterov")),
    Check("sync overlap 1 (FL+FSDP)", 2, sync_mode("--fl-overlap-steps", "1", "--fl-outer-optimizer", "nesterov")),
    Check("sync fragments 2", 2, sync_mode("--fl-fragments", "2", "--fl-outer-optimizer", "nesterov")),
    Check("sync overlap 1 (FL+HSDP)", 4, sync_mode("--fl-overlap-steps", "1", "--fl-hsdp-shard-size", "1",
                                                 "--fl-outer-optimizer", "nesterov", nproc=4)),
    Check("dead rank on NCCL", 2, dead_rank),
    Check("elastic, 2 groups' jobs on NCCL", 2, elastic_sync),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--only", help="run the checks whose name contains this")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"gpu_check: torch {torch.__version__}, {gpus} GPU(s)"
          + (f": {torch.cuda.get_device_name(0)}" if gpus else ": every check skipped"), flush=True)
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for index, check in enumerate(c for c in CHECKS if not args.only or args.only in c.name):
            if gpus < check.gpus:
                counts["skipped"] += 1
                print(f"SKIP {check.name}: needs {check.gpus} GPU(s), this machine has {gpus}", flush=True)
                continue
            work = Path(tmp) / f"check{index}"
            work.mkdir()
            start = time.monotonic()
            try:
                why = check.run(work, gpus)
            except subprocess.TimeoutExpired as e:
                why = f"timed out after {e.timeout:.0f} s"
            except Exception as e:  # a check's own failure is that check's result
                why = f"{type(e).__name__}: {e}"
            counts["failed" if why else "passed"] += 1
            print(f"{'FAIL' if why else 'PASS'} {check.name} ({time.monotonic() - start:.0f} s)"
                  + (f": {why}" if why else ""), flush=True)
    print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped", flush=True)
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
