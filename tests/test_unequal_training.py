"""Training in groups of unequal size end to end (6 CPU ranks, gloo, FSDP2): a federation of a
4-rank and a 2-rank group against the same two groups trained independently (syncing off, the
same seeds and data), whose mean is what every sync must give, bit for bit in fp32 (the shards,
and with --fl-inner-state average Adam's moments, whole or one fragment's window); a sick group
left out takes the other's state, and a run resumes exactly."""

import os

import pytest
import torch

from fl_megatron.costs import wire_bytes_per_element
from fl_megatron.local_ranks import run_ranks
from fl_test_utils import make_trainer, tiny_config

pytestmark = pytest.mark.timeout(600)


def _config(run_dir, cache, sizes="4,2", shards="", **kwargs):
    cfg = tiny_config(run_dir, cache, group_size=None, **kwargs)
    cfg.federation.group_sizes, cfg.federation.hsdp_shard_sizes = sizes, shards
    cfg.parallel.ranks_per_node = 6
    return cfg


def _full(trainer) -> dict:
    return {k: v.tolist() for k, v in trainer.backend.full_state_dict().items()}


def _flat(state: dict) -> torch.Tensor:
    """A full state dict as one flat tensor, in the model's order."""
    return torch.cat([torch.tensor(v).reshape(-1) for v in state.values()])


def _moments(trainer) -> tuple:
    """(group, tensors' sizes, each Adam moment stream as (start, stop, values) per tensor): this
    rank's part of the moments, in the atom plan's order."""
    atoms = trainer.engine.state.averaging.atoms
    plan, rank = atoms.plan, atoms.groups.rank
    streams = trainer.backend.atom_optimizer_state()[0]
    return plan.group_of(rank), list(plan.numels), \
        [[(*plan.shard_range(rank, t), s.tolist()) for t, s in enumerate(stream)] for stream in streams]


def _group_moments(parts: list) -> dict:
    """Each group's whole moments (one flat tensor per stream) from its ranks' `_moments`."""
    out = {}
    for group, numels, streams in parts:
        whole = out.setdefault(group, [torch.full((sum(numels),), float("nan")) for _ in streams])
        offsets = [sum(numels[:t]) for t in range(len(numels))]
        for flat, stream in zip(whole, streams):
            for offset, (start, stop, values) in zip(offsets, stream):
                flat[offset + start:offset + stop] = torch.tensor(values)
    assert all(not torch.isnan(flat).any() for whole in out.values() for flat in whole)
    return out


