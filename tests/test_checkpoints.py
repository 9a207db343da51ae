"""Checkpoints through the command line: exact resume on every backend, a kill while writing,
SIGTERM, resharding, and the errors a wrong checkpoint gets.

The reference is always the same run uninterrupted: per-step losses and the final parameters
(read back from the final checkpoints) must be identical.
"""

import importlib.util
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from cli_utils import launch, pretrain_command, run_pretrain, step_records
from fl_megatron.checkpoint import TRACKER, published_iterations
from fl_megatron.checkpoint.reader import CheckpointReader
from fl_megatron.config.parallel import FederationConfig
from fl_megatron.costs import checkpoint_bytes, saved_outer_copies
from fl_megatron.faults import FAULT_EXIT_CODE

pytestmark = pytest.mark.timeout(900)

# AdamW with clipping and a cosine schedule over 6 steps; 2 groups of 2, a sync every 4 steps:
# K = 3 is not a multiple of H, so the groups differ (and have different moments) when saved.
ADAMW = ["--optimizer", "adamw", "--lr", "0.003", "--clip-grad", "0.5", "--lr-decay-style", "cosine",
         "--train-iters", "6", "--eval-iters", "0", "--fl-group-size", "2", "--fl-sync-interval", "4"]
NEEDS_DEEPSPEED = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="DeepSpeed is not installed")


def _same_parameters(a: Path, b: Path) -> bool:
    """Every group's every parameter bit-identical in two checkpoints."""
    ra, rb = CheckpointReader(a), CheckpointReader(b)
    assert ra.groups == rb.groups and ra.iteration == rb.iteration
    return all(torch.equal(ra.tensor(n, g), rb.tensor(n, g)) for n in ra.names for g in ra.groups)


def _exact_resume(tmp: Path, backend: str, *extra: str) -> None:
    cache, flags = tmp / "cache", [*ADAMW, "--backend", backend, *extra]
    reference = run_pretrain(4, tmp / "ref", cache, *flags, "--save", str(tmp / "ref_ckpt"))
    ckpt = str(tmp / "ckpt")
    # K = 3 steps, then exit (saving first)
    first = run_pretrain(4, tmp / "run", cache, *flags, "--save", ckpt, "--exit-interval", "3")
    assert [r["step"] for r in first] == [1, 2, 3] and published_iterations(Path(ckpt)) == [3]
    # resumed, killed while writing the step-5 checkpoint: the step-3 one stays the latest
    killed = launch(4, tmp / "run", cache, *flags, "--save", ckpt, "--load", ckpt, "--save-interval", "5",
                    env_extra={"FL_MEGATRON_FAULT": "checkpoint-write:5"})
    assert killed.returncode != 0 and "injected fault checkpoint-write:5" in killed.stderr
    assert f"exitcode  : {FAULT_EXIT_CODE}" in killed.stderr  # the ranks died at the injection point
    assert (Path(ckpt) / TRACKER).read_text().strip() == "3" and published_iterations(Path(ckpt)) == [3]
    assert (Path(ckpt) / ".iter_0000005.staging").is_dir()  # the half-written one, never published
    # resumed again from step 3, to the end, keeping only the newest checkpoint
    run_pretrain(4, tmp / "run", cache, *flags, "--save", ckpt, "--load", ckpt, "--keep-last", "1")
    resumed = step_records(tmp / "run")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in reference]
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in reference]
    counters = ("intra_group_bytes", "inter_group_bytes", "intra_node_bytes", "inter_node_bytes")
    assert [[r[k] for k in counters] for r in resumed] == [[r[k] for k in counters] for r in reference]
    assert resumed[-1]["inter_group_bytes"] > 0  # cumulative across both resumes, not restarted
    assert published_iterations(Path(ckpt)) == [6] and not list(Path(ckpt).glob(".iter_*"))
    assert _same_parameters(Path(ckpt), tmp / "ref_ckpt")
    meta = json.loads((Path(ckpt) / "iter_0000006" / "metadata.json").read_text())
    assert meta["backend"] == backend and meta["federation"]["synced_at_save"] is True
    assert meta["consumed_samples"] == 6 * 2 * 4 and meta["config"]["checkpoint"]["keep_last"] == 1


