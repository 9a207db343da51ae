"""--fl-tune's first choice before step 1 (one world): from the probed links and the estimated
compute time, no process started. On a link the probe found slow the run does not start in fp32;
where compute dwarfs the sync it keeps the exact average; the estimate is --compute-seconds, else
the FLOPs the dry run counts."""

from types import SimpleNamespace

import pytest
import torch

from fl_megatron.config import resolve
from fl_megatron.config.sync_mode import SyncMode
from fl_megatron.cost_model.workload import workload_for
from fl_megatron.federation.link_probe import GroupTiming, LinkProbe
from fl_megatron.training.tuning import SyncTuner
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
