"""Commit or roll back, in one process: a sync that loses a peer midway (its all-to-all fails) and
that the groups vote down leaves every shard and the whole sync state (outer anchors, Nesterov
momentum, int8 error-feedback residuals) bit for bit as they were before it, refreshes what derives
from the shards, and does not count as the last sync; a committed sync after it moves on."""

from types import SimpleNamespace

import pytest

import torch
import torch.distributed as dist

from fl_megatron.config import FederationConfig
from fl_megatron.federation import FederationEngine, compression
from fl_megatron.federation.membership import whole_federation
from fl_megatron.federation.transaction import RollbackTransaction
from fl_megatron.local_ranks import run_ranks
from fl_megatron.topology import make_layout
from test_engine_fake_backend import FakeBackend

LOST_PEER = "Connection closed by peer [127.0.0.1]:1234"  # what gloo raises when a peer dies


def _elastic_groups(world, votes: list):
    """Group 0 of 2 groups of 1 rank whose syncs may be voted down: `votes` lists the commits' outcomes."""
    layout = make_layout(2, ranks_per_node=1, group_size=1)
    groups = SimpleNamespace(layout=layout, coords=(0, 0, 0), rank=0, peer=world, replica=None, federation=world,
                             exchange_peer=None, meet=lambda: whole_federation(2, 0), tier=lambda kind: "inter-node",
                             device_type="cpu", errors=[],
                             all_reduce_job=lambda tensor, op=dist.ReduceOp.SUM: dist.all_reduce(tensor, op, group=world),
                             reduce_across_groups=lambda tensor, op, call: call(dist.all_reduce, tensor, op=op, group=world))
    groups.transaction = lambda backend, state: RollbackTransaction(groups, backend, state)
    groups.report_error = groups.errors.append
    groups.peer_deadline = lambda: None
    groups.commit = lambda: votes.pop(0)
    return groups


def _train(backend: FakeBackend, amount: float) -> None:
    with torch.no_grad():
        for shard in backend.shards:
            shard.add_(torch.linspace(-amount, 2 * amount, shard.numel()))


def _snapshot(backend: FakeBackend, engine: FederationEngine) -> tuple:
    return [s.clone() for s in backend.shards], {k: v.clone() for k, v in engine.state_tensors().items()}


def test_a_sync_voted_down_restores_shards_anchors_momentum_and_residuals(world, monkeypatch):
    backend = FakeBackend()
    backend.shards = [torch.linspace(-1, 1, 300), torch.linspace(0.5, 2, 17)]  # several int8 blocks, one odd
    votes = [True, False, True]
    groups = _elastic_groups(world, votes)
    config = FederationConfig(outer_optimizer="nesterov", sync_dtype="int8", error_feedback=True, sync_interval=2)
    engine = FederationEngine(backend, groups, config)
    _train(backend, 0.3)
    assert engine.sync(2).committed and engine.last_synced_step == 2
    state = engine.state_tensors()
    assert any(k.startswith("residual.") and v.abs().sum() > 0 for k, v in state.items())  # a real residual
    assert any("momentum_buffer" in k and v.abs().sum() > 0 for k, v in state.items())   # and momentum
    _train(backend, 0.2)
    shards_before, state_before = _snapshot(backend, engine)

    calls = []
    real = compression.dist.all_to_all_single

    def lose_a_peer(*args, **kwargs):  # the second all-to-all of the sync: a peer died
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError(LOST_PEER)
        return real(*args, **kwargs)

    monkeypatch.setattr(compression.dist, "all_to_all_single", lose_a_peer)
    backend.calls.clear()
    result = engine.sync(4)
    monkeypatch.undo()
    assert not result.committed and len(calls) == 2  # nothing more was sent after the loss
    assert LOST_PEER in str(groups.errors[0])
    shards_after, state_after = _snapshot(backend, engine)
    assert all(torch.equal(a, b) for a, b in zip(shards_after, shards_before))
    assert sorted(state_after) == sorted(state_before)
    assert all(torch.equal(state_after[k], state_before[k]) for k in state_before), \
        [k for k in state_before if not torch.equal(state_after[k], state_before[k])]
    assert backend.calls[-1] == "refresh" and engine.last_synced_step == 2

    # the next sync is committed and moves on from the restored state
    moved = engine.sync(6)
    assert moved.committed and engine.last_synced_step == 6 and not votes
    assert not all(torch.equal(a, b) for a, b in zip(backend.shards, shards_before))