def test_fsdp2_resume_is_exact_and_survives_a_kill_while_saving(tmp_path):
    _exact_resume(tmp_path, "fsdp2")


@NEEDS_DEEPSPEED
def test_fsdp2_async_save_resumes_exactly_and_survives_a_kill_while_writing(tmp_path):
    """--async-save: the same exact resume, a checkpoint published only once every rank has
    written it (at the next sync, or at the end), and a kill while one is being written leaves
    the previous one the latest."""
    _exact_resume(tmp_path, "fsdp2", "--async-save")


def test_deepspeed_resume_is_exact_and_survives_a_kill_while_saving(tmp_path):
    _exact_resume(tmp_path, "deepspeed")


SPARSE = ("--fl-sync-dtype", "int2", "--fl-topk-density", "0.0156")
INT8 = ("--fl-sync-dtype", "int8")


# int8 in `make test-heavy`: the sparse sync saves and resumes its residuals (decayed at every
# sync) through the same per-rank files, in two fragments, between syncs
@pytest.mark.parametrize("codec,fragments", [pytest.param(INT8, 1, marks=pytest.mark.heavy),
                                             pytest.param(INT8, 2, marks=pytest.mark.heavy), (SPARSE, 2)])
def test_outer_optimizer_and_error_feedback_state_resume_exactly(tmp_path, codec, fragments):
    """The anchors, Nesterov momentum and error-feedback residuals are saved per rank; with
    2 fragments the step-3 checkpoint falls between the syncs of fragment 0 (2) and 1 (4)."""
    _exact_resume(tmp_path, "fsdp2", "--fl-outer-optimizer", "nesterov", *codec,
                  "--fl-error-feedback", "--fl-fragments", str(fragments))
    files = list((tmp_path / "ckpt" / "iter_0000006" / "outer").glob("rank_*.safetensors"))
    assert len(files) == 4
    # the dry run's checkpoint size counts them: anchor + momentum + residual, per rank, 2 groups
    fed = FederationConfig(sync_interval=4, outer_optimizer="nesterov", sync_dtype=codec[1], error_feedback=True,
                           fragments=fragments, topk_density=0.0156 if codec == SPARSE else 0.0)
    reader = CheckpointReader(tmp_path / "ckpt")
    num_params = sum(reader.tensor(n, reader.groups[0]).numel() for n in reader.names)
    with_outer = checkpoint_bytes(num_params, 2, "adamw", outer_copies=saved_outer_copies(fed, 2, 1))["exact"]
    predicted = with_outer - checkpoint_bytes(num_params, 2, "adamw")["exact"]
    saved = sum(f.stat().st_size for f in files)
    assert predicted <= saved <= 1.05 * predicted, (saved, predicted)  # + headers and padding


@pytest.mark.heavy  # 42 s; make test resumes fsdp2 and DeepSpeed exactly through a kill while saving
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")
def test_megatron_resume_is_exact_and_survives_a_kill_while_saving(tmp_path):
    _exact_resume(tmp_path, "megatron")


def _worker_pids(parent: int) -> list[int]:
    """The launcher's child processes (the ranks)."""
    children = Path(f"/proc/{parent}/task/{parent}/children")
    return [int(p) for p in children.read_text().split()] if children.exists() else []


