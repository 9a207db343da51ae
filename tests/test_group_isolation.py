"""Between two syncs no collective spans two federation groups: every collective of a whole run
is recorded with the global ranks of its process group and the trainer's phase and step, and
checked against the layout's groups. The groups' records are checked against each rank's own
losses (the reference: today's mean over all ranks)."""

import importlib.util
import json
import math
import os
from collections import Counter
from pathlib import Path

import pytest
import torch.distributed as dist

from fl_megatron.federation.ledger import CollectiveCounter
from fl_megatron.local_ranks import run_ranks
from fl_megatron.topology import federation_groups, peer_groups, replica_groups
from fl_test_utils import make_trainer, tiny_config

pytestmark = pytest.mark.timeout(900)

STEPS, H = 12, 4
MEETINGS = ("start-up", "checkpoint-write", "evaluation", "summary")  # where groups may meet
BACKENDS = ["fsdp2"] + [b for b in ("deepspeed", "megatron") if importlib.util.find_spec(b) is not None]


def _recorded_run(run_dir: str, cache: str, backend: str = "fsdp2", group_size: int = 2, shard_size=None,
                  **federation) -> dict:
    """Train STEPS steps (a sync every H, logging every step, a signal handler and a time limit
    watched, a checkpoint at the end) with every collective recorded."""
    cfg = tiny_config(run_dir, cache, group_size=group_size, shard_size=shard_size, sync_interval=H,
                      optimizer="adamw", lr=3e-3, steps=STEPS, backend=backend)
    cfg.training.log_interval, cfg.training.eval_iters, cfg.training.eval_interval = 1, 1, 2 * H
    c = cfg.checkpoint
    c.save, c.exit_signal_handler, c.exit_duration_in_mins = f"{run_dir}/ckpt", True, 1000.0
    for name, value in federation.items():
        setattr(cfg.federation, name, value)
    trainer = make_trainer(cfg)
    events, losses = [], {}
    step = trainer.step

    def recorded_step(index):  # each rank's own loss of every step: the reference for the records
        outcome = step(index)
        losses[index + 1] = float(outcome.loss)
        return outcome

    trainer.step = recorded_step
    with CollectiveCounter(lambda name, ranks, nbytes: events.append((trainer.phases.phase, trainer.phases.step,
                                                                      name, ranks, nbytes))):
        trainer.train()
    trainer.close()
    return {"events": events, "losses": losses, "interval": cfg.federation.fragment_interval,
            "overlap": cfg.federation.overlap_steps}


def _job(rank, world, tmp, cache):
    out = {}
    if world == 8:  # FL+HSDP: 2 groups of 2 replicas x 2 shards
        out["fsdp2-hsdp"] = _recorded_run(f"{tmp}/hsdp", cache, group_size=4, shard_size=2)
        return out
    for backend in BACKENDS:
        out[backend] = _recorded_run(f"{tmp}/{backend}", cache, backend)
    out["fsdp2-every-option"] = _recorded_run(
        f"{tmp}/options", cache, outer_optimizer="nesterov", sync_dtype="int8", error_feedback=True,
        overlap_steps=1, fragments=2, inner_state="average", sick_loss_ratio=3.0)
    out["fsdp2-gossip"] = _recorded_run(f"{tmp}/gossip", cache, topology="ring")
    os.environ["FL_MEGATRON_FAULT"] = "lockstep"  # the coupled loop: the check must catch it
    out["lockstep"] = _recorded_run(f"{tmp}/lockstep", cache)
    del os.environ["FL_MEGATRON_FAULT"]
    dist.barrier()
    return out


def _violations(events: list, layout_groups: list, sync_groups: list, sync_steps: set) -> list:
    """Collectives outside the meetings whose ranks are not inside one federation group (at a
    sync step's sync: nor inside one peer or replica group)."""
    def inside(ranks, groups):
        return ranks is not None and any(set(ranks) <= set(g) for g in groups)

    bad = []
    for phase, step, name, ranks, _ in events:
        if phase in MEETINGS:
            continue
        allowed = layout_groups + (sync_groups if phase == "sync" and step in sync_steps else [])
        if not inside(ranks, allowed):
            bad.append((phase, step, name, ranks))
    return bad


