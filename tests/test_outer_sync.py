"""Outer optimizers, compressed syncs and sick groups.

References: a plain-torch DiLoCo step (outer SGD with Nesterov momentum) on the gathered models;
the per-block int8/int4 bound; error feedback's telescoping sum; the average of the healthy groups
computed directly from their gathered parameters.
"""

import os

import pytest
import torch
import torch.distributed as dist

from fl_megatron.federation import CollectiveCounter
from fl_megatron.federation.compression import BLOCK, compressed_mean_, dequantize, quantize
from fl_megatron.federation.vote import AllGroupsSick, GroupFigures
from fl_megatron.local_ranks import run_ranks
from fl_test_utils import make_trainer, max_diff, tiny_config, train_and_gather

pytestmark = pytest.mark.timeout(900)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_round_trip_within_half_a_step_per_block(bits):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64 * BLOCK, generator=g) * torch.logspace(-6, 2, 64).repeat_interleave(BLOCK)
    x[:BLOCK] = 0.0  # an all-zero block stays zero
    levels = 2 ** (bits - 1) - 1
    x[BLOCK:2 * BLOCK] = torch.arange(BLOCK).remainder(2 * levels + 1).sub(levels) * 0.5  # exactly on the grid
    q, scales = quantize(x, bits)
    decoded = dequantize(q, scales, bits)
    err = (decoded - x).view(-1, BLOCK).abs().amax(dim=1)
    assert q.dtype == (torch.int8 if bits == 8 else torch.uint8) and q.numel() == x.numel() * bits // 8
    assert scales.shape == (64,) and torch.allclose(scales, x.view(-1, BLOCK).abs().amax(dim=1) / levels)
    assert torch.all(err <= scales / 2 * (1 + 1e-5) + 1e-30)
    assert err[0] == 0 and scales[0] == 0
    assert torch.equal(decoded[BLOCK:2 * BLOCK], x[BLOCK:2 * BLOCK])  # every level, in order (packing)


@pytest.mark.parametrize("dtype,bits", [("int8", 8), ("int4", 4)])
def test_error_feedback_keeps_the_sum_of_what_was_sent_on_track(world, dtype, bits):
    """Over many syncs the sum of what a rank sent equals the sum of its true pseudo-gradients
    up to the last residual, which stays bounded; without error feedback the gap grows."""
    g = torch.Generator().manual_seed(1)
    n, rounds = 4 * BLOCK, 300
    residual = torch.zeros(n)
    true_sum, sent_ef, sent_plain = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    largest = []
    for _ in range(rounds):
        delta = torch.randn(n, generator=g) * 1e-3 + 2e-4  # a small drift the rounding would lose
        true_sum += delta
        with_ef, plain = delta.clone(), delta.clone()
        compressed_mean_(with_ef, world, dtype, residual=residual)
        compressed_mean_(plain, world, dtype)
        sent_ef += with_ef
        sent_plain += plain
        largest.append(float(residual.abs().max()))
    scale_bound = float(quantize(torch.full((BLOCK,), 5e-3), bits)[1][0])  # a block's step at |x| ~ 5e-3
    assert max(largest) <= 2 * scale_bound  # bounded, not growing with the rounds
    assert (sent_ef - true_sum).abs().max() <= 2 * scale_bound + 1e-6
    assert (sent_plain - true_sum).abs().max() > 5 * (sent_ef - true_sum).abs().max()


