"""Commit or roll back, in one process: a sync that loses a peer midway (its all-to-all fails) and
that the groups vote down leaves every shard and the whole sync state (outer anchors, Nesterov
momentum, int8 error-feedback residuals) bit for bit as they were before it, refreshes what derives
from the shards, and does not count as the last sync; a committed sync after it moves on."""

from types import SimpleNamespace

import torch
import torch.distributed as dist

from fl_megatron.config import FederationConfig
from fl_megatron.federation import FederationEngine, compression
from fl_megatron.federation.membership import whole_federation
from fl_megatron.federation.transaction import RollbackTransaction
from fl_megatron.topology import make_layout
from test_engine_fake_backend import FakeBackend

LOST_PEER = "Connection closed by peer [127.0.0.1]:1234"  # what gloo raises when a peer dies


def _elastic_groups(world, votes: list):
    """Group 0 of 2 groups of 1 rank whose syncs may be voted down: `votes` lists the commits' outcomes."""
    layout = make_layout(2, ranks_per_node=1, group_size=1)
    groups = SimpleNamespace(layout=layout, coords=(0, 0, 0), rank=0, peer=world, replica=None, federation=world,
                             exchange_peer=None, meet=lambda: whole_federation(2, 0), tier=lambda kind: "inter-node",
                             device_type="cpu", errors=[],
                             all_reduce_job=lambda tensor, op=dist.ReduceOp.SUM: dist.all_reduce(tensor, op, group=world))
    groups.transaction = lambda backend, state: RollbackTransaction(groups, backend, state)
    groups.report_error = groups.errors.append
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