def _check(tmp: Path, name: str, results: list, layout) -> None:
    fed, between = federation_groups(layout), peer_groups(layout) + replica_groups(layout)
    per_rank = [r[name] for r in results]
    syncs = set(range(per_rank[0]["interval"], STEPS + 1, per_rank[0]["interval"]))
    landings = {s + per_rank[0]["overlap"] for s in syncs if s < STEPS}  # an overlapped sync lands K steps on
    bad = [v for r in per_rank for v in _violations(r["events"], fed, between, syncs | landings)]
    assert not bad, (name, bad[:10])
    # across the groups a sync makes at most one latency-bound collective besides its data (the
    # vote, which also carries the previous sync's metrics), none where the vote rides on the
    # data (a plain fp32 average without replica split); the last sync one more, for its own
    # metrics. The main thread's are counted: an overlapped sync's data moves in its own thread.
    # Latency-bound: an all-reduce of at most 1 KiB (the vote's table is 8 bytes per slot; the
    # tiny model's fp32 data is 100s of KiB per rank, int8's moves by all-to-all and all-gather)
    # (Gossip measures the groups' consensus at each sync in rounds of its own: not counted.)
    peers = [set(g) for g in peer_groups(layout)]
    for r in per_rank if name != "fsdp2-gossip" else ():
        latency_bound = Counter(step for phase, step, op, ranks, nbytes in r["events"]
                                if phase == "sync" and ranks is not None and set(ranks) in peers
                                and op == "allreduce_" and nbytes <= 1024)
        riding = name in BACKENDS  # FedAvg in fp32 without replica split: the vote rides on the data
        expected = {step: (1 if step == STEPS else 0) if riding else (2 if step == STEPS else 1) for step in syncs}
        assert dict(latency_bound) == {s: n for s, n in expected.items() if n}, (name, dict(latency_bound))
    # something was recorded between syncs (the group's own collectives), so the check saw the steps
    inside = [e for e in per_rank[0]["events"] if e[0] in ("forward-backward", "logging") and e[1] not in syncs]
    assert inside, name
    run_dir = tmp / {"fsdp2-hsdp": "hsdp", "fsdp2-every-option": "options", "fsdp2-gossip": "gossip"}.get(name, name)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    federation = {r["step"]: r for r in records if "loss" in r}
    assert sorted(federation) == sorted(syncs), name  # one federation record per sync
    for step in syncs:
        # today's figure: the mean over all ranks of their own losses, summed on the host in fp64
        reference = math.fsum(r["losses"][step] for r in per_rank) / len(per_rank)
        # ours: each group's fp32 all-reduce of its ranks' losses, then the mean over groups
        assert federation[step]["loss"] == pytest.approx(reference, rel=1e-6, abs=0), (name, step)
        for g, members in enumerate(fed):
            group_mean = math.fsum(per_rank[m]["losses"][step] for m in members) / len(members)
            assert federation[step]["group_losses"][g] == pytest.approx(group_mean, rel=1e-6, abs=0)
    for g, members in enumerate(fed):  # each group's file: every step, the group's own mean
        lines = (run_dir / "groups" / f"group_{g:05d}.jsonl").read_text().splitlines()
        group_records = [json.loads(line) for line in lines]
        assert [r["step"] for r in group_records] == list(range(1, STEPS + 1)), name
        for r in group_records:
            assert r["group"] == g
            mean = math.fsum(per_rank[m]["losses"][r["step"]] for m in members) / len(members)
            assert r["loss"] == pytest.approx(mean, rel=1e-6, abs=0), (name, g, r["step"])


def test_no_collective_spans_two_groups_between_syncs(tmp_path):
    """4 ranks in 2 groups on every backend, with every sync option and with gossip; the coupled
    loop (FL_MEGATRON_FAULT=lockstep) is caught by the same check."""
    from fl_megatron.topology import make_layout

    results = run_ranks(4, _job, str(tmp_path), str(tmp_path / "cache"), timeout=850)
    layout = make_layout(4, 4, group_size=2)
    for name in [*BACKENDS, "fsdp2-every-option", "fsdp2-gossip"]:
        _check(tmp_path, name, results, layout)
    fed, between = federation_groups(layout), peer_groups(layout) + replica_groups(layout)
    caught = _violations(results[0]["lockstep"]["events"], fed, between, set(range(H, STEPS + 1, H)))
    assert {step for _, step, _, _ in caught} == set(range(1, STEPS + 1)), caught  # a sync too: never the world


def test_no_collective_spans_two_groups_between_syncs_hsdp(tmp_path):
    """FL+HSDP on 8 ranks: 2 groups, each 2 replicas x 2 shards."""
    from fl_megatron.topology import make_layout

    results = run_ranks(8, _job, str(tmp_path), str(tmp_path / "cache"), timeout=850)
    _check(tmp_path, "fsdp2-hsdp", results, make_layout(8, 8, group_size=4, shard_size=2))
