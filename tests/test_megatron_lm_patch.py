"""The Megatron-LM patch series (patches/megatron-lm/) against a real checkout: only when
MEGATRON_LM_DIR names a Megatron-LM checkout at core_v0.16.1 (skipped otherwise).

- `git apply --check` of every patch in the series against the checkout (or, if the checkout is
  patched already, `--check --reverse`);
- tools/apply_megatron_patch.sh on a copy (not a git checkout): applies, then finds nothing to do;
  it refuses a checkout of another version;
- the patched pretrain_gpt.py (through patches/megatron-lm/cpu_launch.py on CPU) lists the --fl-*
  flags in --help and stops a bad layout in validate_args with our message;
- with MEGATRON_LM_E2E=1 as well, tiny GPTs on 4 CPU ranks: 5 iterations (2 groups of 2, H = 2,
  a save at iteration 3) with syncs at 2, 3 (the save) and 4; the engine's options (nesterov +
  int8 + error feedback + overlap, and a ring) train, leave the groups identical at full averages
  and resume exactly from Megatron-LM's checkpoint; TP = 2 and PP = 2 inside a group sync.

Getting a checkout: `git clone https://github.com/NVIDIA/Megatron-LM && git -C Megatron-LM checkout
core_v0.16.1`; the tests copy it and apply the series to the copy.
"""

import os
import re
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


E2E = pytest.mark.skipif(os.environ.get("MEGATRON_LM_E2E") != "1",
                         reason="MEGATRON_LM_E2E=1 runs patched pretrain_gpt.py on 4 CPU ranks (~6 min in all)")
CPU_FLAGS = ["--distributed-backend", "gloo", "--global-batch-size", "8", "--lr-decay-style", "constant",
             "--transformer-impl", "local", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
             "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
             "--no-gradient-accumulation-fusion", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000"]
# bf16 (fp32 parameters make megatron's checkpoint load copy into views of leaves outside no_grad:
# an upstream bug) and no dropout (its CPU random state is not checkpointed)
EXACT = ["--bf16", "--hidden-dropout", "0", "--attention-dropout", "0"]
ADVANCED = ["--fl-outer-optimizer", "nesterov", "--fl-sync-dtype", "int8", "--fl-error-feedback",
            "--fl-overlap-steps", "1"]
PORTS = iter(range(29531, 29600))


def _pretrain(patched: Path, *flags, timeout=600) -> tuple[str, dict]:
    """Run the patched pretrain_gpt.py on 4 CPU ranks; (its output, {iteration: logged lm loss})."""
    # megatron-core's wheel ships the dataset helpers prebuilt; the checkout builds them with make
    import megatron.core.datasets as wheel_datasets

    built = Path(wheel_datasets.__file__).parent / f"helpers_cpp{sysconfig.get_config_var('EXT_SUFFIX')}"
    if built.is_file() and not (patched / "megatron/core/datasets" / built.name).is_file():
        shutil.copy(built, patched / "megatron/core/datasets" / built.name)
    base_bin = os.path.dirname(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))
    env = _env(PATH=f"{base_bin}:{os.environ['PATH']}", CUDA_DEVICE_MAX_CONNECTIONS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", next(PORTS),
           PATCHES / "cpu_launch.py", "pretrain_gpt.py", *TINY, *CPU_FLAGS, *flags]
    result = _run(cmd, cwd=patched, env=env, timeout=timeout)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-5000:]
    losses = {int(m.group(1)): float(m.group(2))
              for m in re.finditer(r"iteration +(\d+)/ +\d+ \|.*?lm loss: ([0-9.E+-]+)", out)}
    return out, losses


@E2E
def test_patched_pretrain_gpt_runs_federated_on_cpu(patched, tmp_path):
    out, losses = _pretrain(patched, "--train-iters", "5", "--num-distributed-optimizer-instances", "2",
                            "--fl-sync-interval", "2", "--save", tmp_path / "ckpt", "--save-interval", "3",
                            "--check-weight-hash-across-dp-replicas-interval", "2")
    for line in ("fl-megatron: sync 1 at iteration 2", "fl-megatron: sync 2 at iteration 3",
                 "fl-megatron: sync 3 at iteration 4", "Weight hashes match after 4 iterations",
                 "successfully saved checkpoint from iteration       3"):
        assert line in out, line
    assert sorted(losses) == [1, 2, 3, 4, 5]
    assert sorted(p.name for p in (tmp_path / "ckpt/fl_megatron/iter_0000003").iterdir()) == \
        [f"rank_{r:05d}-of-00004.safetensors" for r in range(4)]


