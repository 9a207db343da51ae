"""Exactness of federated averaging on FSDP2, with several CPU ranks (gloo).

References: with plain SGD and H = 1, FL over F groups must equal sharded training over all
ranks on the same data (the average of the groups' SGD steps is the step on the averaged
gradient). Syncs make groups bit-identical; between syncs they differ.
"""

import pytest

from fl_megatron.local_ranks import run_ranks
from fl_test_utils import direct_variance, make_trainer, max_diff, peers_identical, tiny_config, train_and_gather

pytestmark = pytest.mark.timeout(600)


def _fsdp_job(rank, world, tmp, cache):
    out = {}
    _, ref = train_and_gather(tiny_config(f"{tmp}/ref", cache, group_size=4))
    fl_trainer, fl = train_and_gather(tiny_config(f"{tmp}/fl", cache, group_size=2, sync_interval=1))
    out["fl_vs_fsdp"] = max_diff(fl, ref)
    # the payload of one sync is exactly this rank's shard bytes
    shard_bytes = sum(s.numel() * s.element_size() for s in fl_trainer.backend.local_shards())
    before = fl_trainer.ledger.by_scope["inter-group"]
    result = fl_trainer.engine.sync(step=99)
    out["sync_payload"] = (result.inter_group_bytes, shard_bytes,
                           fl_trainer.ledger.by_scope["inter-group"] - before)

    # H = 2: groups differ after step 1 and 3, are bit-identical after step 2
    trainer = make_trainer(tiny_config(f"{tmp}/h2", cache, group_size=2, sync_interval=2, steps=4))
    identical = []
    for step in range(3):
        trainer.step(step)
        identical.append(peers_identical(trainer))
    out["identical_after_steps_1_2_3"] = identical
    # the variance metric against a direct computation from all groups' shards
    out["variance"] = (direct_variance(trainer), trainer.engine.sync(step=4).variance)
    # the per-step traffic measured by calibration equals FSDP2's collectives by closed form
    out["step_traffic"] = sum(trainer.traffic.step.by_tier.values())
    out["expected_step_traffic"] = _expected_fsdp_step_bytes(trainer)
    trainer.close()

    # bf16 compute keeps fp32 master shards, which the sync averages to bit-identical values
    losses = {}
    for bf16 in (False, True):
        t = make_trainer(tiny_config(f"{tmp}/bf16{bf16}", cache, group_size=2, sync_interval=1,
                                     optimizer="adamw", lr=1e-3, bf16=bf16))
        outcome = t.step(0)
        loss, sync = outcome.loss, outcome.sync
        losses[bf16] = float(loss)
        if bf16:
            out["bf16_master_dtypes"] = {str(s.dtype) for s in t.backend.local_shards()}
            out["bf16_synced_identical"] = sync is not None and peers_identical(t)
        t.close()
    out["bf16_vs_fp32_first_loss"] = (losses[True], losses[False])
    return out


def _expected_fsdp_step_bytes(trainer) -> int:
    """All-gather inputs (shards; root once per micro-batch, blocks twice: forward and backward)
    plus reduce-scatter inputs (padded full units) plus the grad-norm scalar reductions."""
    model = trainer.backend.model
    shard_count = trainer.layout.shard_size

    def unit_bytes(params):
        local = sum(p.to_local().numel() for p in params)
        padded_rows = shard_count * sum(-(-p.shape[0] // shard_count) * (p.numel() // p.shape[0]) for p in params)
        return local * 4, padded_rows * 4  # all-gather input, reduce-scatter input

    block_params = [list(b.parameters()) for b in model.layers]
    in_blocks = {id(p) for ps in block_params for p in ps}
    root_params = [p for p in model.parameters() if id(p) not in in_blocks]
    total = 0
    for params, gathers in [(root_params, 1)] + [(ps, 2) for ps in block_params]:
        shard, padded = unit_bytes(params)
        total += trainer.accum * gathers * shard + padded
    return total


def test_fl_fsdp_equals_fsdp_and_syncs_are_exact(tmp_path):
    cache = str(tmp_path / "cache")
    results = run_ranks(4, _fsdp_job, str(tmp_path), cache)
    for rank, r in enumerate(results):
        assert r["fl_vs_fsdp"] <= 1e-5, f"rank {rank}: FL+FSDP differs from FSDP by {r['fl_vs_fsdp']}"
        reported, shard_bytes, ledger_delta = r["sync_payload"]
        assert reported == shard_bytes == ledger_delta
        assert r["identical_after_steps_1_2_3"] == [False, True, False]
        direct, reported = r["variance"]
        assert direct > 0 and reported == pytest.approx(direct, rel=1e-6)
        # grad-norm reductions add a few scalars: allow 64 bytes
        assert 0 <= r["step_traffic"] - r["expected_step_traffic"] <= 64, r
        assert r["bf16_master_dtypes"] == {"torch.float32"}
        assert r["bf16_synced_identical"]
        bf16_loss, fp32_loss = r["bf16_vs_fp32_first_loss"]
        assert bf16_loss != fp32_loss and abs(bf16_loss - fp32_loss) <= 0.02 * fp32_loss


def _hsdp_job(rank, world, tmp, cache):
    out = {}
    _, ref = train_and_gather(tiny_config(f"{tmp}/ref", cache, group_size=8))
    split_trainer, split = train_and_gather(tiny_config(f"{tmp}/split", cache, group_size=4, shard_size=2))
    naive_trainer, naive = train_and_gather(tiny_config(f"{tmp}/naive", cache, group_size=4, shard_size=2,
                                              replica_split=False))
    out["split_vs_fsdp"] = max_diff(split, ref)
    out["naive_vs_fsdp"] = max_diff(naive, ref)
    out["split_vs_naive"] = max_diff(split, naive)
    shard_bytes = sum(s.numel() * s.element_size() for s in split_trainer.backend.local_shards())
    out["split_payload"] = (split_trainer.engine.sync(step=99).inter_group_bytes, shard_bytes,
                            len(split_trainer.engine.averager.plan(split_trainer.backend.local_shards())))
    out["naive_payload"] = (naive_trainer.engine.sync(step=99).inter_group_bytes, shard_bytes)
    out["identical"] = peers_identical(split_trainer)
    return out


def test_fl_hsdp_replica_split_equals_naive_and_hsdp(tmp_path):
    cache = str(tmp_path / "cache")
    results = run_ranks(8, _hsdp_job, str(tmp_path), cache, timeout=600)
    replicas = 2
    for rank, r in enumerate(results):
        assert r["split_vs_fsdp"] <= 1e-5, (rank, r)
        assert r["naive_vs_fsdp"] <= 1e-5, (rank, r)
        assert r["split_vs_naive"] <= 1e-6, (rank, r)
        split_bytes, shard_bytes, chunks = r["split_payload"]
        # shard bytes / P, plus at most P-1 padding elements per collective
        assert shard_bytes / replicas <= split_bytes <= shard_bytes / replicas + chunks * (replicas - 1) * 4
        assert r["naive_payload"][0] == r["naive_payload"][1]
        assert r["identical"]
