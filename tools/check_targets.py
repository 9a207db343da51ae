#!/usr/bin/env python3
"""Each README make target in an environment of its own, as on a fresh machine.

`make test`'s environment holds every extra, so it hides a missing install step of the smaller
targets. This copies the working tree (tracked and untracked files, nothing git ignores: no
.venv, no runs/) once per target into a scratch directory, with an empty data cache, and runs the
target there briefly with `make`, which builds that target's own environment from scratch. Each
check also reads what the target printed (the demo's final line, the continued prompt, every
elastic group's last line). Prints one line per check and a table of times; exits 1 if any failed.

    python3 tools/check_targets.py                 # every target (about 10 minutes on 2 cores)
    python3 tools/check_targets.py --only demo-hf  # one (demo-hf runs the demo first, as a user would)
    python3 tools/check_targets.py --keep          # keep the scratch copies (their logs)

`make check-targets` runs it; CI runs it after `make test`.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
SHORT = "--train-iters 16 --eval-interval 0 --log-interval 4"
CONTINUED = r"^def read\(self, path\):[\s\S]*?\S"  # generate_hf.py's output: the prompt, then more


@dataclass(frozen=True)
class Step:
    """One `make` command in a target's copy, and what its output must show."""

    make: list
    expect: tuple = ()  # regular expressions that must each match the output
    env: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Check:
    name: str
    steps: tuple
    why: str


def _hf_version_step(spec: str) -> Step:
    """Load the exported directory again after installing another transformers (`spec`)."""
    return Step(["pip-then-generate", spec], (r"^transformers 4\.", CONTINUED))


CHECKS = (
    Check("demo", (Step(["demo", f"ARGS={SHORT}"], (r"done: 16 steps in .*final train loss \d",
                                                    r"Hugging Face export of the groups' average")),),
          "the base install trains the demo"),
    Check("demo-hf", (Step(["demo", f"ARGS={SHORT}"], (r"done: 16 steps",)),
                      Step(["demo-hf"], (r"runs/demo/ckpt-hf", CONTINUED)),
                      _hf_version_step("transformers>=4.45,<5")),
          "the hf extra exports and generates, with transformers 5 and then 4"),
    Check("demo-deepspeed", (Step(["demo-deepspeed", f"ARGS={SHORT}"], (r"done: 16 steps in ",)),),
          "the deepspeed extra, under the deepspeed launcher"),
    Check("demo-elastic", (Step(["demo-elastic", f"ARGS={SHORT}"],
                                (r"group 0\b.*done: 16 steps in ", r"group 1\b.*done: 16 steps in ",
                                 r"group 2\b.*done: 16 steps in ")),),
          "the elastic extra: a lighthouse and 3 groups"),
    Check("demo-megatron", (Step(["demo", f"ARGS=--backend megatron {SHORT}"], (r"done: 16 steps in ",)),),
          "the megatron extra (megatron-core)"),
)


def copy_tree(dest: Path) -> None:
    """The working tree as a fresh clone would have it, plus uncommitted and untracked files."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def _command(step: Step, python: str) -> list:
    if step.make[0] == "pip-then-generate":
        bin_dir = ".venv/bin"
        return ["bash", "-c", f"{bin_dir}/python -m pip install -q '{step.make[1]}' && "
                f"{bin_dir}/python -c 'import transformers; print(\"transformers\", transformers.__version__)' && "
                f"{bin_dir}/python tools/generate_hf.py runs/demo/ckpt-hf --max-new-tokens 8"]
    return ["make", *step.make, f"PYTHON={python}"]


def run_check(check: Check, scratch: Path, python: str, timeout: float) -> tuple[bool, float, str]:
    """(passed, seconds, what went wrong or the last line shown) of one check in its own copy."""
    work = scratch / check.name
    work.mkdir(parents=True)
    copy_tree(work)
    env = {**os.environ, "FL_MEGATRON_CACHE": str(work / ".cache"), "OMP_NUM_THREADS": "1"}
    env.pop("VIRTUAL_ENV", None)
    begin = time.monotonic()
    shown = ""
    for number, step in enumerate(check.steps):
        log = work / f"step{number}.log"
        command = _command(step, python)
        try:
            with open(log, "w") as out:
                done = subprocess.run(command, cwd=work, env={**env, **step.env}, stdout=out, stderr=subprocess.STDOUT,
                                      timeout=max(1.0, timeout - (time.monotonic() - begin)))
        except subprocess.TimeoutExpired:
            return False, time.monotonic() - begin, f"`{' '.join(command)}` ran past {timeout:.0f} s (log {log})"
        text = log.read_text(errors="replace")
        if done.returncode != 0:
            return False, time.monotonic() - begin, (f"`{' '.join(command)}` exited {done.returncode}:\n"
                                                     + _tail(text))
        missing = [pattern for pattern in step.expect if not re.search(pattern, text, re.M)]
        if missing:
            return False, time.monotonic() - begin, (f"`{' '.join(command)}` did not print {missing}:\n" + _tail(text))
        shown = next((m.group(0) for pattern in reversed(step.expect) if (m := re.search(pattern, text, re.M))), shown)
    return True, time.monotonic() - begin, shown


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join("    " + line for line in text.splitlines()[-lines:])


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=[c.name for c in CHECKS], help="run only these checks")
    parser.add_argument("--python", default=os.environ.get("PYTHON", "python3"),
                        help="the Python every environment is made with (make's PYTHON)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds each check may take")
    parser.add_argument("--scratch", type=Path, help="where the copies go (default: a new temporary directory)")
    parser.add_argument("--keep", action="store_true", help="keep the copies (default: removed when all passed)")
    args = parser.parse_args(argv)
    checks = [c for c in CHECKS if not args.only or c.name in args.only]
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="fl-megatron-targets-"))
    scratch.mkdir(parents=True, exist_ok=True)
    print(f"check_targets: {len(checks)} target(s), each in a fresh copy under {scratch}", flush=True)
    results = []
    for check in checks:
        print(f"  {check.name}: {check.why} ...", flush=True)
        passed, seconds, text = run_check(check, scratch, args.python, args.timeout)
        results.append((check.name, passed, seconds))
        print(f"  {check.name}: {'passed' if passed else 'FAILED'} in {seconds:.0f} s"
              + (f" ({text.strip()[:160]})" if passed else f"\n{text}"), flush=True)
    failed = [name for name, passed, _ in results if not passed]
    print("\n| target | result | seconds |\n| --- | --- | --- |")
    for name, passed, seconds in results:
        print(f"| {name} | {'passed' if passed else 'FAILED'} | {seconds:.0f} |")
    print(f"\ncheck_targets: {len(results) - len(failed)} passed, {len(failed)} failed", flush=True)
    if not failed and not args.keep and args.scratch is None:
        shutil.rmtree(scratch, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