def _checkpoint_tensors(directory: Path) -> dict:
    """Every tensor of a torch_dist checkpoint, flattened to 'a/b/c' keys (no process group)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    import torch

    dcp_to_torch_save(directory, directory.parent / "flat.pt")
    flat = {}

    def walk(value, key):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}/{k}")
        elif torch.is_tensor(value):
            flat[key] = value
    walk(torch.load(directory.parent / "flat.pt", weights_only=False), "")
    return flat


@E2E
@pytest.mark.parametrize("name, sync", [
    ("nesterov-int8-ef-overlap", ["--num-distributed-optimizer-instances", "2", *ADVANCED]),
    ("gossip-ring", ["--num-distributed-optimizer-instances", "2", "--fl-topology", "ring"]),
])
def test_engine_options_train_sync_identically_and_resume_exactly(patched, tmp_path, name, sync):
    """8 iterations, H = 2, saves at 4: uninterrupted, and stopped at 4 (--exit-interval) then
    resumed with --load. The groups are identical wherever they were all averaged (Megatron-LM's
    weight-hash check), and the resumed run repeats the uninterrupted one exactly."""
    import torch

    common = [*EXACT, *sync, "--train-iters", "8", "--fl-sync-interval", "2", "--save-interval", "4",
              "--check-weight-hash-across-dp-replicas-interval", "2"]
    full_out, full = _pretrain(patched, *common, "--save", tmp_path / "full")
    _, first = _pretrain(patched, *common, "--save", tmp_path / "cut", "--exit-interval", "4")
    resumed_out, second = _pretrain(patched, *common, "--save", tmp_path / "cut", "--load", tmp_path / "cut")
    assert "Weight hashes match after 8 iterations" in full_out and "Weight hashes match after 8" in resumed_out
    assert "fl-megatron: resumed the federation state of iteration 4" in resumed_out
    if name.startswith("gossip"):
        assert ", graph ring" in full_out  # the scheduled syncs mix along the ring; the last one averages
    assert sorted(first) == [1, 2, 3, 4] and sorted(second) == [5, 6, 7, 8]
    for it in (1, 2, 3, 4, 5, 7, 8):
        assert {**first, **second}[it] == full[it], (it, full, first, second)
    # Megatron-LM logs the mean of iterations 5 and 6 at the second iteration after a resume
    assert second[6] == pytest.approx((full[5] + full[6]) / 2, rel=2e-6, abs=0)
    a, b = _checkpoint_tensors(tmp_path / "full/iter_0000008"), _checkpoint_tensors(tmp_path / "cut/iter_0000008")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    ours = sorted((tmp_path / "full/fl_megatron/iter_0000008").iterdir())
    assert len(ours) == 4
    for path in ours:
        assert path.read_bytes() == (tmp_path / "cut/fl_megatron/iter_0000008" / path.name).read_bytes(), path.name


@E2E
@pytest.mark.parametrize("parallel", [["--tensor-model-parallel-size", "2"],
                                      ["--pipeline-model-parallel-size", "2", "--use-tp-pp-dp-mapping"]])
def test_tensor_and_pipeline_parallel_groups_sync(patched, parallel):
    """4 ranks, 2 federation groups of 1 data-parallel rank x TP 2 (or PP 2): the federation's peer
    groups are the ranks at the same model-parallel position, and the hashes match after each sync."""
    out, losses = _pretrain(patched, *EXACT, *parallel, "--num-distributed-optimizer-instances", "2",
                            "--train-iters", "6", "--fl-sync-interval", "2", "--fl-sync-dtype", "int8",
                            "--fl-error-feedback", "--check-weight-hash-across-dp-replicas-interval", "2")
    assert "2 federation groups x 1 replica(s)" in out and "peer group [0, 2]" in out
    for it in (2, 4, 6):
        assert f"fl-megatron: sync {it // 2} at iteration {it}" in out
        assert f"Weight hashes match after {it} iterations" in out
    assert sorted(losses) == list(range(1, 7)) and losses[6] < losses[1]
