"""DeepSpeed ZeRO-3 backend, with several CPU ranks (gloo): exactness of FL+FSDP and FL+HSDP
against ZeRO-3 over all ranks and against the FSDP2 backend, and what a sync leaves behind.

References as for FSDP2: with plain SGD and H = 1, FL over F groups must equal sharded training
over all ranks on the same data; syncs make groups bit-identical; between syncs they differ.
"""

import pytest
import torch

pytest.importorskip("deepspeed")

from fl_megatron.local_ranks import run_ranks  # noqa: E402
from fl_test_utils import (direct_variance, make_trainer, max_diff, peers_identical,  # noqa: E402
                           tiny_config, train_and_gather)

pytestmark = pytest.mark.timeout(900)

# Matrices (64x64 and larger) partitioned only; norms stay gathered ("persistent").
SMALL_PERSISTENCE = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 2000}}


def _ds(tmp, cache, name, **kwargs):
    return tiny_config(f"{tmp}/{name}", cache, backend="deepspeed", **kwargs)


def _padding_report(backend) -> tuple[bool, bool]:
    """(every master element finite, every element outside a parameter exactly zero)."""
    masters = backend.optimizer.fp32_partitioned_groups_flat
    used = [torch.zeros(m.numel(), dtype=torch.bool) for m in masters]
    for i, _, offset, _, valid in backend._param_spans():
        used[i][offset:offset + valid] = True
    finite = all(bool(torch.isfinite(m).all()) for m in masters)
    zero = all(bool((m[~u] == 0).all()) for m, u in zip(masters, used))
    return finite, zero