def _job(rank, world, tmp, cache):
    out = {}
    for case, shards in (("fsdp", ""), ("hsdp", "2,1")):
        # the reference: the groups alone, two steps each
        alone = make_trainer(_config(f"{tmp}/{case}/alone", cache, shards=shards, sync_interval=0, steps=2))
        alone.train()
        out[f"{case}_alone"] = (alone.group, _full(alone))
        alone.close()
        # the federation: H = 2, so a sync after step 2 (the last)
        fed = make_trainer(_config(f"{tmp}/{case}/fed", cache, shards=shards, sync_interval=2, steps=4))
        fed.step(0)
        out[f"{case}_after_1"] = _full(fed)
        fed.step(1)
        out[f"{case}_after_2"] = _full(fed)
        fed.close()
    # 2 fragments, H = 4: after step 2 only fragment 0 (the first half of the model's elements, in the
    # model's order, the same in both groups) is averaged; fragment 1 is each group's own
    fragments = _config(f"{tmp}/fragments", cache, sync_interval=4, steps=4)
    fragments.federation.fragments = 2
    trainer = make_trainer(fragments)
    trainer.step(0)
    out["fragments_moved"] = trainer.step(1).sync.fragments
    out["fragments_after_2"] = _full(trainer)
    trainer.close()
    # --fl-inner-state average: Adam's moments after the sync are the mean of the groups' alone
    # (2 fragments, H = 4, 2 of 4 steps: the sync after step 2 averages fragment 0's window only)
    for name, interval, fragments in (("moments_alone", 0, 1), ("moments_fed", 2, 1), ("moments_fragment", 4, 2)):
        cfg = _config(f"{tmp}/{name}", cache, sync_interval=interval, steps=2 * fragments, optimizer="adamw", lr=1e-3)
        cfg.federation.inner_state, cfg.federation.fragments = "average", fragments
        trainer = make_trainer(cfg)
        for i in range(2):
            trainer.step(i)
        out[name] = _moments(trainer)
        trainer.close()
    # group 1 turns sick (a NaN in its shards after step 2): the sync leaves it out, every rank takes group 0's
    os.environ["FL_MEGATRON_FAULT"] = "nan-shard:1@2"
    sick = make_trainer(_config(f"{tmp}/sick", cache, sync_interval=2, steps=4))
    sick.step(0)
    out["sick_sync"] = sick.step(1).sync.sick_groups
    out["sick_after_2"] = _full(sick)
    sick.close()
    del os.environ["FL_MEGATRON_FAULT"]
    # an outer optimizer (nesterov) over atoms, exact, and in int8 with error feedback, 2 fragments and an
    # overlapped sync (HSDP: the residuals live in each replica's slices): the groups end identical
    # (and the same with the inner moments averaged, each fragment's window in its turn)
    for name, dtype, shards, inner in (("nesterov", "fp32", "", "keep"), ("nesterov_int8", "int8", "2,1", "keep"),
                                       ("int8_moments", "int8", "2,1", "average")):
        cfg = _config(f"{tmp}/{name}", cache, shards=shards, sync_interval=4, steps=6, optimizer="adamw", lr=1e-3)
        cfg.federation.outer_optimizer, cfg.federation.sync_dtype = "nesterov", dtype
        cfg.federation.error_feedback = dtype != "fp32"
        cfg.federation.fragments, cfg.federation.overlap_steps = (2, 1) if dtype != "fp32" else (1, 0)
        cfg.federation.inner_state = inner
        cfg.federation.bucket_mb = 0.05  # several buckets per owner tuple
        trainer = make_trainer(cfg)
        syncs = [trainer.step(i).sync for i in range(6)]
        out[f"{name}_synced"] = [i + 1 for i, s in enumerate(syncs) if s is not None]
        out[f"{name}_end"] = _full(trainer)
        out[f"{name}_residuals"] = sum("residual." in k for k in trainer.engine.state_tensors())
        out[f"{name}_bytes"] = trainer.ledger.by_scope["inter-group"]
        atoms = trainer.engine.state.averaging.atoms
        out[f"{name}_elements"] = sum(a.length for a in atoms.plan.rank_atoms(atoms.groups.rank))
        out[f"{name}_moments"] = _moments(trainer)
        trainer.close()
    return out


