#!/usr/bin/env python3
"""Everything GPU-specific, checked in one go on a machine with NVIDIA GPUs (tools/gpu_check.sh).

Sized for the machine this project is lent: one H200, its own PyTorch (2.11), no network, a few
minutes. On one GPU: each backend's bf16 step (tokens/s, MFU against the card's measured rate),
the dry run's memory estimate against the measured peak (Llama 3.1 8B's layers cut to fit), the
int8/int4 and sparse codecs in GB/s, save / exact resume / Hugging Face export on CUDA, which collectives gloo
runs on CUDA, and two processes of the GPU on gloo: the overlapped sync (its CUDA streams and
events) and the tuner's measured interference. With more GPUs: every sync mode on NCCL, FL+HSDP
with overlap, a dead rank, elastic groups' jobs. Checks a machine cannot run are skipped, naming
what they need (GPUs, a package: tools/gpu_bundle.sh carries them), and so is a check its share of
the time budget no longer fits (--budget-seconds, counted from the start of gpu_check.sh).

One line per check, then `N passed, N failed, N skipped`; exit 1 if any failed. With --out (or
$OUT, as the device tool sets it) also gpu_check.json and gpu_check.md there. Without a GPU every
check is skipped and it exits 0 (CI runs it so). --plan prints what would run and each budget.
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
from gpu_checks import multi_gpu, one_gpu  # noqa: E402
from gpu_checks.common import Check, Context, Outcome  # noqa: E402

BUDGET_SECONDS = 480   # one command on the lent machine may take 10 minutes: leave room for its start
SETUP_SECONDS = 40     # gpu_check.sh --install: the carried wheels, offline
LENT = (1, "NVIDIA H200")

CHECKS = [
    Check("codecs int8/int4 on the GPU", 1, one_gpu.codecs, 25),
    Check("fsdp2 bf16 step, tokens/s and MFU", 1, one_gpu.backend_throughput("fsdp2"), 45),
    Check("deepspeed bf16 step, tokens/s and MFU", 1, one_gpu.backend_throughput("deepspeed"), 60, ("deepspeed",)),
    Check("megatron bf16 step, tokens/s and MFU", 1, one_gpu.backend_throughput("megatron"), 55, ("megatron.core",)),
    Check("dry-run memory vs measured peak (8B layers)", 1, one_gpu.memory_estimate, 70),
    Check("save, exact resume and HF export", 1, one_gpu.exact_resume, 55),
    Check("gloo collectives on CUDA (2 processes, 1 GPU)", 1, one_gpu.gloo_collectives, 25),
    Check("overlap 1 on CUDA streams (gloo, 2 groups, 1 GPU)", 1,
          one_gpu.two_groups_on_one_gpu("overlap", "--fl-overlap-steps", "1", "--fl-outer-optimizer", "nesterov"), 45),
    Check("tuner vs a pinned overlap-1 run (gloo, 2 groups, 1 GPU)", 1,
          one_gpu.two_groups_on_one_gpu("tune", "--fl-tune", *one_gpu.TUNE_RUN,
                                        judge=one_gpu.tuner_interference_against_a_pinned_run, identical=False), 60),
    Check("sync fp32", 2, multi_gpu.sync_mode(), 60),
    Check("sync bf16", 2, multi_gpu.sync_mode("--fl-sync-dtype", "bf16"), 60),
    Check("sync int8 + error feedback", 2, multi_gpu.sync_mode("--fl-sync-dtype", "int8", "--fl-error-feedback"), 60),
    Check("sync int4 + error feedback", 2, multi_gpu.sync_mode("--fl-sync-dtype", "int4", "--fl-error-feedback"), 60),
    Check("sync nesterov", 2, multi_gpu.sync_mode("--fl-outer-optimizer", "nesterov"), 60),
    Check("sync overlap 1 (FL+FSDP)", 2,
          multi_gpu.sync_mode("--fl-overlap-steps", "1", "--fl-outer-optimizer", "nesterov"), 60),
    Check("sync fragments 2", 2, multi_gpu.sync_mode("--fl-fragments", "2", "--fl-outer-optimizer", "nesterov"), 60),
    Check("sync overlap 1 (FL+HSDP)", 4, multi_gpu.sync_mode("--fl-overlap-steps", "1", "--fl-hsdp-shard-size", "1",
                                                            "--fl-outer-optimizer", "nesterov", nproc=4), 60),
    Check("dead rank on NCCL", 2, multi_gpu.dead_rank, 240),
    Check("elastic, 2 groups' jobs on NCCL", 2, multi_gpu.elastic_sync, 240, ("torchft",)),
    Check("elastic, a peer killed mid-sync on NCCL", 2, multi_gpu.elastic_peer_lost_mid_sync, 240, ("torchft",)),
]


def missing_package(check: Check) -> str:
    """The first package `check` needs that this Python cannot import ('' when none)."""
    return next((name for name in check.needs if importlib.util.find_spec(name.split(".")[0]) is None
                 or importlib.util.find_spec(name) is None), "")


def plan_lines(checks: list, gpus: int, name: str, budget: float) -> list:
    """What would run on `gpus` GPUs called `name`, each check's budget, and the total."""
    lines = [f"gpu_check --plan: {gpus} x {name}, {budget:.0f} s from the start of tools/gpu_check.sh "
             "(device tool: carry .gpu-carry, run `bash tools/gpu_check.sh --install`)",
             f"  {'setup':<6} {'the carried wheels, installed offline (--install)':<56} {SETUP_SECONDS:>4} s"]
    total = SETUP_SECONDS
    for check in checks:
        if gpus < check.gpus:
            lines.append(f"  {'skip':<6} {check.name:<56} needs {check.gpus} GPUs")
            continue
        total += check.seconds
        over = "" if total <= budget else "  (past the budget: skipped unless earlier checks finish early)"
        lines.append(f"  {'run':<6} {check.name:<56} {check.seconds:>4} s{over}")
    lines.append(f"  total budgeted: {total} s of {budget:.0f}")
    return lines


