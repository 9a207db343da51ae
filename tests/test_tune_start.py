"""--fl-tune's first choice before step 1 (one world): from the probed links and the estimated
compute time, no process started. On a link the probe found slow the run does not start in fp32;
where compute dwarfs the sync it keeps the exact average; the estimate is --compute-seconds, else
the FLOPs the dry run counts, at the rate the device's products ran at where it was timed."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from fl_megatron.config import resolve
from fl_megatron.config.sync_mode import SyncMode
from fl_megatron.cost_model.workload import workload_for
from fl_megatron.federation.link_probe import GroupTiming, LinkProbe
from fl_megatron.training.compute_probe import MAX_PRODUCTS, MIN_SECONDS, ComputeRate, measure_compute_rate
from fl_megatron.costs import wire_bytes_per_element
from fl_megatron.training.tuning import DENSE_PRODUCT_SHARE, START_INTERFERENCE, SyncTuner
from fl_test_utils import tiny_config


def _tuner(tmp_path, inter_node_mbit: float, compute_seconds=None) -> tuple[SyncTuner, list]:
    """2 nodes x 2 ranks, a group per node (H = 8, int4 allowed), the peer link probed at
    `inter_node_mbit` Mbit/s (a 4 MiB payload), the group's at 10 Gbit/s."""
    cfg = tiny_config(str(tmp_path / "run"), str(tmp_path / "cache"), group_size=2, sync_interval=8)
    cfg.model.hidden_size, cfg.model.ffn_hidden_size, cfg.model.num_layers = 256, 688, 4  # 3 MiB of shards
    cfg.federation.tune, cfg.federation.tune_lowest_precision = True, "int4"
    cfg.cluster.compute_seconds = compute_seconds
    run = resolve(cfg, 4, 2)
    payload = 4 << 20

    def timing(group, tier, mbit):
        return GroupTiming(group, 2, tier, 50e-6, payload, 50e-6 + payload * 8 / (mbit * 1e6))

    probe = LinkProbe([timing("peer", "inter-node", inter_node_mbit), timing("federation", "intra-node", 10_000)],
                      {"bf16": 1e-9, "int8": 3e-9, "int4": 4e-9})
    groups = SimpleNamespace(tier=lambda kind: "inter-node" if kind == "peer" else "intra-node")
    said: list = []
    return SyncTuner(run, groups, probe, said.append, torch.device("cpu")), said


def test_a_slow_probed_link_does_not_start_in_fp32(tmp_path):
    fp32 = SyncMode("fp32", 0, 1, 8, False)
    tuner, said = _tuner(tmp_path, inter_node_mbit=10, compute_seconds=0.2)
    mode = tuner.choose_at_start(fp32)
    assert mode.sync_dtype != "fp32" and mode.error_feedback, mode
    assert tuner.start_choice["mode"] == mode.fields() and tuner.start_choice["estimated_step_seconds"] == 0.2
    assert "fl-tune before step 1" in said[0] and "starting in" in said[0], said
    assert not tuner.decided  # the first sync still makes the first choice, from measured steps
    # the same link, compute that dwarfs any sync: the exact average at the configured H
    tuner, said = _tuner(tmp_path, inter_node_mbit=10, compute_seconds=1000.0)
    assert tuner.choose_at_start(fp32) == fp32 and "keeping" in said[0], said


def test_without_compute_seconds_the_estimate_is_the_dry_runs_flops(tmp_path):
    tuner, _ = _tuner(tmp_path, inter_node_mbit=1000)
    tuner.choose_at_start(SyncMode("fp32", 0, 1, 8, False))
    expected = workload_for(tuner.run).compute_seconds
    assert tuner.start_choice["estimated_step_seconds"] == pytest.approx(expected) and 0 < expected < 1


def test_the_trial_exchange_sets_the_links_speed_before_the_first_choice(tmp_path):
    """A trial of 2^21 int4 elements that took twice the cost model's time (its codec aside): the
    peer tier is re-estimated so that the model predicts what the trial took; a trial too small to
    show bandwidth leaves the links as probed."""
    tuner, _ = _tuner(tmp_path, inter_node_mbit=20)
    mode, elements, step_s = SyncMode("int4", 0, 1, 8), 1 << 21, 0.5
    share = elements / (tuner.num_params / tuner.run.layout.shard_size)

    def predicted() -> float:
        return tuner._estimate(mode, step_s).network_seconds * share

    codec = tuner.measured.codec_seconds_per_element["int4"] * elements
    before, probed = predicted(), tuner.cluster.inter_node_gbps
    tuner.trial_info = {"step": 4, "elements": elements, "sync_dtype": "int4"}
    links = tuner._links_from_trial(step_s, 2 * before + codec)
    assert links["tier"] == "inter-node" and links["measured_seconds"] == pytest.approx(2 * before)
    assert tuner.cluster.inter_node_gbps == pytest.approx(probed / 2)
    assert predicted() == pytest.approx(2 * before, rel=0.02)  # latency aside, the model now says what it took
    tuner, _ = _tuner(tmp_path, inter_node_mbit=20)
    tuner.trial_info = {"step": 4, "elements": 1 << 16, "sync_dtype": "int4"}
    assert tuner._links_from_trial(step_s, 10.0) is None and tuner.cluster.inter_node_gbps == probed


