"""--fl-tune's choice rule against the cost model on hand-made link figures (no processes)."""

import dataclasses

import pytest

from fl_megatron.cost_model.network import Cluster
from fl_megatron.cost_model.timing import Variant, Workload, predict
from fl_megatron.cost_model.tune import (PRECISIONS, Measured, SyncMode, TuneBounds, candidate_modes, choose,
                                         estimate, tune)
from fl_megatron.costs import sync_state_shards
from fl_megatron.topology import make_layout

# 2 nodes x 2 ranks, a federation group per node (FL+FSDP), a 100M-parameter model, 0.5 s of compute
LAYOUT = make_layout(4, 2, 2)
PARAMS = 100_000_000
WORK = Workload(num_params=PARAMS, regathered_params=PARAMS, units=10, param_bytes=4, grad_bytes=4, micro_batches=1,
                tokens_per_step=8192, compute_seconds=0.5)
MEASURED = Measured({"bf16": 0.5e-9, "int8": 2e-9, "int4": 3e-9}, seconds_per_sync=0.002, overlap_interference=0.3)


def _cluster(inter_gbps: float) -> Cluster:
    return Cluster(inter_node_gbps=inter_gbps, intra_node_gbps=800.0, inter_node_latency_us=20, intra_node_latency_us=2)