def run_check(check: Check, ctx: Context) -> Outcome:
    try:
        got = check.run(ctx)
    except subprocess.TimeoutExpired as e:
        return Outcome(f"timed out after {e.timeout:.0f} s (its budget)")
    except Exception as e:  # a check's own failure is that check's result
        return Outcome(f"{type(e).__name__}: {e}")
    return got if isinstance(got, Outcome) else Outcome(got)


def write_results(out: Path, header: dict, results: list, counts: dict) -> None:
    """gpu_check.json (everything) and gpu_check.md (a table a closing note can quote) in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps({**header, "counts": counts, "checks": results}, indent=1))
    rows = [f"| {r['name']} | {r['status']} | {r['seconds']} | {(r.get('text') or r.get('why') or '').replace('|', '/')} |"
            for r in results]
    (out / "gpu_check.md").write_text(
        f"# gpu_check: torch {header['torch']}, {header['gpus']} x {header['gpu_name'] or 'no GPU'}\n\n"
        "| check | result | s | figures or reason |\n| --- | --- | --- | --- |\n" + "\n".join(rows)
        + f"\n\n{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--only", help="run the checks whose name contains this")
    p.add_argument("--plan", action="store_true", help="print what would run on --gpus GPUs and each budget; run nothing")
    p.add_argument("--gpus", type=int, default=LENT[0], help="--plan: the GPUs to plan for (default: the lent H200's 1)")
    p.add_argument("--budget-seconds", type=float, default=BUDGET_SECONDS,
                   help="the whole check's time, counted from the start of gpu_check.sh (default %(default)s)")
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for gpu_check.json and .md (default: $OUT)")
    args = p.parse_args(argv)
    checks = [c for c in CHECKS if not args.only or args.only in c.name]
    if args.plan:
        print("\n".join(plan_lines(checks, args.gpus, LENT[1] if args.gpus == LENT[0] else "GPU",
                                   args.budget_seconds)))
        return 0
    started = float(os.environ.get("GPU_CHECK_STARTED") or time.time())
    deadline = time.monotonic() + args.budget_seconds - (time.time() - started)
    try:
        import torch
    except ImportError:
        print(f"gpu_check: {sys.executable} cannot import torch: run it with a python that has it "
              "(GPU_CHECK_PYTHON=..., or make test's .venv)", file=sys.stderr)
        return 2

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu_name = torch.cuda.get_device_name(0) if gpus else ""
    import fl_megatron

    print(f"gpu_check: torch {torch.__version__}, {gpus} GPU(s)" + (f": {gpu_name}" if gpus else ": every check skipped")
          + f"; fl_megatron from {Path(fl_megatron.__file__).parent}", flush=True)
    counts, results = {"passed": 0, "failed": 0, "skipped": 0}, []
    cannot = {c.name: (f"needs {c.gpus} GPU(s), this machine has {gpus}" if gpus < c.gpus else
                       f"needs {missing_package(c)}, not installed (tools/gpu_bundle.sh carries it; gpu_check.sh "
                       "--install)" if missing_package(c) else "") for c in checks}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for index, check in enumerate(checks):
            # the budgets of the checks still to run are kept for them: what earlier ones saved is this one's
            kept = sum(c.seconds for c in checks[index + 1:] if not cannot[c.name])
            left = deadline - kept - time.monotonic()
            why_not = cannot[check.name] or (
                f"its {check.seconds} s do not fit the {max(left, 0):.0f} s left of the budget"
                if left < check.seconds else "")
            start = time.monotonic()
            if why_not:
                outcome = Outcome(skipped=why_not)
            else:
                work = Path(tmp) / f"check{index}"
                work.mkdir()
                ctx = Context(work, Path(tmp), gpus, gpu_name, deadline - kept)
                outcome = run_check(check, ctx)
            took = round(time.monotonic() - start)
            status = "skipped" if outcome.skipped else "failed" if outcome.problem else "passed"
            counts[status] += 1
            why = outcome.skipped or outcome.problem
            results.append({"name": check.name, "status": status, "seconds": took, "why": why,
                            "text": outcome.text, "figures": outcome.figures})
            if status == "skipped":
                print(f"SKIP {check.name}: {why}", flush=True)
            else:
                print(f"{'FAIL' if why else 'PASS'} {check.name} ({took} s)" + (f": {why or outcome.text}"
                      if why or outcome.text else ""), flush=True)
    if args.out:
        header = {"torch": torch.__version__, "gpus": gpus, "gpu_name": gpu_name, "python": sys.version.split()[0],
                  "budget_seconds": args.budget_seconds, "seconds": round(time.time() - started)}
        write_results(Path(args.out), header, results, counts)
        print(f"results in {Path(args.out) / 'gpu_check.json'} and gpu_check.md", flush=True)
    print(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped", flush=True)
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
