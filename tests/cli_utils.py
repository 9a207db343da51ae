"""Running fl_megatron.pretrain under a launcher from tests, and reading what the run wrote."""

import json
import os
import subprocess
import sys
from pathlib import Path

from fl_megatron.launching.ports import free_port
from fl_megatron.training.run_files import logged_steps

TINY = ["--model", "llama-tiny", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "96",
        "--num-attention-heads", "4", "--num-query-groups", "2", "--vocab-size", "512",
        "--tokenizer-vocab-size", "512", "--seq-length", "32", "--micro-batch-size", "2",
        "--log-interval", "1", "--eval-iters", "1", "--lr-decay-style", "constant"]
SGD = ["--optimizer", "sgd", "--lr", "0.5", "--weight-decay", "0", "--clip-grad", "0"]


def pretrain_command(nproc: int, run_dir: Path, cache: Path, *flags: str,
                     launcher: str = "torchrun") -> tuple[list[str], dict]:
    """(argv, environment) of one job under torchrun or the deepspeed launcher."""
    env = dict(os.environ, OMP_NUM_THREADS="1", FL_MEGATRON_CACHE=str(cache))
    if launcher == "torchrun":
        start = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                 "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m"]
    else:  # on CPU: --num_gpus sets the process count, --no_local_rank keeps argv clean
        start = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(nproc), "--no_local_rank",
                 "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "--module"]
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return [*start, "fl_megatron.pretrain", *TINY, "--run-dir", str(run_dir), *flags], env


def launch(nproc: int, run_dir: Path, cache: Path, *flags: str, launcher: str = "torchrun",
           env_extra: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run one job to its end; the caller judges the exit code."""
    cmd, env = pretrain_command(nproc, run_dir, cache, *flags, launcher=launcher)
    return subprocess.run(cmd, env={**env, **(env_extra or {})}, capture_output=True, text=True, timeout=timeout)


def step_records(run_dir: Path) -> list[dict]:
    """One record per logged step over all groups (a federated run's merged from its groups' files)."""
    return logged_steps(run_dir)


def federation_records(run_dir: Path) -> list[dict]:
    """The step records of metrics.jsonl (a federated run's: one per sync)."""
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r]


def run_pretrain(nproc: int, run_dir: Path, cache: Path, *flags: str, launcher: str = "torchrun") -> list[dict]:
    """Run one job that must succeed; return its training-step records."""
    proc = launch(nproc, run_dir, cache, *flags, launcher=launcher)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert (run_dir / "summary.json").exists() and (run_dir / "config.json").exists()
    return step_records(run_dir)


def _stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP): state T in /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def spawn_ranks(nproc: int, run_dir: Path, cache: Path, *flags: str, env_extra: dict | None = None,
                timeout: float = 300) -> list[dict]:
    """Start one process per rank with no launcher (as srun would: RANK, WORLD_SIZE, ...), so that
    nothing but the ranks themselves notices a dead rank. Returns per rank: returncode, stderr,
    and `exited`, seconds from the start until the process was seen to exit (polled every 0.1 s)."""
    import time

    run_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [sys.executable, "-m", "fl_megatron.pretrain", *TINY, "--run-dir", str(run_dir), *flags]
    procs, logs = [], []
    start = time.monotonic()
    for rank in range(nproc):
        env = dict(os.environ, OMP_NUM_THREADS="1", FL_MEGATRON_CACHE=str(cache), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(nproc), **(env_extra or {}))
        log = open(run_dir / f"rank{rank}.stderr", "w+")
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=log))
        logs.append(log)
    exited: dict[int, float] = {}
    try:
        while len(exited) < nproc:
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"ranks {sorted(set(range(nproc)) - set(exited))} still run after {timeout} s")
            for rank, p in enumerate(procs):
                if rank not in exited and p.poll() is not None:
                    exited[rank] = time.monotonic() - start
            left = [p for rank, p in enumerate(procs) if rank not in exited]
            if exited and left and all(_stopped(p.pid) for p in left):  # a hang the test injected
                for p in left:
                    p.kill()
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for rank, (p, log) in enumerate(zip(procs, logs)):
        log.seek(0)
        results.append({"rank": rank, "returncode": p.returncode, "stderr": log.read(), "exited": exited.get(rank)})
        log.close()
    return results