def test_sigterm_saves_exits_zero_and_resumes_exactly(tmp_path):
    """SIGTERM to every rank, as SLURM sends it, in the middle of a run."""
    cache, ckpt = tmp_path / "cache", tmp_path / "ckpt"
    flags = [*ADAMW[:-6], "--train-iters", "200", "--eval-iters", "0", "--fl-group-size", "2",
             "--fl-sync-interval", "4"]
    cmd, env = pretrain_command(4, tmp_path / "run", cache, *flags, "--save", str(ckpt), "--exit-signal-handler")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
        time.sleep(0.2)
    for pid in _worker_pids(proc.pid):
        os.kill(pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    stopped = int((ckpt / TRACKER).read_text())
    assert 2 <= stopped < 200 and "stopping after step" in out and "SIGTERM" in out
    assert stopped % 4 == 0, stopped  # agreed at a sync's vote: the run stops right after that sync
    # resume to step stopped + 5; the uninterrupted reference stops there too (same schedule)
    end = str(stopped + 5)
    run_pretrain(4, tmp_path / "run", cache, *flags, "--save", str(ckpt), "--load", str(ckpt), "--exit-interval", end)
    reference = run_pretrain(4, tmp_path / "ref", cache, *flags, "--save", str(tmp_path / "ref_ckpt"),
                             "--exit-interval", end)
    resumed = step_records(tmp_path / "run")
    assert [r["step"] for r in resumed] == list(range(1, stopped + 6))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in reference]
    assert _same_parameters(ckpt, tmp_path / "ref_ckpt")


def test_sigterm_to_torchrun_saves_but_torchrun_exits_1(tmp_path):
    """What docs/failures.md says of SIGTERM sent to torchrun itself (not to the ranks): torchrun
    forwards it, every rank saves at the agreed step and exits 0 within --shutdown-timeout (torch
    2.13; torch 2.11's torchrun has no such flag and waits 30 s), and torchrun then exits 1 with
    its SignalException although the checkpoint is complete."""
    cache, ckpt = tmp_path / "cache", tmp_path / "ckpt"
    flags = [*ADAMW[:-6], "--train-iters", "200", "--eval-iters", "0", "--fl-group-size", "2",
             "--fl-sync-interval", "4"]
    cmd, env = pretrain_command(4, tmp_path / "run", cache, *flags, "--save", str(ckpt), "--exit-signal-handler")
    from torch.distributed.run import get_args_parser

    if any("--shutdown-timeout" in a.option_strings for a in get_args_parser()._actions):
        cmd.insert(cmd.index("--nproc-per-node"), "--shutdown-timeout=120")  # torch 2.13; 2.11's waits 30 s
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=240)
    stopped = int((ckpt / TRACKER).read_text())
    assert stopped % 4 == 0 and "stopping after step" in out, out[-2000:] + err[-3000:]
    assert proc.returncode == 1 and "SignalException" in err, (proc.returncode, err[-3000:])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["last_step"] == stopped and summary["stopped_early"], summary


def test_fsdp2_resumes_on_other_group_sizes_and_group_counts(tmp_path):
    """Plain SGD with a sync every step equals sharded training on all data, whatever the
    grouping: a checkpoint of 2 groups x 2 ranks resumes on 2 ranks (2 groups x 1 rank, shards
    resharded by torch.distributed.checkpoint; 2 micro-batches each, so the same samples per
    step) and on 1 group of 2 (the group count changes, allowed right after a sync), and both
    continue with the uninterrupted run's losses. Wrong models and backends are refused by name."""
    cache, ckpt = tmp_path / "cache", str(tmp_path / "ckpt")
    sgd = ["--optimizer", "sgd", "--lr", "0.5", "--weight-decay", "0", "--clip-grad", "0", "--eval-iters", "0",
           "--train-iters", "6", "--fl-sync-interval", "1"]
    reference = run_pretrain(4, tmp_path / "ref", cache, *sgd, "--fl-group-size", "2")
    run_pretrain(4, tmp_path / "a", cache, *sgd, "--fl-group-size", "2", "--save", ckpt, "--exit-interval", "3")
    for name, group_size in (("two-groups-of-1", "1"), ("one-group-of-2", "2")):
        proc = launch(2, tmp_path / name, cache, *sgd, "--fl-group-size", group_size,
                      "--gradient-accumulation-steps", "2", "--load", ckpt)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        resumed = step_records(tmp_path / name)
        assert [r["step"] for r in resumed] == [4, 5, 6]
        for a, b in zip(reference[3:], resumed):  # fp32 sums in another order: a few ulps
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (name, a, b)
    assert "resharded" in proc.stdout or "2 groups saved, 1 in this run" in proc.stdout
    # wrong model shape and wrong backend: named, before anything starts
    proc = launch(4, tmp_path / "d", cache, *sgd, "--fl-group-size", "2", "--load", ckpt, "--hidden-size", "128")
    assert proc.returncode != 0 and "hidden_size 64 (checkpoint) vs 128 (run)" in proc.stderr
    if importlib.util.find_spec("deepspeed") is not None:
        proc = launch(4, tmp_path / "e", cache, *sgd, "--fl-group-size", "2", "--load", ckpt, "--backend", "deepspeed")
        assert proc.returncode != 0 and "backend fsdp2 (checkpoint) vs deepspeed (run)" in proc.stderr