def _tokens_per_s_by_hand(mode: SyncMode, cluster: Cluster) -> float:
    """The cost model's step and sync, then the measured codec and fixed time, written out: an
    overlap hides the links' part behind K steps, which it slows by the interference."""
    wire = {"fp32": 4.0, "bf16": 2.0, "int8": 1 + 4 / 256, "int4": 0.5 + 4 / 256}[mode.sync_dtype]
    variant = Variant("x", LAYOUT, mode.sync_interval, True, mode.overlap_steps, "complete", mode.fragments)
    p = predict(variant, dataclasses.replace(WORK, master_bytes=wire), cluster)
    codec = MEASURED.codec_seconds_per_element.get(mode.sync_dtype, 0.0) * (PARAMS / mode.fragments) / 2
    exposed = p.sync_seconds + MEASURED.seconds_per_sync + codec
    if mode.overlap_steps:
        window = mode.overlap_steps * p.step_seconds
        exposed = (MEASURED.seconds_per_sync + codec + max(0.0, p.sync_seconds - window)
                   + 0.3 * min(p.sync_seconds, window))
    return WORK.tokens_per_step / (p.step_seconds + exposed / (mode.sync_interval // mode.fragments))


def _choice(inter_gbps: float, bounds: TuneBounds, tolerance: float = 0.03, memory_of=None):
    return tune(bounds, LAYOUT, WORK, _cluster(inter_gbps), MEASURED, memory_of=memory_of, tolerance=tolerance)


def test_very_slow_links_take_the_most_compression_allowed():
    for lowest in ("bf16", "int8", "int4"):
        choice = _choice(0.001, TuneBounds(lowest_precision=lowest, sync_interval=8))
        assert choice.chosen.mode.sync_dtype == lowest, choice.text()
    # by the hand-written formula over every allowed mode: the most exact within 3 % of the fastest
    bounds = TuneBounds(lowest_precision="int4", sync_interval=8)
    by_hand = {m: _tokens_per_s_by_hand(m, _cluster(0.001)) for m in candidate_modes(bounds)}
    fastest = max(by_hand.values())
    eligible = [m for m, v in by_hand.items() if v >= 0.97 * fastest]
    expected = min(eligible, key=lambda m: (m.sync_interval, ["fp32", "bf16", "int8", "int4"].index(m.sync_dtype),
                                            m.overlap_steps, m.fragments))
    choice = _choice(0.001, bounds)
    assert choice.chosen.mode == expected and choice.chosen.tokens_per_s == pytest.approx(by_hand[expected], rel=1e-9)
    assert choice.ranked[0].tokens_per_s == pytest.approx(fastest, rel=1e-9)
    assert len(choice.ranked) == len(by_hand)


def test_very_fast_links_keep_the_exact_average_without_overlap():
    bounds = TuneBounds(lowest_precision="int4", sync_interval=8, max_sync_interval=32)
    choice = _choice(100_000.0, bounds)
    assert choice.chosen.mode == SyncMode("fp32", 0, 1, 8), choice.text()
    # everything is within the tolerance of the fastest: the rule prefers exactness, not a 0.1 % gain
    assert choice.ranked[0].tokens_per_s <= choice.chosen.tokens_per_s / (1 - 0.03)


def test_every_bound_is_respected():
    slow = 0.001
    no_overlap = _choice(slow, TuneBounds(lowest_precision="int4", sync_interval=8, overlap=False))
    assert all(e.mode.overlap_steps == 0 for e in no_overlap.ranked)
    h_bound = _choice(slow, TuneBounds(sync_interval=8, max_sync_interval=20))
    assert {e.mode.sync_interval for e in h_bound.ranked} == {8, 16, 20} and h_bound.chosen.mode.sync_interval == 20
    assert _choice(slow, TuneBounds(sync_interval=8)).chosen.mode.sync_interval == 8  # default: H unchanged
    frag = _choice(slow, TuneBounds(sync_interval=8, max_fragments=2))
    assert max(e.mode.fragments for e in frag.ranked) == 2
    assert all(8 // e.mode.fragments > e.mode.overlap_steps for e in frag.ranked)  # K < H/N
    precision = _choice(slow, TuneBounds(lowest_precision="bf16", sync_interval=8))
    assert {e.mode.sync_dtype for e in precision.ranked} == {"fp32", "bf16"}

    # memory: each mode's outer state (fedavg) from the cost model's count; a limit between modes leaves some out
    def memory_of(mode):
        plain = mode.sync_dtype == "fp32" and not mode.overlap_steps
        return 4.0 * PARAMS / 2 * sync_state_shards("fedavg", plain, mode.error_feedback, bool(mode.overlap_steps),
                                                    mode.fragments)
    limit = 4.0 * PARAMS / 2 * 2.0  # anchor + residual fit; + the overlap's two in-flight buffers do not
    bounds = TuneBounds(lowest_precision="int4", sync_interval=8, memory_limit_bytes=limit)
    fits = _choice(slow, bounds, memory_of=memory_of)
    assert fits.chosen.memory_bytes <= limit and fits.over_memory
    assert all(e.memory_bytes <= limit for e in fits.ranked)
    # by hand: an anchor unless plain fp32, a residual with compression, two in-flight fragments with overlap
    by_hand = lambda m: ((m.sync_dtype != "fp32" or m.overlap_steps > 0) + (m.sync_dtype in ("int8", "int4"))  # noqa: E731
                         + (2 / m.fragments if m.overlap_steps else 0))
    assert {e.mode for e in fits.over_memory} == {m for m in candidate_modes(bounds) if by_hand(m) > 2.0}
    with pytest.raises(ValueError, match="no sync mode fits in memory"):
        _choice(slow, dataclasses.replace(bounds, memory_limit_bytes=1.0), memory_of=lambda m: 2.0 + memory_of(m))


def test_an_overlap_that_slows_compute_as_much_as_it_hides_is_never_chosen():
    """With an interference of 1 an overlapped mode can only tie its blocking twin: never chosen."""
    bounds = TuneBounds(lowest_precision="int4", sync_interval=8)
    for gbps in (0.01, 0.1, 1.0, 10.0):
        free = tune(bounds, LAYOUT, WORK, _cluster(gbps), dataclasses.replace(MEASURED, overlap_interference=0.0))
        costly = tune(bounds, LAYOUT, WORK, _cluster(gbps), dataclasses.replace(MEASURED, overlap_interference=1.0))
        assert costly.chosen.mode.overlap_steps == 0, costly.text()
        assert costly.chosen.tokens_per_s <= free.chosen.tokens_per_s * (1 + 1e-12)


def test_the_rule_prefers_exactness_only_within_the_tolerance():
    """Two hand-made estimates: the exact one within the tolerance wins; outside, the faster."""
    exact, fast = SyncMode("fp32", 0, 1, 8), SyncMode("int4", 1, 2, 8)
    estimates = lambda gap: [dataclasses.replace(estimate(exact, LAYOUT, WORK, _cluster(1), MEASURED),  # noqa: E731
                                                 tokens_per_s=1000.0),
                             dataclasses.replace(estimate(fast, LAYOUT, WORK, _cluster(1), MEASURED),
                                                 tokens_per_s=1000.0 * (1 + gap))]
    assert choose(estimates(0.02), tolerance=0.03).chosen.mode == exact
    assert choose(estimates(0.05), tolerance=0.03).chosen.mode == fast
    assert choose(estimates(0.05), tolerance=0.03).runner_up.mode == exact


def test_a_choice_from_estimates_can_take_the_mode_cheapest_to_leave_within_the_tolerance():
    """Before step 1 (estimates the first sync revisits): of the modes within the tolerance, the
    one whose sync moves the fewest bytes per element (leaving it takes one blocking sync of the
    whole model in it); of equal bytes the most exact. Outside the tolerance the faster still wins."""
    modes = [SyncMode("fp32", 0, 1, 8), SyncMode("bf16", 0, 1, 8, False), SyncMode("int4", 0, 1, 8, True),
             SyncMode("int4", 1, 2, 8, True)]
    speeds = [1000.0, 1010.0, 1020.0, 1025.0]
    estimates = [dataclasses.replace(estimate(m, LAYOUT, WORK, _cluster(1), MEASURED), tokens_per_s=v)
                 for m, v in zip(modes, speeds)]
    assert choose(estimates, tolerance=0.03).chosen.mode == modes[0]  # the exact average
    assert choose(estimates, tolerance=0.03, cheapest_to_leave=True).chosen.mode == modes[2]  # int4, blocking
    assert choose(estimates, tolerance=0.005, cheapest_to_leave=True).chosen.mode == modes[2]  # 1020 >= 0.995 x 1025
    assert choose(estimates, tolerance=0.0, cheapest_to_leave=True).chosen.mode == modes[3]
    assert choose(estimates[:2], tolerance=0.03, cheapest_to_leave=True).chosen.mode == modes[1]  # bf16 < fp32


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="lowest precision 'fp8' is not one of"):
        TuneBounds(lowest_precision="fp8")
    with pytest.raises(ValueError, match="the largest allowed H"):
        TuneBounds(sync_interval=8, max_sync_interval=4)
    assert PRECISIONS == ("fp32", "bf16", "int8", "int4")


@pytest.mark.parametrize("mode", [SyncMode("fp32", 0, 1, 8), SyncMode("int4", 1, 4, 16), SyncMode("bf16", 1, 2, 8)])
def test_a_modes_flags_pin_it_by_hand(mode):
    """The flags the console prints with a choice parse into that mode's FederationConfig fields."""
    from fl_megatron.config.flags import parse_args

    cfg, _ = parse_args(mode.flags())
    assert {name: getattr(cfg.federation, name) for name in mode.fields()} == mode.fields()


def test_the_sparse_sync_is_weighed_only_where_allowed_and_wins_where_the_links_are_slow():
    """At 1 Mbit/s the sparse sync (about 141x fewer bytes than fp32) beats int4 by far: allowed,
    the rule takes it; not allowed, no sparse mode is a candidate. Its all-gather over 2 groups puts
    one payload on the wire: the prediction's wire bytes against the closed form."""
    from fl_megatron.costs import SPARSE_CHUNK

    allowed = TuneBounds(lowest_precision="int4", sync_interval=8, topk_density=64 / SPARSE_CHUNK)
    sparse = [m for m in candidate_modes(allowed) if m.topk_density]
    assert sparse and all(m.sync_dtype == "int2" and m.error_feedback for m in sparse)
    assert len(candidate_modes(allowed)) == len(candidate_modes(dataclasses.replace(allowed, topk_density=0.0))) * 5 // 4
    assert not any(m.topk_density for m in candidate_modes(dataclasses.replace(allowed, topk_density=0.0)))
    choice = _choice(0.001, allowed)
    assert choice.chosen.mode.topk_density == 64 / SPARSE_CHUNK, choice.text()
    dense = _choice(0.001, dataclasses.replace(allowed, topk_density=0.0))
    assert choice.chosen.tokens_per_s > 2 * dense.chosen.tokens_per_s
    mode = SyncMode("int2", 0, 1, 8, topk_density=64 / SPARSE_CHUNK)
    wire = estimate(mode, LAYOUT, WORK, _cluster(1.0), MEASURED)
    variant = Variant("x", LAYOUT, 8, True, 0, "complete", 1)
    p = predict(variant, dataclasses.replace(WORK, master_bytes=(4 + 64 * 14 / 8) / SPARSE_CHUNK,
                                             sync_gathered=True), _cluster(1.0))
    # 2 groups, shards of PARAMS / 2 per rank: one payload of the shard crosses, from each of 2 nodes x 2 ranks
    assert p.sync_inter_node_bytes == pytest.approx(4 * PARAMS / 2 * (4 + 64 * 14 / 8) / SPARSE_CHUNK, rel=1e-9)
    assert wire.network_seconds == pytest.approx(p.sync_seconds, rel=1e-9)