def _fl_fsdp_job(rank, world, tmp, cache):
    out = {}
    _, zero3 = train_and_gather(_ds(tmp, cache, "zero3", group_size=4, deepspeed=SMALL_PERSISTENCE))
    _, fsdp2 = train_and_gather(tiny_config(f"{tmp}/fsdp2", cache, group_size=4))
    fl_trainer, fl = train_and_gather(_ds(tmp, cache, "fl", group_size=2, sync_interval=1,
                                          deepspeed=SMALL_PERSISTENCE))
    _, hpz = train_and_gather(_ds(tmp, cache, "hpz", group_size=4, deepspeed={
        "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2, "stage3_param_persistence_threshold": 2000}}))
    out["hpz_vs_zero3"] = max_diff(hpz, zero3)
    recompute_cfg = _ds(tmp, cache, "recompute", group_size=4, deepspeed=SMALL_PERSISTENCE)
    recompute_cfg.training.recompute_activations = True
    _, recomputed = train_and_gather(recompute_cfg)
    strip = {k.replace("._checkpoint_wrapped_module", ""): v for k, v in recomputed.items()}
    out["recompute_vs_zero3"] = max_diff(strip, zero3)
    # a DeepSpeed scheduler block sets the learning rate (linear warm-up to 0.5 over 4 steps)
    sched = make_trainer(_ds(tmp, cache, "sched", group_size=2, deepspeed={"scheduler": {
        "type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.5, "warmup_num_steps": 4,
                                       "warmup_type": "linear"}}}))
    out["scheduled_lrs"] = [sched.step(i)[2] for i in range(3)]
    sched.close()
    out["fl_vs_zero3"] = max_diff(fl, zero3)
    out["zero3_vs_fsdp2"] = max_diff(zero3, fsdp2)
    shard_bytes = sum(s.numel() * s.element_size() for s in fl_trainer.backend.local_shards())
    out["sync_payload"] = (fl_trainer.engine.sync(step=99).inter_group_bytes, shard_bytes)
    out["padding"] = _padding_report(fl_trainer.backend)
    opt = fl_trainer.backend.optimizer  # fp32: the working partitions are the masters themselves
    out["fp32_working_is_master"] = all(w.data_ptr() == m.data_ptr() for w, m in
                                        zip(opt.fp16_partitioned_groups_flat, opt.fp32_partitioned_groups_flat))

    # H = 2 with AdamW in bf16: groups differ after steps 1 and 3 and are bit-identical after
    # step 2 in masters, working (bf16) partitions and gathered persistent parameters
    trainer = make_trainer(_ds(tmp, cache, "h2", group_size=2, sync_interval=2, steps=4, optimizer="adamw",
                               lr=1e-3, bf16=True, deepspeed=SMALL_PERSISTENCE))
    opt = trainer.backend.optimizer

    def everything():
        persistent = [p.data.reshape(-1) for p in opt.persistent_parameters]
        return list(opt.fp32_partitioned_groups_flat) + list(opt.fp16_partitioned_groups_flat) + persistent

    out["persistent_count"] = len(opt.persistent_parameters)
    out["working_dtypes"] = {str(t.dtype) for t in opt.fp16_partitioned_groups_flat}
    identical = []
    for step in range(3):
        trainer.step(step)
        identical.append(peers_identical(trainer, everything()))
    out["identical_after_steps_1_2_3"] = identical
    # DeepSpeed's bookkeeping sees the federation group; the optimizer state is still keyed by
    # the (averaged in place) master tensors and holds one entry per master
    out["dp_world_size"] = trainer.backend.engine.dp_world_size
    state_keys = {id(k) for k in opt.optimizer.state}
    out["state_keyed_by_masters"] = state_keys == {id(m) for m in opt.fp32_partitioned_groups_flat}
    # the working partitions are the masters rounded to bf16
    out["working_is_rounded_master"] = all(
        torch.equal(w, m.to(w.dtype)) for w, m in zip(opt.fp16_partitioned_groups_flat, opt.fp32_partitioned_groups_flat))
    out["variance"] = (direct_variance(trainer), trainer.engine.sync(step=4).variance)
    # after that sync, the gathered persistent parameters are the averaged masters, rounded to bf16
    full = trainer.backend.full_state_dict()
    names = trainer.backend._names
    out["persistent_match_masters"] = all(
        torch.equal(p.data.reshape(-1), full[names[id(p)]].reshape(-1).to(p.dtype)) for p in opt.persistent_parameters)
    trainer.close()
    return out


def test_fl_fsdp_on_zero3_equals_zero3_and_syncs_are_exact(tmp_path):
    results = run_ranks(4, _fl_fsdp_job, str(tmp_path), str(tmp_path / "cache"), timeout=800)
    for rank, r in enumerate(results):
        assert r["fl_vs_zero3"] <= 1e-5, (rank, r)
        assert r["hpz_vs_zero3"] <= 1e-6, (rank, r)  # ZeRO++ hpZ moves data differently, same numbers
        assert r["recompute_vs_zero3"] <= 1e-6, (rank, r)  # activation recomputation: same numbers
        # WarmupLR's closed form: min_lr until it has stepped once, then min + (max - min) * i / 4
        # for i = 0, 1, ... (DeepSpeed's own semantics: the first two steps both run at min_lr)
        assert r["scheduled_lrs"] == pytest.approx([0.0, 0.0, 0.125]), r["scheduled_lrs"]
        assert r["zero3_vs_fsdp2"] <= 1e-5, (rank, r)
        reported, shard_bytes = r["sync_payload"]
        assert reported == shard_bytes > 0
        assert r["padding"] == (True, True) and r["fp32_working_is_master"]
        assert r["persistent_count"] > 0 and r["working_dtypes"] == {"torch.bfloat16"}
        assert r["identical_after_steps_1_2_3"] == [False, True, False]
        assert r["dp_world_size"] == 2 and r["state_keyed_by_masters"]
        assert r["working_is_rounded_master"] and r["persistent_match_masters"]
        direct, reported = r["variance"]
        assert direct > 0 and reported == pytest.approx(direct, rel=1e-6)


def _hsdp_job(rank, world, tmp, cache):
    out = {}
    # HSDP inside one group of 4 (2 replicas x 2 shards) against ZeRO-3 over the 4 ranks; with
    # gradient accumulation and clipping, so the replica average must come before the norm
    def clipped(cfg):
        cfg.training.gradient_accumulation_steps, cfg.training.clip_grad = 2, 0.05
        return cfg

    _, zero3 = train_and_gather(clipped(_ds(tmp, cache, "zero3", group_size=4, steps=3)))
    _, hsdp = train_and_gather(clipped(_ds(tmp, cache, "hsdp", group_size=4, shard_size=2,
                                                      deepspeed=SMALL_PERSISTENCE, steps=3)))
    _, fsdp2_hsdp = train_and_gather(clipped(tiny_config(f"{tmp}/fsdp2hsdp", cache, group_size=4,
                                                         shard_size=2, steps=3)))
    out["hsdp_vs_zero3"] = max_diff(hsdp, zero3)
    out["hsdp_vs_fsdp2_hsdp"] = max_diff(hsdp, fsdp2_hsdp)

    # FL+HSDP: 2 groups of 2 replicas x 1 shard, replica split and naive, against ZeRO-3 over 4
    _, fl_split = train_and_gather(_ds(tmp, cache, "split", group_size=2, shard_size=1, sync_interval=1))
    naive_trainer, fl_naive = train_and_gather(_ds(tmp, cache, "naive", group_size=2, shard_size=1,
                                                   sync_interval=1, replica_split=False))
    _, zero3_sgd = train_and_gather(_ds(tmp, cache, "zero3sgd", group_size=4))
    out["split_vs_zero3"] = max_diff(fl_split, zero3_sgd)
    out["naive_vs_zero3"] = max_diff(fl_naive, zero3_sgd)
    out["split_vs_naive"] = max_diff(fl_split, fl_naive)
    out["identical"] = peers_identical(naive_trainer)
    return out


def test_hsdp_on_zero3_equals_zero3_over_the_group(tmp_path):
    results = run_ranks(4, _hsdp_job, str(tmp_path), str(tmp_path / "cache"), timeout=800)
    for rank, r in enumerate(results):
        assert r["hsdp_vs_zero3"] <= 1e-5, (rank, r)
        assert r["hsdp_vs_fsdp2_hsdp"] <= 1e-5, (rank, r)
        assert r["split_vs_zero3"] <= 1e-5, (rank, r)
        assert r["naive_vs_zero3"] <= 1e-5, (rank, r)
        assert r["split_vs_naive"] <= 1e-6, (rank, r)
        assert r["identical"]