def test_configuration_error_reaches_the_user_under_torchrun(tmp_path):
    """Regression: a faster rank's exit made torchrun kill rank 0 before it printed the error."""
    proc = launch(4, tmp_path / "run", tmp_path / "cache", "--fl-num-groups", "1", "--fl-group-size", "3")
    assert proc.returncode != 0
    assert proc.stderr.count("fl_megatron.pretrain: error:") >= 1
    assert "group_size" in proc.stderr


def test_which_checkpoint_load_resumes(tmp_path):
    """--load DIR takes the tracker's iteration, --load DIR/iter_N that one, --load-iteration N
    the one it names; a directory of checkpoints without a tracker is refused (it once trained
    from step 0 without a word), as are two different iterations at once."""
    from fl_megatron.checkpoint import resume_source
    from fl_megatron.config.checkpoint import CheckpointConfig

    root = tmp_path / "ckpt"
    assert resume_source(CheckpointConfig(load=str(root))) is None  # nothing there yet: a fresh start
    root.mkdir()
    assert resume_source(CheckpointConfig(load=str(root))) is None
    for n in (4, 8):
        (root / f"iter_{n:07d}").mkdir()
    with pytest.raises(ValueError, match="holds checkpoints of iterations 4, 8 but no latest_checkpointed"):
        resume_source(CheckpointConfig(load=str(root)))
    (root / TRACKER).write_text("8\n")
    assert resume_source(CheckpointConfig(load=str(root))) == (root, 8)
    assert resume_source(CheckpointConfig(load=str(root / "iter_0000004"))) == (root, 4)
    assert resume_source(CheckpointConfig(load=str(root), load_iteration=4)) == (root, 4)
    assert resume_source(CheckpointConfig(load=str(root / "iter_0000004"), load_iteration=4)) == (root, 4)
    with pytest.raises(ValueError, match="iter_0000005: no such checkpoint directory .* has iterations 4, 8"):
        resume_source(CheckpointConfig(load=str(root / "iter_0000005")))
    with pytest.raises(ValueError, match="names iteration 4 but --load-iteration is 8"):
        resume_source(CheckpointConfig(load=str(root / "iter_0000004"), load_iteration=8))
    with pytest.raises(ValueError, match="needs --load DIR"):
        CheckpointConfig(load_iteration=4).validate()


def test_state_kept_beside_the_shards_loads_onto_their_device():
    """Outer anchors and residuals load where the rank's shards are (cuda:N on local rank N),
    not on the mesh's device type ("cuda" alone is cuda:0 for safetensors)."""
    from fl_megatron.checkpoint.manager import shard_device

    class Shards:
        def __init__(self, tensors):
            self.tensors = tensors

        def local_shards(self):
            return self.tensors

    assert shard_device(Shards([torch.empty(3, device="meta")])) == torch.device("meta")
    assert shard_device(Shards([])) == torch.device("cpu")