def _outer_job(rank, world, tmp, cache):
    out = {}
    base = lambda name, **kw: tiny_config(f"{tmp}/{name}", cache, group_size=2, optimizer="adamw",  # noqa: E731
                                          lr=3e-3, steps=4, sync_interval=2, **kw)
    # fedavg with outer lr 1 in fp32 is today's average, bit for bit
    _, plain = train_and_gather(base("plain"))
    cfg = base("fedavg1")
    cfg.federation.outer_optimizer, cfg.federation.outer_lr = "fedavg", 1.0
    _, fedavg1 = train_and_gather(cfg)
    out["fedavg1_vs_plain"] = max_diff(fedavg1, plain)
    # nesterov against plain-torch DiLoCo on the gathered models, over two rounds
    cfg = base("nesterov", bf16=False)
    cfg.federation.outer_optimizer, cfg.federation.outer_lr, cfg.federation.outer_momentum = "nesterov", 0.7, 0.9
    cfg.federation.sync_interval, cfg.training.train_iters = 100, 10  # syncs are called by hand below
    trainer = make_trainer(cfg)
    anchor = {k: v.clone() for k, v in trainer.backend.full_state_dict().items()}
    reference = torch.optim.SGD(list(anchor.values()), lr=0.7, momentum=0.9, nesterov=True)
    gaps = []
    for round_ in range(2):
        for i in range(2):
            trainer.step(2 * round_ + i)
        mine = trainer.backend.full_state_dict()
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        groups = [everyone[0], everyone[2]]  # ranks 0-1 are group 0, ranks 2-3 group 1
        for name, a in anchor.items():
            a.grad = a - (groups[0][name] + groups[1][name]) / 2
        reference.step()
        trainer.engine.sync(2 * round_ + 2)
        after = trainer.backend.full_state_dict()
        gaps.append(max(((after[k] - anchor[k]).abs().max() / anchor[k].abs().max().clamp_min(1e-12)).item()
                        for k in anchor))
    out["nesterov_vs_reference"] = gaps
    out["outer_state_bytes"] = sum(t.numel() * t.element_size() for t in trainer.engine.state_tensors().values())
    out["shard_bytes"] = sum(s.numel() * s.element_size() for s in trainer.backend.local_shards())
    trainer.close()
    # int8 with error feedback: groups identical after a sync, payload about a quarter of fp32
    cfg = base("int8")
    cfg.federation.outer_optimizer, cfg.federation.sync_dtype, cfg.federation.error_feedback = "nesterov", "int8", True
    trainer = make_trainer(cfg)
    results = [trainer.step(i)[3] for i in range(2)]
    out["int8_payload_ratio"] = results[1].inter_group_bytes / out["shard_bytes"]
    out["int8_identical"] = _peers_equal(trainer)
    int8 = trainer.backend.full_state_dict()
    trainer.close()
    # ... and its first sync lands where the fp32 one of the same steps does, up to the codes' rounding
    # (half a step of 1/127 of a block's largest pseudo-gradient, twice: as sent, then the mean)
    cfg = base("int8-fp32-reference")
    cfg.federation.outer_optimizer = "nesterov"
    trainer = make_trainer(cfg)
    start = trainer.backend.full_state_dict()
    for i in range(2):
        trainer.step(i)
    fp32 = trainer.backend.full_state_dict()
    trainer.close()
    out["int8_vs_fp32"] = max(((int8[k] - fp32[k]).abs().max() / (fp32[k] - start[k]).abs().max()).item()
                              for k in fp32)
    # int4 with error feedback: half of int8's payload
    cfg = base("int4")
    cfg.federation.sync_dtype, cfg.federation.error_feedback = "int4", True
    trainer = make_trainer(cfg)
    results = [trainer.step(i)[3] for i in range(2)]
    out["int4_payload_ratio"] = results[1].inter_group_bytes / out["shard_bytes"]
    out["int4_identical"] = _peers_equal(trainer)
    out["int4_model_ratio"] = cfg.federation.sync_bytes_per_element / 4  # what the cost model and dry run use
    trainer.close()
    return out


def _peers_equal(trainer) -> bool:
    from fl_test_utils import peers_identical

    return peers_identical(trainer)


