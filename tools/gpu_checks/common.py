"""What the GPU checks share: a check's outcome, the small run every check starts from, and the
subprocess that runs `torchrun -m fl_megatron.pretrain` on CUDA."""

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--model", "llama-tiny", "--num-layers", "2", "--hidden-size", "128", "--ffn-hidden-size", "352",
         "--vocab-size", "4096", "--seq-length", "64", "--micro-batch-size", "2", "--log-interval", "1",
         "--eval-iters", "0", "--mock-data", "--optimizer", "adamw", "--lr", "1e-3", "--lr-decay-style", "constant"]
# the card's dense bf16 rate as measured on the lent H200 (an 8192^3 product, KINDS.md: 769-798
# TFLOP/s on random data): MFU is against what the card does, not its datasheet
MEASURED_BF16_TFLOPS = {"H200": 790.0}
# two processes of one GPU meet on gloo (NCCL refuses two ranks of a communicator on one GPU)
ONE_GPU_GLOO = {"FL_MEGATRON_DIST_BACKEND": "gloo"}


@dataclass
class Outcome:
    """A check's result: `problem` empty when it passed; `skipped` when it could not run here
    (a package the machine lacks, a collective gloo cannot do on CUDA); `figures` for the JSON
    and `text` for its line."""

    problem: str = ""
    figures: dict = field(default_factory=dict)
    text: str = ""
    skipped: str = ""


@dataclass
class Check:
    name: str
    gpus: int                                       # GPUs it needs
    run: Callable[["Context"], "Outcome | str"]    # -> Outcome, or "" (passed) / why it failed
    seconds: int = 60                               # its share of the time budget (--plan), and its time limit
    needs: tuple = ()                               # Python packages it imports (a missing one: skipped)


@dataclass
class Context:
    """Where a check runs: its own folder, a folder the checks share, the GPUs, and its deadline."""

    work: Path
    shared: Path
    gpus: int
    gpu_name: str
    deadline: float  # time.monotonic() by which the check must be done (its budget)

    def left(self) -> float:
        """Seconds until the deadline (at least 1): the time limit of what the check starts next."""
        return max(1.0, self.deadline - time.monotonic())


def pretrain(ctx: Context, name: str, nproc: int, *flags: str, env: dict | None = None,
             base: tuple | list = tuple(SMALL)) -> subprocess.CompletedProcess:
    """`base` (SMALL) + `flags` under torchrun with `nproc` ranks on CUDA, run dir work/name,
    killed at the check's deadline."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "fl_megatron.pretrain", *base, "--run-dir", str(ctx.work / name), *flags]
    full_env = {**os.environ, "FL_MEGATRON_DEVICE": "cuda", "FL_MEGATRON_CACHE": str(ctx.work / "cache"),
                **(env or {})}
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=ctx.left())


def script(path: str, *args: str, nproc: int = 0, env: dict | None = None, timeout: float = 120) -> dict:
    """Run tools/gpu_checks/`path` (under torchrun with `nproc` ranks when nproc > 0) and return the
    JSON object its last stdout line holds; RuntimeError with its last line when it fails."""
    target = str(ROOT / "tools" / "gpu_checks" / path)
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), target]
           if nproc else [sys.executable, target]) + list(args)
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode:
        raise RuntimeError(failed(proc))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def step_records(run_dir: Path) -> list[dict]:
    """One record per logged step over the federation (fl_megatron.training.run_files)."""
    from fl_megatron.training.run_files import logged_steps

    return logged_steps(run_dir)


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in step_records(run_dir)]


def read_records(path: Path) -> list[dict]:
    from fl_megatron.training.run_files import read_jsonl

    return read_jsonl(path)


def groups_identical(checkpoint: Path) -> bool:
    """Whether every group's saved tensors equal group 0's, bit for bit."""
    import torch
    from fl_megatron.checkpoint.reader import CheckpointReader

    reader = CheckpointReader(checkpoint)
    return all(torch.equal(reader.tensor(n, 0), reader.tensor(n, g)) for n in reader.names for g in reader.groups)


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def finite(values) -> bool:
    return all(v is not None and math.isfinite(v) for v in values)


def failed(proc: subprocess.CompletedProcess) -> str:
    """`exit N: <the last line it printed>`, the line an error names its cause on."""
    text = (proc.stderr or proc.stdout).strip()
    return f"exit {proc.returncode}: {text.splitlines()[-1][:240] if text else ''}"


def card_tflops(name: str) -> float | None:
    """The measured bf16 TFLOP/s of the card called `name` ("NVIDIA H200"), None if not measured."""
    return next((rate for card, rate in MEASURED_BF16_TFLOPS.items() if card in name), None)