def test_a_measured_device_rate_sets_the_start_estimate_and_the_choice(tmp_path):
    """Without --compute-seconds the FLOPs are timed at --mfu of the peak the device's measured
    product rate stands for (the rate over DENSE_PRODUCT_SHARE), not --peak-tflops: the estimate is
    the closed form (6 x parameters + 12 x layers x hidden x seq) x tokens / (mfu x rate / share).
    On a link of 100 Mbit/s, an A100's peak leaves no compute to hide a sync behind (blocking), a
    CPU's rate (20 GFLOP/s) hides it (overlapped)."""
    fp32 = SyncMode("fp32", 0, 1, 8, False)
    tuner, said = _tuner(tmp_path, inter_node_mbit=100)
    cfg, t = tuner.run.cfg, tuner.run.cfg.training
    rows, inner, cols = t.micro_batch_size * t.seq_length, cfg.model.hidden_size, cfg.model.ffn_hidden_size
    rate = ComputeRate(rows, inner, cols, products=10, seconds=2 * rows * inner * cols * 10 / 20e9, dtype="float32",
                       wall_seconds=0.1)
    assert rate.tflops == pytest.approx(0.02)
    mode = tuner.choose_at_start(fp32, rate)
    params = tuner.num_params
    tokens = t.micro_batch_size * t.seq_length * tuner.run.accumulation
    flops = (6 * params + 12 * cfg.model.num_layers * cfg.model.hidden_size * t.seq_length) * tokens
    expected = flops / (cfg.cluster.mfu * 20e9 / DENSE_PRODUCT_SHARE)
    assert tuner.start_choice["estimated_step_seconds"] == pytest.approx(expected)
    assert tuner.start_choice["device_rate"]["tflops"] == pytest.approx(0.02)
    assert "from the 0.02 this device's products ran at" in said[0], said
    assert mode.overlap_steps >= 1, mode
    tuner, said = _tuner(tmp_path, inter_node_mbit=100)
    assert tuner.choose_at_start(fp32).overlap_steps == 0 and "of --peak-tflops" in said[0], said
    # --compute-seconds, where given, is the estimate whatever the device measured
    tuner, said = _tuner(tmp_path, inter_node_mbit=100, compute_seconds=0.25)
    tuner.choose_at_start(fp32, rate)
    assert tuner.start_choice["estimated_step_seconds"] == 0.25 and "device_rate" not in tuner.start_choice


def test_the_device_rate_is_the_agreed_time_of_the_products_it_counts():
    """Each rank counts how many products take MIN_SECONDS on its own; every rank then times the
    job's largest count (agreed), and the rate is 2 x rows x inner x cols x products over the
    agreed (slowest rank's) time."""
    seen = []

    def another_rank_is_slower(figure: float) -> float:  # needed twice the products, took 3 x as long
        seen.append(figure)
        return figure if len(seen) == 1 else 2 * figure if len(seen) == 2 else 3 * figure

    rate = measure_compute_rate(torch.device("cpu"), torch.float32, 256, 128, 256, another_rank_is_slower)
    own = int(seen[1])  # the first call only gathers the ranks
    assert len(seen) == 3 and seen[0] == 0.0 and own & (own - 1) == 0 and own < MAX_PRODUCTS
    assert rate.products == 2 * own and rate.seconds == pytest.approx(3 * seen[2])
    assert rate.tflops == pytest.approx(2 * 256 * 128 * 256 * rate.products / rate.seconds / 1e12)
    assert rate.wall_seconds >= seen[2] >= MIN_SECONDS  # twice the products it found long enough


def test_where_leaving_the_exact_choice_costs_more_than_the_tolerance_the_start_is_the_cheapest_to_leave(tmp_path):
    """The first sync chooses again, and a different choice costs one blocking sync in the start
    mode. Where the most exact mode within the tolerance syncs in more than the tolerance of one
    interval, the start is the one of those modes that moves the fewest bytes per element; where
    compute dwarfs its sync, the most exact (the rule's own choice). Checked against the rule's
    estimates at several links and compute times; the two cases both occur."""
    fp32 = SyncMode("fp32", 0, 1, 8, False)
    cases = set()
    for mbit, compute in ((10, 0.2), (100, 0.05), (100, 0.5), (1000, 0.2), (10, 1000.0)):
        tuner, _ = _tuner(tmp_path, inter_node_mbit=mbit, compute_seconds=compute)
        mode = tuner.choose_at_start(fp32)
        prior = dataclasses.replace(tuner.measured, overlap_interference=START_INTERFERENCE["cpu"])
        ranked = tuner._choose(compute, prior).ranked
        within = [e for e in ranked if e.tokens_per_s >= (1 - 0.03) * ranked[0].tokens_per_s]
        exact = min(within, key=lambda e: e.mode.caution())
        assert mode in [e.mode for e in within], (mbit, compute, mode)
        if exact.sync_seconds > 0.03 * 8 * compute:
            fewest = min(wire_bytes_per_element(e.mode.sync_dtype) for e in within)
            assert wire_bytes_per_element(mode.sync_dtype) == fewest, (mbit, compute, mode)
            cases.add("cheapest to leave" if mode != exact.mode else "the same")
        else:
            assert mode == exact.mode, (mbit, compute, mode)
            cases.add("most exact")
    assert {"cheapest to leave", "most exact"} <= cases, cases