def test_outer_optimizers_and_compressed_sync(tmp_path):
    results = run_ranks(4, _outer_job, str(tmp_path), str(tmp_path / "cache"), timeout=600)
    for r in results:
        assert r["fedavg1_vs_plain"] == 0.0, r
        assert max(r["nesterov_vs_reference"]) <= 1e-6, r
        assert r["outer_state_bytes"] == 2 * r["shard_bytes"]  # anchor + momentum: one fp32 shard each
        assert 0.25 <= r["int8_payload_ratio"] <= 0.27, r  # int8 + one fp32 scale per 256 (plus padding)
        assert r["int8_identical"], r
        assert r["int8_vs_fp32"] <= 0.02, r  # of each tensor's largest update (measured 0.0078; a mean with one
        # group too many in its divisor is a third off)
        assert 0.128 <= r["int4_payload_ratio"] <= 0.14, r  # two values per byte + one fp32 scale per 256
        assert r["int4_model_ratio"] <= r["int4_payload_ratio"] <= 1.05 * r["int4_model_ratio"], r  # + padding
        assert r["int4_identical"], r


def _sick_job(rank, world, tmp, cache):
    out = {}
    cfg = tiny_config(f"{tmp}/sick", cache, group_size=1, optimizer="adamw", lr=3e-3, steps=6, sync_interval=100)
    trainer = make_trainer(cfg)
    for step in range(2):
        trainer.step(step)
    os.environ["FL_MEGATRON_FAULT"] = "nan-shard:3@3"  # group 3 (rank 3) turns sick after step 3
    loss = trainer.step(2)[0]
    del os.environ["FL_MEGATRON_FAULT"]
    mine = trainer.backend.full_state_dict()
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    out["sick_has_nan"] = any(bool(torch.isnan(v).any()) for v in everyone[3].values())
    expected = {k: sum(everyone[g][k] for g in range(3)) / 3 for k in mine}
    scalar_rounds = []  # all-reduces of a few numbers across the groups: none where the vote rides on the data
    with CollectiveCounter(lambda name, ranks, nbytes: scalar_rounds.append(name)
                           if ranks is not None and len(ranks) > 1 and nbytes <= 1024 else None):
        result = trainer.engine.sync(3, GroupFigures(loss=float(loss)), metrics_now=False)
    out["scalar_rounds"] = scalar_rounds
    out["sick_groups"] = list(result.sick_groups)
    out["vs_healthy_mean"] = max_diff(trainer.backend.full_state_dict(), expected)
    trainer.step(3)
    out["finite_after"] = all(bool(torch.isfinite(s).all()) for s in trainer.backend.local_shards())
    for shard in trainer.backend.local_shards():
        shard.view(-1)[0] = float("inf")
    try:
        trainer.engine.sync(4)
        out["all_sick"] = "no error"
    except AllGroupsSick as e:
        out["all_sick"] = str(e)
    trainer.close()
    return out


def test_a_sick_group_is_left_out_and_reset_to_the_others_average(tmp_path):
    results = run_ranks(4, _sick_job, str(tmp_path), str(tmp_path / "cache"), timeout=600)
    for r in results:
        assert r["sick_has_nan"] and r["sick_groups"] == [3], r
        assert r["scalar_rounds"] == [], r  # the vote found the sick group riding on the data (fp32 FedAvg)
        assert r["vs_healthy_mean"] <= 1e-6, r
        assert r["finite_after"], r
        assert "every federation group is sick at step 4" in r["all_sick"], r


def test_sick_groups_through_the_command_line(tmp_path):
    """A NaN in group 1's shards: the run finishes and names the group; every group sick: the run
    stops with a message (exit 3) and the last checkpoint stays the latest."""
    import json

    from cli_utils import SGD, launch
    from fl_megatron.checkpoint import published_iterations

    flags = [*SGD, "--fl-group-size", "2", "--fl-sync-interval", "2", "--train-iters", "4", "--eval-iters", "0"]
    one = launch(4, tmp_path / "one", tmp_path / "cache", *flags, env_extra={"FL_MEGATRON_FAULT": "nan-shard:1@2"})
    assert one.returncode == 0, one.stderr[-3000:]
    assert "step 2: federation group(s) 1 left out of the average" in one.stdout
    records = [json.loads(line) for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("sick_groups") for r in records if r.get("synced")] == [[1], None]
    assert all(r["loss"] == r["loss"] for r in records if "loss" in r)  # no NaN loss after the reset
    ckpt = tmp_path / "ckpt"
    every = launch(4, tmp_path / "all", tmp_path / "cache", *flags, "--save", str(ckpt), "--save-interval", "1",
                   env_extra={"FL_MEGATRON_FAULT": "nan-shard:all@2"})
    assert every.returncode != 0 and "every federation group is sick at step 2" in every.stderr
    # (torchrun prints its own traceback for a failed child; ours must not show one)
    assert "fl_megatron/federation" not in every.stderr and published_iterations(ckpt) == [1]