def test_groups_of_4_and_2_ranks_train_and_sync_to_the_mean_of_the_groups_alone(tmp_path):
    results = run_ranks(6, _job, str(tmp_path), str(tmp_path / "cache"), timeout=600)
    for case in ("fsdp", "hsdp"):
        alone = {}
        for r in results:
            group, state = r[f"{case}_alone"]
            alone.setdefault(group, state)
        a, b = ({k: torch.tensor(v) for k, v in alone[g].items()} for g in (0, 1))
        assert any(not torch.equal(a[k], b[k]) for k in a)  # the groups trained apart
        for rank, r in enumerate(results):
            after = {k: torch.tensor(v) for k, v in r[f"{case}_after_2"].items()}
            for k in a:
                assert torch.equal(after[k], (a[k] + b[k]) / 2), (case, rank, k)
        # between syncs each group holds its own model: step 1's states differ across the groups
        first = {g: r[f"{case}_after_1"] for g, r in zip((0, 0, 0, 0, 1, 1), results)}
        assert first[0] != first[1]
    # fragment 0: the mean of the groups alone; fragment 1: each group's own state
    alone = {group: _flat(state) for group, state in (r["fsdp_alone"] for r in results)}
    half = -(-alone[0].numel() // 2)
    for r in results:
        assert r["fragments_moved"] == (0,)
        mine = _flat(r["fragments_after_2"])
        assert torch.equal(mine[:half], (alone[0][:half] + alone[1][:half]) / 2)
        assert torch.equal(mine[half:], alone[r["fsdp_alone"][0]][half:])
    group_0_alone = next(r["fsdp_alone"][1] for r in results if r["fsdp_alone"][0] == 0)
    assert all(r["sick_sync"] == (1,) and r["sick_after_2"] == group_0_alone for r in results)
    # overlapped: the fragment syncs launched after steps 2 and 4 land a step later; step 6 syncs all
    assert results[0]["nesterov_synced"] == [4, 6] and results[0]["nesterov_int8_synced"] == [3, 5, 6]
    for name in ("int8_moments", "nesterov", "nesterov_int8"):
        ends = [r[f"{name}_end"] for r in results]
        assert all(e == ends[0] for e in ends), name
    assert ends[0] != results[0]["nesterov_end"]  # int8 is not the exact sync
    assert all(r["nesterov_int8_residuals"] > 1 and r["nesterov_residuals"] == 0 for r in results)
    # the moments: averaged (each fragment in its turn, the last sync all) or each group's own
    kept, averaged = (_group_moments([r[f"{name}_moments"] for r in results]) for name in ("nesterov_int8",
                                                                                            "int8_moments"))
    assert all(not torch.equal(a, b) for a, b in zip(kept[0], kept[1]))
    assert len(averaged[0]) == 2 and all(torch.equal(a, b) for a, b in zip(averaged[0], averaged[1]))
    # at a sync the moments are the mean of the groups' own, bit for bit (fp32)
    alone, fed = (_group_moments([r[name] for r in results]) for name in ("moments_alone", "moments_fed"))
    assert all(not torch.equal(a, b) for a, b in zip(alone[0], alone[1]))
    fragment = _group_moments([r["moments_fragment"] for r in results])
    half = -(-alone[0][0].numel() // 2)
    for group in (0, 1):
        assert all(torch.equal(f, (a + b) / 2) for f, a, b in zip(fed[group], alone[0], alone[1])), group
        for f, a, b, own in zip(fragment[group], alone[0], alone[1], alone[group]):
            assert torch.equal(f[:half], (a[:half] + b[:half]) / 2) and torch.equal(f[half:], own[half:]), group
    # int8 puts about a quarter of fp32's bytes on the wire (the per-block scales and padding on top)
    assert all(0.2 < r["nesterov_int8_bytes"] / r["nesterov_bytes"] < 0.4 for r in results[:1])
    # the cost model's count: each rank's atom elements per sync at the sync's wire bytes per element;
    # fp32 (syncs at 4 and 6) exactly; int8 (fragment 0 at 3, fragment 1 at 5, both at 6: each element
    # twice) padded to whole 256-element blocks per group in each bucket (2 groups x 256 at most)
    for r in results:
        assert r["nesterov_bytes"] == 2 * r["nesterov_elements"] * wire_bytes_per_element("fp32")
    for r in results[4:]:  # group 1 (FSDP over 2; group 0's HSDP replicas split its atoms between them)
        model = 2 * r["nesterov_int8_elements"] * wire_bytes_per_element("int8")
        assert model <= r["nesterov_int8_bytes"] <= model * 1.05, (r["nesterov_int8_bytes"], model)


def test_a_run_of_groups_of_2_and_1_ranks_resumes_exactly_and_exports(tmp_path):
    """torchrun, the flags a user gives: nesterov over atoms, a checkpoint at step 4 (the run
    stopped there) resumed to step 6 with the uninterrupted run's losses bit for bit; the summary
    records every group; the checkpoint exports to Hugging Face."""
    import json
    import subprocess
    import sys

    from cli_utils import launch, step_records

    cache, ckpt = tmp_path / "cache", str(tmp_path / "ckpt")
    flags = ("--train-iters", "6", "--fl-group-sizes", "2,1", "--fl-sync-interval", "2", "--ranks-per-node", "3",
             "--optimizer", "adamw", "--lr", "1e-3", "--fl-outer-optimizer", "nesterov")
    runs = {"whole": (), "first": ("--exit-interval", "4", "--save", ckpt, "--save-interval", "2"),
            "rest": ("--save", ckpt, "--load", ckpt)}
    for name, extra in runs.items():
        proc = launch(3, tmp_path / name, cache, *flags, *extra, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    losses = {name: {r["step"]: r["group_losses"] for r in step_records(tmp_path / name)} for name in ("whole", "rest")}
    assert sorted(losses["rest"]) == [5, 6] and all(losses["whole"][k] == v for k, v in losses["rest"].items())
    layout = json.loads((tmp_path / "whole" / "summary.json").read_text())["layout"]
    assert (layout["group_sizes"], layout["hsdp_shard_sizes"], layout["num_groups"]) == ([2, 1], [2, 1], 2)
    export = subprocess.run([sys.executable, "tools/convert_checkpoint_to_hf.py", "--checkpoint", ckpt, "--output",
                             str(tmp_path / "hf")], capture_output=True, text=True, timeout=300)
    assert export.returncode == 0 and (tmp_path / "hf" / "config.json").exists(), export.stderr[-2000:]


def _assert_the_mean_of_the_groups_alone(results: list) -> None:
    """Every rank's state after the sync ("fed") is the mean of the two groups' states trained
    alone ("alone"), bit for bit, and the groups alone had moved apart; so are the Adam moments
    (--fl-inner-state average), gathered from every rank's atom streams."""
    alone = {group: state for group, state in (r["alone"] for r in results)}
    a, b = ({k: torch.tensor(v) for k, v in alone[g].items()} for g in (0, 1))
    assert any(not torch.equal(a[k], b[k]) for k in a)
    for rank, r in enumerate(results):
        after = {k: torch.tensor(v) for k, v in r["fed"][1].items()}
        for k in a:
            assert torch.equal(after[k], (a[k] + b[k]) / 2), (rank, k)
    alone, fed = (_group_moments([r[f"{name}_moments"] for r in results]) for name in ("alone", "fed"))
    assert len(alone[0]) == 2 and all(not torch.equal(a, b) for a, b in zip(alone[0], alone[1]))
    for group in (0, 1):
        assert all(torch.equal(f, (a + b) / 2) for f, a, b in zip(fed[group], alone[0], alone[1])), group


SMALL_PERSISTENCE = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 2000}}


def _deepspeed_job(rank, world, tmp, cache):
    out = {}
    for name, h in (("alone", 0), ("fed", 2)):
        cfg = _config(f"{tmp}/ds-{name}", cache, sizes="3,1", sync_interval=h, steps=2, backend="deepspeed",
                      deepspeed=SMALL_PERSISTENCE, optimizer="adamw", lr=1e-3)
        cfg.parallel.ranks_per_node, cfg.federation.inner_state = 4, "average"
        trainer = make_trainer(cfg)
        trainer.train()
        out[name], out[f"{name}_moments"] = (trainer.group, _full(trainer)), _moments(trainer)
        masters = trainer.backend.optimizer.fp32_partitioned_groups_flat
        used = [torch.zeros(m.numel(), dtype=torch.bool) for m in masters]
        for i, _, offset, _, valid in trainer.backend._param_spans():
            used[i][offset:offset + valid] = True
        out[f"{name}_padding_zero"] = all(bool((m[~u] == 0).all()) for m, u in zip(masters, used))
        trainer.close()
    return out


def test_deepspeed_groups_of_3_and_1_ranks_sync_to_the_mean_of_the_groups_alone(tmp_path):
    """ZeRO-3 over 3 ranks (tails padded; cuts the FSDP2 rule would not make) beside 1, cut into
    atoms by the flat rule: the sync gives the mean of the two groups trained alone, bit for bit,
    and the padding stays zero."""
    results = run_ranks(4, _deepspeed_job, str(tmp_path), str(tmp_path / "cache"), timeout=600)
    _assert_the_mean_of_the_groups_alone(results)
    assert all(r["fed_padding_zero"] and r["alone_padding_zero"] for r in results)


def _megatron_job(rank, world, tmp, cache):
    out = {}
    for name, h in (("alone", 0), ("fed", 2)):
        cfg = _config(f"{tmp}/mc-{name}", cache, sizes="2,1", sync_interval=h, steps=2, backend="megatron",
                      optimizer="adamw", lr=1e-3)
        cfg.parallel.ranks_per_node, cfg.federation.inner_state = 3, "average"
        trainer = make_trainer(cfg)
        trainer.train()
        out[name], out[f"{name}_moments"] = (trainer.group, _full(trainer)), _moments(trainer)
        trainer.close()
    return out


def test_megatron_groups_of_2_and_1_ranks_sync_to_the_mean_of_the_groups_alone(tmp_path):
    """megatron-core's DistributedOptimizer cuts its padded buffers, not the parameters: the plan
    gathers every rank's ranges at start-up; the sync gives the mean of the groups alone, bit for bit."""
    _assert_the_mean_of_the_groups_alone(run_ranks(3, _megatron_job, str(tmp_path), str(tmp_path / "cache"),
                                                   timeout=600))