class MomentBackend(FakeBackend):
    """A FakeBackend with inner optimizer state: two moments per shard and a Python-int step count
    (as DeepSpeed's FusedAdam keeps it), sent and taken as `optimizer_transfer_state` says."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.shards = [torch.linspace(-1, 1, 300) * (rank + 1), torch.linspace(0.5, 2, 17) + rank]
        self.moments = [[s * 0.1 + rank, s.abs() * 0.01 + rank] for s in self.shards]
        self.step_count = 7 + rank

    def inner_state_shards(self) -> list:
        return [m for pair in self.moments for m in pair]

    def reset_optimizer_state(self) -> None:
        self.calls.append("reset")
        self.moments, self.step_count = [], 0

    def optimizer_transfer_state(self) -> list:
        return [*self.inner_state_shards(), torch.tensor(self.step_count, dtype=torch.int64)]

    def load_optimizer_transfer_state(self, tensors: list) -> None:
        *moments, count = tensors
        self.moments = [[moments[2 * i].clone(), moments[2 * i + 1].clone()] for i in range(len(self.shards))]
        self.step_count = int(count)


def _everything(backend: MomentBackend, engine: FederationEngine) -> dict:
    """What a sync may touch on this rank, as plain lists (tensors do not outlive the process)."""
    return {"shards": [s.tolist() for s in backend.shards],
            "inner": [t.tolist() for t in backend.optimizer_transfer_state()],
            "sync_state": {k: v.tolist() for k, v in engine.state_tensors().items()},
            "last_synced_step": engine.last_synced_step}


def _rollback_rank(rank: int, world: int, sick_rank: int) -> list:
    """Group `rank` of 2 (one rank each): syncs at 2 (voted down: the first ever), 4 (kept), 6
    (voted down), 8 (kept), each after some training; the state before and after each sync."""
    backend = MomentBackend(rank)
    groups = _elastic_groups(dist.group.WORLD, [False, True, False, True])
    groups.coords, groups.rank = (rank, 0, 0), rank
    groups.federation = [dist.new_group([r]) for r in range(world)][rank]  # each group its own rank
    groups.meet = lambda: whole_federation(2, rank)
    inner = "keep" if sick_rank >= 0 else "average"
    engine = FederationEngine(backend, groups, FederationConfig(outer_optimizer="nesterov", sync_dtype="int8",
                                                                error_feedback=True, sync_interval=2,
                                                                inner_state=inner))
    seen = []
    for step in (2, 4, 6, 8):
        _train(backend, 0.1 * step * (rank + 1))
        if step == 6 and rank == sick_rank:  # a sick group: left out and reset, unless the sync is undone
            backend.shards[1][3] = float("nan")
        before = _everything(backend, engine)
        committed = engine.sync(step).committed
        seen.append((step, committed, before, _everything(backend, engine), list(backend.calls)))
        if step == 6 and rank == sick_rank:
            backend.shards[1][3] = 0.0  # healthy again for the last sync
    return seen


@pytest.mark.parametrize("sick_rank", [-1, 1], ids=["inner-state-average", "sick-group-reset"])
def test_a_voted_down_sync_leaves_everything_it_touched_as_before(sick_rank):
    """Nesterov, int8 + error feedback, with --fl-inner-state average (the moments averaged in place)
    or a sick group (its moments reset): after a voted-down sync the shards, the inner optimizer's
    state with its step count, the outer anchors and momentum, the residuals and the last synced
    step equal the state before it, on both ranks; a kept sync changes each of them."""
    for rank, seen in enumerate(run_ranks(2, _rollback_rank, sick_rank, timeout=120)):
        for step, committed, before, after, _calls in seen:
            assert committed == (step in (4, 8)), (rank, step)
            if not committed:
                for key in before:
                    assert repr(after[key]) == repr(before[key]), (rank, step, key)  # (repr: NaN equals NaN)
                continue
            assert after["shards"] != before["shards"] and after["sync_state"] != before["sync_state"]
            assert after["last_synced_step"] == step
        # the sync that was undone did change the inner state before the vote came
        changed = [s for s in seen if s[0] == 6][0][4]
        if sick_rank < 0:
            kept = [s for s in seen if s[0] == 4][0]
            assert kept[3]["inner"] != kept[2]["inner"]  # a kept sync averages the moments
        elif rank == sick_rank:
            assert "reset" in changed


def _overlapped_rollback_rank(rank: int, world: int) -> list:
    """Group `rank` of 2, with 2 fragments (one every 2 steps), an overlapped sync landing 1 step
    after its launch and the moments averaged: landings at 3 and 7 voted down, 5 and 9 kept. For
    each landing: (step, kept, what it saw just before, the sync state at its launch, after)."""
    backend = MomentBackend(rank)
    groups = _elastic_groups(dist.group.WORLD, [False, True, False, True])
    groups.coords, groups.rank = (rank, 0, 0), rank
    groups.federation = [dist.new_group([r]) for r in range(world)][rank]
    groups.meet = lambda: whole_federation(2, rank)
    groups.has_exchange_groups = lambda: True  # the test's world passes between the two threads
    engine = FederationEngine(backend, groups, FederationConfig(
        outer_optimizer="nesterov", sync_dtype="int8", error_feedback=True, sync_interval=4, fragments=2,
        overlap_steps=1, inner_state="average"))
    seen, at_launch = [], None
    try:
        for step in range(1, 10):
            _train(backend, 0.05 * step * (rank + 1))
            for moment in backend.inner_state_shards():  # the inner step moves the moments too
                moment.add_(0.01 * step * (rank + 1))
            before = _everything(backend, engine)
            result = engine.after_step(step)
            if step % 2 == 0:
                at_launch = before["sync_state"]
                assert result is None and engine.flight is not None
            elif step > 1:  # a landing
                seen.append((step, result.committed, before, at_launch, _everything(backend, engine)))
    finally:
        engine.close()
    return seen


def test_a_voted_down_overlapped_sync_keeps_the_steps_trained_since_its_launch():
    """An overlapped fragment sync voted down at its landing: the shards and the inner moments are
    as just before the landing (the step trained since the launch kept), the sync state (anchors,
    momentum, and residuals its background exchange had changed) as at the launch; a kept landing
    changes all three."""
    for rank, seen in enumerate(run_ranks(2, _overlapped_rollback_rank, timeout=120)):
        assert [(step, kept) for step, kept, *_ in seen] == [(3, False), (5, True), (7, False), (9, True)]
        for step, kept, before, at_launch, after in seen:
            if not kept:
                assert after["shards"] == before["shards"] and after["inner"] == before["inner"], (rank, step)
                assert after["sync_state"] == at_launch, (rank, step)
                assert after["last_synced_step"] == before["last_synced_step"]
            else:
                assert after["shards"] != before["shards"] and after["inner"] != before["inner"], (rank, step)
                assert after["sync_state"] != at_launch, (rank, step)