def _inner_state_job(rank, world, tmp, cache):
    out = {}
    for policy in ("average", "reset"):
        cfg = tiny_config(f"{tmp}/{policy}", cache, group_size=2, optimizer="adamw", lr=3e-3, steps=10,
                          sync_interval=100)
        cfg.federation.inner_state = policy
        trainer = make_trainer(cfg)
        for step in range(2):
            trainer.step(step)
        before = [t.clone() for t in trainer.backend.inner_state_shards()]
        everyone = [torch.empty_like(torch.cat([t.view(-1) for t in before])) for _ in range(2)]
        dist.all_gather(everyone, torch.cat([t.view(-1) for t in before]), group=trainer.groups.peer)
        trainer.engine.sync(2)
        after = trainer.backend.inner_state_shards()
        if policy == "average":
            mean = (everyone[0] + everyone[1]) / 2
            out["moments"] = len(before)
            out["groups_differed"] = not torch.equal(everyone[0], everyone[1])
            out["vs_mean"] = (torch.cat([t.view(-1) for t in after]) - mean).abs().max().item()
            from fl_test_utils import peers_identical
            out["identical"] = peers_identical(trainer, after)
        else:
            out["reset_empty"] = after == []
            trainer.step(2)  # AdamW restarts its moments
            out["restarted"] = len(trainer.backend.inner_state_shards()) == len(before)
        trainer.close()
    return out


def test_inner_state_policies_average_or_reset_the_moments(tmp_path):
    results = run_ranks(4, _inner_state_job, str(tmp_path), str(tmp_path / "cache"), timeout=600)
    for r in results:
        assert r["moments"] > 0 and r["groups_differed"] and r["identical"], r
        assert r["vs_mean"] <= 1e-7, r
        assert r["reset_empty"] and r["restarted"], r


def _overlap_job(rank, world, tmp, cache):
    """H = 2, K = 1, fedavg (outer lr 1): the sync launched after step 2 lands after step 3 as
    x_3 - x_2 + mean over groups of x_2, on every rank; the last sync is blocking."""
    out = {}
    cfg = tiny_config(f"{tmp}/overlap", cache, group_size=2, optimizer="adamw", lr=3e-3, steps=6, sync_interval=2)
    cfg.federation.overlap_steps = 1
    trainer = make_trainer(cfg)
    trainer.step(0)
    launched = trainer.step(1)[3]  # step 2: launched, nothing landed yet
    out["launch_returns_nothing"] = launched is None and trainer.engine.flight is not None
    x2 = trainer.backend.full_state_dict()
    everyone = [None] * world
    dist.all_gather_object(everyone, x2)
    mean2 = {k: (everyone[0][k] + everyone[2][k]) / 2 for k in x2}
    loss, _, _ = trainer._train_step(2, 3e-3)  # step 3's training, then its engine call by hand
    x3 = trainer.backend.full_state_dict()
    landed = trainer.engine.after_step(3, loss=loss)
    out["landed_step"] = landed.step if landed else None
    after = trainer.backend.full_state_dict()
    out["vs_formula"] = max_diff(after, {k: x3[k] - x2[k] + mean2[k] for k in x2})
    for step in range(3, 6):
        trainer.step(step)
    from fl_test_utils import peers_identical
    out["identical_at_end"] = peers_identical(trainer)  # the last sync is blocking
    trainer.close()
    return out


