"""The README's CPU path, run as the README writes it: the block between its
`readme-cpu-path` markers goes to bash unchanged, in a fresh directory that sees the project's
tools, package and environment; then what each command should have left behind is checked."""

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fl_megatron.checkpoint import published_iterations
from fl_megatron.training.run_files import logged_steps

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(600)


def readme_block(marker: str = "readme-cpu-path") -> str:
    """The bash between `<!-- MARKER: start -->` and `<!-- MARKER: end -->`, without its fences."""
    text = (ROOT / "README.md").read_text()
    start, end = f"<!-- {marker}: start -->", f"<!-- {marker}: end -->"
    assert text.count(start) == 1 and text.count(end) == 1, f"README.md needs one {start} ... {end} block"
    lines = text.split(start)[1].split(end)[0].strip().splitlines()
    assert lines[0] == "```bash" and lines[-1] == "```", lines[:1] + lines[-1:]
    return "\n".join(lines[1:-1]) + "\n"


def _workdir(tmp: Path) -> Path:
    """A directory like a fresh clone's root: tools/, the package and .venv (the running
    interpreter's environment when the checkout has none)."""
    work = tmp / "clone"
    work.mkdir()
    for name in ("tools", "fl_megatron", "examples"):
        (work / name).symlink_to(ROOT / name)
    if (ROOT / ".venv" / "bin" / "activate").is_file():
        (work / ".venv").symlink_to(ROOT / ".venv")
    else:
        (work / ".venv" / "bin").mkdir(parents=True)
        (work / ".venv" / "bin" / "activate").write_text(f'export PATH="{Path(sys.executable).parent}:$PATH"\n')
    return work


def test_the_readme_cpu_path_runs_as_written(tmp_path):
    work = _workdir(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env["FL_MEGATRON_CACHE"] = str(tmp_path / "cache")
    start = time.perf_counter()
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", readme_block()], cwd=work, env=env,
                          capture_output=True, text=True, timeout=480)
    seconds = time.perf_counter() - start
    print(f"README CPU path: {seconds:.1f} s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    q = work / "runs" / "quickstart"
    # 1-2: the tokenizer and the dataset
    assert (q / "tok.model").is_file() and (q / "corpus_text_document.idx").is_file()
    # 3-4: stopped after 8 with a checkpoint, the dry run named it, the resume went on to 12
    assert published_iterations(q / "ckpt") == [8, 12]
    assert "resume: runs/quickstart/ckpt/iter_0000008 at step 8 (fsdp2" in proc.stdout
    steps = logged_steps(q / "run")
    assert [r["step"] for r in steps] == [4, 8, 12]
    inter = [r["inter_group_bytes"] for r in steps]
    assert inter[0] > 0 and inter[2] - inter[1] == inter[1] - inter[0], inter  # cumulative over the resume
    records = [json.loads(line) for line in (q / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval_loss" in r] == [8, 12]  # the stop at 8 evaluated first
    # 5-6: transformers loaded the export with its tokenizer and generated from the prompt
    assert "'def read(self, path):" in proc.stdout
    config = json.loads((q / "hf" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    # 7: continued from the exported weights: below the loss a fresh start has after as many steps
    fresh, continued = steps[0]["loss"], logged_steps(q / "from-hf")[0]["loss"]
    assert continued < fresh < math.log(1024) + 0.5, (continued, fresh)
