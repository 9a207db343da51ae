"""--fl-tune in a run: the link probe, per-tier telemetry, a re-choice when a link slows down (a
delay injected into every sync's exchange) and a resumed run that keeps the choice."""

import json
import re
from pathlib import Path

import pytest

from cli_utils import SGD, launch

pytestmark = pytest.mark.timeout(600)

H = 2
FLAGS = [*SGD, "--train-iters", "20", "--fl-group-size", "2", "--fl-sync-interval", str(H), "--fl-tune",
         "--fl-tune-every", "2", "--save-interval", "16"]
SLOW_FROM = 9  # every sync from this step on sleeps a second: a link that slowed down


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_slowed_link_is_re_chosen_at_a_sync_and_a_resumed_run_keeps_the_choice(tmp_path):
    env = {"FL_MEGATRON_FAULT": f"slow-sync:1.0@{SLOW_FROM}"}
    first = launch(4, tmp_path / "a", tmp_path / "cache", *FLAGS, "--save", str(tmp_path / "ckpt"), env_extra=env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    records = _records(tmp_path / "a")
    decisions = [r for r in records if "tune" in r]
    assert decisions[0]["tune"]["reason"].startswith("first choice") and decisions[0]["step"] == H
    # every decision is at a sync step; the links' change is seen at the first check with a slowed sync in it
    syncs = [r["step"] for r in records if r.get("synced")]
    assert all(d["step"] % H == 0 for d in decisions), decisions
    changed = [d for d in decisions if "the links changed" in d["tune"]["reason"]]
    assert changed and SLOW_FROM < changed[0]["step"] <= SLOW_FROM + 3 * H, [d["tune"]["reason"] for d in decisions]
    assert "fl-tune at step" in first.stdout and "the links changed" in first.stdout

    # the probe: in config.json, and the banner
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    peer = next(t for t in config["link_probe"]["timings"] if t["group"] == "peer")
    assert peer["ranks"] == 2 and peer["payload_bytes"] > 0 and peer["payload_seconds"] > peer["small_seconds"] > 0
    assert "--intra-node-gbps" in config["link_probe"]["dry_run_flags"] and "links (probed in" in first.stdout

    # telemetry of every sync: bytes/s on the wire by tier; the wait's share of the record's time. Over 2
    # groups a ring all-reduce (or an all-to-all and all-gather of the encoding) puts 2 x 1/2 of the payload
    # on the wire, so the bytes/s times the exchange's seconds is the payload the ledger counted since the
    # sync record before (an overlapped sync in flight at the save of 16 lands there, in a record of its own)
    sync_records = [r for r in records if r.get("synced")]
    assert all(r["sync_intra_node_bytes_per_s"] > 0 for r in sync_records)
    assert all(0 < r["sync_wait_fraction"] <= 1 for r in sync_records if not r.get("landed_for_checkpoint"))
    for before, r in zip(sync_records, sync_records[1:]):
        moved = r["inter_group_bytes"] - before["inter_group_bytes"]
        assert r["sync_intra_node_bytes_per_s"] * r["sync_exchange_seconds"] == pytest.approx(moved, rel=1e-6), r
    assert syncs[-1] == 20

    # resumed from step 16: the mode the first run was in at 16, and no first choice again
    modes = [d["tune"]["mode"] for d in decisions if d["tune"]["switched"] and d["step"] <= 16]
    saved = json.loads((tmp_path / "ckpt" / "iter_0000016" / "metadata.json").read_text())
    assert saved["federation"]["tune"]["decided"] is True
    if modes:
        assert {k: saved["config"]["federation"][k] for k in modes[-1]} == modes[-1]
    second = launch(4, tmp_path / "b", tmp_path / "cache", *FLAGS, "--load", str(tmp_path / "ckpt"),
                    "--load-iteration", "16", "--save", str(tmp_path / "ckpt-b"), env_extra=env)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    label = next(line for line in second.stdout.splitlines() if "resuming in the mode" in line)
    assert label.split(": ")[-1] == _label(saved["config"]["federation"]), label
    assert not any(r["tune"]["reason"].startswith("first choice") for r in _records(tmp_path / "b") if "tune" in r)


def _label(fed: dict) -> str:
    from fl_megatron.cost_model.tune import SyncMode

    return SyncMode(fed["sync_dtype"], fed["overlap_steps"], fed["fragments"], fed["sync_interval"]).label()


def test_the_first_choice_times_a_step_beside_a_trial_exchange_at_half_the_first_interval(tmp_path):
    """H = 8: step 4 runs beside a throwaway exchange in the lowest allowed precision; its bytes are
    the only cross-group traffic before the first sync, and the first choice says it used it."""
    from fl_megatron.costs import wire_bytes_per_element

    # a step estimated at 10 s (--compute-seconds): the syncs are cheap beside it, so the first
    # choice before step 1 keeps the exact fp32 average, and the trial's bytes are alone before step 8
    flags = [*SGD, "--train-iters", "10", "--fl-group-size", "2", "--fl-sync-interval", "8", "--fl-tune",
             "--log-interval", "1", "--compute-seconds", "10"]
    run = launch(4, tmp_path / "run", tmp_path / "cache", *flags)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = _records(tmp_path / "run")
    source = next(r for r in records if "tune" in r)["tune"]["overlap_interference_from"]
    assert source["trial"]["step"] == 4 and source["trial"]["sync_dtype"] == "int8", source
    assert source["exchange_seconds"] > 0 and source["step_seconds"] > 0
    # on loopback links a step's worth of bytes is more than a sync moves: the trial is one rank's shard
    params = int(re.search(r"\(([\d,]+) parameters\)", run.stdout).group(1).replace(",", ""))
    assert params / 2 <= source["trial"]["elements"] <= params / 2 * 1.02, (params, source)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["link_probe"]["overlap_interference"] == 0.0  # the trial replaced the probe's loop
    # the first choice before step 1, from the probe and the estimated compute time: fp32 at H = 8
    start, first = config["fl_tune_start"], next(r for r in records if "tune" in r)["tune"]
    assert "fl-tune before step 1" in run.stdout and start["estimated_step_seconds"] == 10.0, start
    assert start["label"] == first["label"] or first["switched"], (start, first)
    assert start["mode"] == {"sync_dtype": "fp32", "overlap_steps": 0, "fragments": 1, "sync_interval": 8,
                             "error_feedback": False, "topk_density": 0.0}, start
    # group 0's records (rank 0's ledger) of every step before the sync
    group = [json.loads(line) for line in (tmp_path / "run" / "groups" / "group_00000.jsonl").read_text().splitlines()]
    with_bytes = {r["step"]: r["inter_group_bytes"] for r in group}
    assert with_bytes[3] == with_bytes[1] == 0, with_bytes
    trial = source["trial"]["elements"] * wire_bytes_per_element("int8")
    assert with_bytes[4] == pytest.approx(trial, rel=0.01) and with_bytes[7] == with_bytes[4], (with_bytes, trial)