def test_overlapped_sync_lands_k_steps_later_keeping_each_groups_progress(tmp_path):
    results = run_ranks(4, _overlap_job, str(tmp_path), str(tmp_path / "cache"), timeout=600)
    for r in results:
        assert r["launch_returns_nothing"] and r["landed_step"] == 2, r
        assert r["vs_formula"] <= 1e-6, r
        assert r["identical_at_end"], r


def _backends_job(rank, world, tmp, cache):
    """Every sync option on every backend: nesterov, int8 with error feedback, overlap 1, the
    moments averaged, a sick group at step 2; after the last (blocking) sync the groups agree on
    their shards and their moments, and every rank holds error-feedback residuals."""
    from fl_test_utils import peers_identical, sync_outcome

    out = {}
    for backend in ("fsdp2", "deepspeed", "megatron"):
        cfg = tiny_config(f"{tmp}/{backend}", cache, group_size=2, optimizer="adamw", lr=3e-3, steps=6,
                          sync_interval=2, backend=backend)
        f = cfg.federation
        f.outer_optimizer, f.sync_dtype, f.error_feedback, f.overlap_steps = "nesterov", "int8", True, 1
        f.inner_state = "average"
        trainer = make_trainer(cfg)
        os.environ["FL_MEGATRON_FAULT"] = "nan-shard:1@2"
        results = [trainer.step(i)[3] for i in range(6)]
        del os.environ["FL_MEGATRON_FAULT"]
        # the moments were averaged too, and each rank carries what its int8 encodings lost
        out[backend] = {**sync_outcome(trainer, results),
                        "moments_identical": peers_identical(trainer, trainer.backend.inner_state_shards())}
        trainer.close()
    return out


@pytest.mark.skipif(any(__import__("importlib").util.find_spec(m) is None for m in ("deepspeed", "megatron")),
                    reason="needs DeepSpeed and megatron-core")
def test_every_sync_option_on_every_backend(tmp_path):
    results = run_ranks(4, _backends_job, str(tmp_path), str(tmp_path / "cache"), timeout=800)
    for r in results:
        for backend, got in r.items():
            # launched at 2 (group 1 sick), landed at 3; launched at 4, landed at 5; blocking at 6
            assert got["sick"] == [[1], [], []], (backend, got)
            assert got["identical"] and got["finite"], (backend, got)
            assert got["moments_identical"] and got["residuals"] > 0, (backend, got)


def _hsdp_overlap_job(rank, world, tmp, cache):
    """FL+HSDP (2 groups of 2 replicas x 2 shards) with a sync in flight every other step: the
    exchange's thread gathers replica slices while training all-reduces gradients over the
    replicas. On communicators of its own, the threaded run equals, bit for bit, the same run
    with every exchange done at its launch (no thread)."""
    from fl_megatron.federation.overlap import Overlapper

    out = {}
    for threaded in (True, False):
        cfg = tiny_config(f"{tmp}/hsdp-{threaded}", cache, group_size=4, shard_size=2, optimizer="adamw", lr=3e-3,
                          steps=6, sync_interval=2)
        cfg.federation.overlap_steps, cfg.federation.inner_state = 1, "average"
        trainer = make_trainer(cfg)
        if not threaded:
            trainer.engine.overlapped.overlapper.close()
            trainer.engine.overlapped.overlapper = Overlapper(threaded=False)
        groups = trainer.groups
        out["own_groups"] = groups.exchange_peer is not groups.peer and groups.exchange_replica is not groups.replica
        trainer.train()
        out[threaded] = trainer.backend.full_state_dict()
        trainer.close()
    out["max_diff"] = max_diff(out.pop(True), out.pop(False))
    return out


def test_hsdp_overlap_on_its_own_communicators_matches_the_unthreaded_run(tmp_path):
    results = run_ranks(8, _hsdp_overlap_job, str(tmp_path), str(tmp_path / "cache"), timeout=800)
    for r in results:
        assert r["own_groups"] and r["max_diff"] == 0.0, r
