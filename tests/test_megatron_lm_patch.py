"""The Megatron-LM patch series (patches/megatron-lm/) against a real checkout: only when
MEGATRON_LM_DIR names a Megatron-LM checkout at core_v0.16.1 (skipped otherwise).

- `git apply --check` of every patch in the series against the checkout (or, if the checkout is
  patched already, `--check --reverse`);
- tools/apply_megatron_patch.sh on a copy (not a git checkout): applies, then finds nothing to do;
  it refuses a checkout of another version;
- the patched pretrain_gpt.py (through patches/megatron-lm/cpu_launch.py on CPU) lists the --fl-*
  flags in --help and stops a bad layout in validate_args with our message;
- with MEGATRON_LM_E2E=1 as well: 5 iterations of a tiny GPT on 4 CPU ranks (2 groups of 2,
  H = 2, a save at iteration 3) must run to the end with syncs at 2, 3 (the save) and 4.
"""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATCHES = ROOT / "patches" / "megatron-lm"
MLM = os.environ.get("MEGATRON_LM_DIR")
pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(not MLM, reason="MEGATRON_LM_DIR (a Megatron-LM checkout at core_v0.16.1) is not set")]
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "2", "--mock-data", "--tokenizer-type",
        "NullTokenizer", "--vocab-size", "512", "--use-distributed-optimizer", "--lr", "1e-3"]


def _run(cmd, cwd=None, env=None, timeout=600):
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _env(**extra):
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


@pytest.fixture(scope="module")
def patched(tmp_path_factory) -> Path:
    """A copy of the checkout (without .git) with the series applied by the tool."""
    copy = tmp_path_factory.mktemp("mlm") / "Megatron-LM"
    shutil.copytree(MLM, copy, ignore=shutil.ignore_patterns(".git", "tests", "docs", "examples", "images"))
    first = _run([ROOT / "tools" / "apply_megatron_patch.sh", copy])
    assert first.returncode == 0, first.stderr
    assert first.stdout.count("applies cleanly") == len((PATCHES / "series").read_text().split())
    again = _run([ROOT / "tools" / "apply_megatron_patch.sh", copy])
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stdout + again.stderr
    return copy


def test_git_apply_check_of_the_series():
    for name in (PATCHES / "series").read_text().split():
        forward = _run(["git", "-C", MLM, "apply", "--check", PATCHES / name])
        if forward.returncode != 0:
            reverse = _run(["git", "-C", MLM, "apply", "--check", "--reverse", PATCHES / name])
            assert reverse.returncode == 0, f"{name} neither applies nor is applied:\n{forward.stderr}"


def test_tool_refuses_another_version(tmp_path):
    fake = tmp_path / "mlm"
    for rel in ("pretrain_gpt.py", "megatron/training/training.py", "megatron/training/arguments.py",
                "megatron/core/package_info.py"):
        (fake / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(MLM) / rel, fake / rel)
    info = fake / "megatron/core/package_info.py"
    info.write_text(info.read_text().replace("PATCH = 1", "PATCH = 2"))
    result = _run([ROOT / "tools" / "apply_megatron_patch.sh", fake])
    assert result.returncode == 1 and "is Megatron-LM 0.16.2" in result.stderr, result.stderr


def test_patched_help_lists_our_flags_and_validation_runs(patched):
    launch = [sys.executable, PATCHES / "cpu_launch.py", "pretrain_gpt.py"]
    helped = _run([*launch, "--help"], cwd=patched, env=_env())
    assert helped.returncode == 0, helped.stderr[-3000:]
    for flag in ("--fl-num-groups", "--fl-sync-interval", "--fl-disable-sync", "--fl-bucket-mb",
                 "--no-fl-replica-split"):
        assert flag in helped.stdout, flag
    bad = _run([*launch, *TINY, "--train-iters", "1", "--num-distributed-optimizer-instances", "2",
                "--fl-num-groups", "2"], cwd=patched, env=_env(WORLD_SIZE="1", RANK="0"))
    assert bad.returncode != 0
    assert "fl-megatron: invalid federated settings" in bad.stderr, bad.stderr[-3000:]
    assert "DP = world/(TP*PP*CP) = 1/(1*1*1) = 1 is not divisible by" in bad.stderr


@pytest.mark.skipif(os.environ.get("MEGATRON_LM_E2E") != "1", reason="MEGATRON_LM_E2E=1 runs 4 CPU ranks (~1 min)")
def test_patched_pretrain_gpt_runs_federated_on_cpu(patched, tmp_path):
    # megatron-core's wheel ships the dataset helpers prebuilt; the checkout builds them with make
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    import megatron.core.datasets as wheel_datasets

    built = Path(wheel_datasets.__file__).parent / f"helpers_cpp{suffix}"
    if built.is_file():
        shutil.copy(built, patched / "megatron/core/datasets" / built.name)
    base_bin = os.path.dirname(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))
    env = _env(PATH=f"{base_bin}:{os.environ['PATH']}", CUDA_DEVICE_MAX_CONNECTIONS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", "29517",
           PATCHES / "cpu_launch.py", "pretrain_gpt.py", *TINY, "--distributed-backend", "gloo",
           "--global-batch-size", "8", "--train-iters", "5", "--lr-decay-style", "constant",
           "--transformer-impl", "local", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
           "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
           "--no-gradient-accumulation-fusion", "--log-interval", "1", "--eval-iters", "0",
           "--eval-interval", "1000", "--num-distributed-optimizer-instances", "2", "--fl-sync-interval", "2",
           "--save", tmp_path / "ckpt", "--save-interval", "3", "--check-weight-hash-across-dp-replicas-interval", "2"]
    result = _run(cmd, cwd=patched, env=env, timeout=800)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-5000:]
    for line in ("fl-megatron: sync 1 at iteration 2", "fl-megatron: sync 2 at iteration 3",
                 "fl-megatron: sync 3 at iteration 4", "Weight hashes match after 4 iterations",
                 "successfully saved checkpoint from iteration       3"):
        assert line in out, line
    assert "iteration        5/       5" in out
