"""A switch of sync mode (--fl-tune): the outer optimizer's per-element state survives any new cut
of the fragments (recut_outer_state, against the flat state before it), and the engine's mode is
one value replaced whole: the settings it was built from are left alone, residuals carry over only
while the codec and the cut stay, and the next syncs follow the new mode."""

from typing import Optional

import pytest
import torch

from fl_megatron.config import FederationConfig
from fl_megatron.config.sync_mode import SyncMode
from fl_megatron.federation import FederationEngine
from fl_megatron.federation.fragments import fragment_views
from fl_megatron.federation.mode_switch import copy_in_element_order, recut_outer_state
from fl_megatron.federation.outer import OuterOptimizer
from test_engine_fake_backend import FakeBackend, _groups

SIZES = (7, 5)  # 12 elements: fragments cut across the two shards


def _shards() -> list[torch.Tensor]:
    return [torch.linspace(-1, 1, n) for n in SIZES]


def _outers(shards: list, fragments: int, kind: str) -> list[OuterOptimizer]:
    return [OuterOptimizer(views, kind, 0.7, 0.9) for views in fragment_views(shards, fragments)]


def _flat_state(outers: list[OuterOptimizer], key: str) -> torch.Tensor:
    """One state tensor of every fragment's outer optimizer, in the shards' element order."""
    return torch.cat([outer.optimizer.state[a][key].reshape(-1) for outer in outers for a in outer.anchors])


def _drive(outers: list[OuterOptimizer], shards: list, fragments: int, rounds: int) -> None:
    """A few outer steps with a different pseudo-gradient for every element."""
    for r in range(rounds):
        offset = 0
        with torch.no_grad():
            for shard in shards:
                shard.add_(torch.arange(offset, offset + shard.numel(), dtype=torch.float32) * 0.01 + 0.1 * (r + 1))
                offset += shard.numel()
        for outer, views in zip(outers, fragment_views(shards, fragments)):
            outer.to_pseudo_gradients(views)
            outer.step(views)


@pytest.mark.parametrize("kind,key", [("nesterov", "momentum_buffer"), ("adam", "exp_avg_sq")])
@pytest.mark.parametrize("old,new", [(1, 2), (2, 4), (4, 3), (3, 1)])
def test_recut_keeps_every_elements_outer_state(kind, key, old, new):
    shards = _shards()
    before = _outers(shards, old, kind)
    _drive(before, shards, old, rounds=3)
    flat = _flat_state(before, key)
    assert flat.abs().min() > 0 and len(set(flat.tolist())) == len(flat)  # distinct per element
    after = _outers(shards, new, kind)
    recut_outer_state(before, old, after, new, shards)
    assert torch.equal(_flat_state(after, key), flat)
    if kind == "adam":  # the step count travels with the moments
        assert all(float(o.optimizer.state[a]["step"]) == 3 for o in after for a in o.anchors)


def _drifting(backend: FakeBackend, step: int) -> None:
    """The group trains: every element moves by its own amount."""
    with torch.no_grad():
        for i, shard in enumerate(backend.shards):
            shard.add_(torch.arange(shard.numel(), dtype=torch.float32) * 0.01 * (i + 1) + 0.001 * step)


def test_switch_mode_replaces_the_mode_and_carries_the_sync_state(world):
    backend = FakeBackend()
    backend.shards = _shards()
    given = FederationConfig(outer_optimizer="nesterov", sync_interval=4)
    engine = FederationEngine(backend, _groups(world), given)
    for step in range(1, 9):
        _drifting(backend, step)
        engine.after_step(step)
    momentum = _flat_state(engine.state.outers, "momentum_buffer")
    assert momentum.abs().min() > 0

    compressed = SyncMode("int8", 0, 2, 4, error_feedback=True)
    engine.switch_mode(compressed)
    assert engine.mode == compressed and (engine.config.sync_dtype, engine.config.fragments) == ("int8", 2)
    assert (given.sync_dtype, given.fragments, given.error_feedback) == ("fp32", 1, False)  # not mutated
    assert torch.equal(_flat_state(engine.state.outers, "momentum_buffer"), momentum)  # re-cut, every element
    assert len(engine.state.outers) == 2 and all(a.residuals == {} for a in engine.state.averagers)

    # the new mode's schedule: one fragment every H/N = 2 steps, in turn, with error feedback
    moved = []
    for step in range(9, 13):
        _drifting(backend, step)
        result = engine.after_step(step)
        moved.append(None if result is None else result.fragments)
    assert moved == [None, (0,), None, (1,)]
    residuals = [dict(a.residuals) for a in engine.state.averagers]
    assert all(r and all(t.abs().sum() > 0 for t in r.values()) for r in residuals)

    # a new H alone keeps the codec and the cut: the residuals carry over, the same tensors
    engine.switch_mode(SyncMode("int8", 0, 2, 8, error_feedback=True))
    assert [a.residuals for a in engine.state.averagers] == residuals
    assert engine.due(4) is True and engine.due(2) is False  # now every H/N = 4 steps
    # and an overlap needs the exchange's own communicators, which these groups lack
    with pytest.raises(ValueError, match="exchange's own process groups"):
        engine.switch_mode(SyncMode("int8", 1, 2, 8, error_feedback=True))
    assert engine.mode == SyncMode("int8", 0, 2, 8, error_feedback=True)  # a refused switch changes nothing


@pytest.mark.parametrize("old,new", [(1, 2), (2, 4), (4, 3), (3, 1)])
def test_copy_in_element_order_moves_every_element_across_cuts(old, new):
    whole = torch.randn(sum(SIZES))
    source = [v.clone() for views in fragment_views(list(whole.split(list(SIZES))), old) for v in views]
    target = [torch.zeros_like(v) for views in fragment_views([torch.zeros(n) for n in SIZES], new) for v in views]
    copy_in_element_order(source, target)
    assert torch.equal(torch.cat([t.view(-1) for t in target]), whole)
    with pytest.raises(ValueError, match="different numbers of elements"):
        copy_in_element_order(source, target[:-1])


def _train_and_sync(world, switch_at: Optional[int]) -> tuple[list, FederationEngine]:
    """Nesterov in fp32 at H = 4 for 8 steps, then steps 9-10 and a full sync at 10; `switch_at`:
    a switch between syncs to 2 fragments before that step's sync (none is due at 9 or 10)."""
    backend = FakeBackend()
    backend.shards = _shards()
    engine = FederationEngine(backend, _groups(world), FederationConfig(outer_optimizer="nesterov", sync_interval=4))
    for step in range(1, 11):
        _drifting(backend, step)
        switch = SyncMode("fp32", 0, 2, 8) if step == switch_at else None
        engine.after_step(step, full=step == 10, switch=switch)
    return [s.clone() for s in backend.shards], engine


def test_a_switch_between_syncs_carries_each_elements_anchor_and_matches_the_run_without_it(world):
    """A switch to 2 fragments at step 9 (between the syncs of 8 and 10): the full sync of 10 ends
    exactly where the run that never switched ends, since every element kept its anchor and its
    momentum."""
    reference, unswitched = _train_and_sync(world, None)
    switched, engine = _train_and_sync(world, 9)
    assert engine.mode == SyncMode("fp32", 0, 2, 8) and len(engine.state.outers) == 2
    assert all(torch.equal(a, b) for a, b in zip(switched, reference))
    anchors = torch.cat([a.view(-1) for o in engine.state.outers for a in o.anchors])
    assert torch.equal(anchors, torch.cat([a.view(-1) for a in unswitched.state.outers[0].anchors]))
    assert torch.equal(_flat_state(engine.state.outers, "momentum_buffer"),
                       _flat_state(unswitched.state.outers, "momentum_buffer"))


def test_a_switch_from_the_plain_average_into_anchors_is_refused_between_syncs(world):
    backend = FakeBackend()
    backend.shards = _shards()
    engine = FederationEngine(backend, _groups(world), FederationConfig(sync_interval=4))
    anchored = SyncMode("int8", 0, 2, 4, error_feedback=True)
    assert not engine.can_switch_between_syncs(anchored)
    assert engine.can_switch_between_syncs(SyncMode("fp32", 0, 2, 4))  # the plain average keeps no anchors
    _drifting(backend, 1)
    with pytest.raises(ValueError, match="between syncs"):
        engine.after_step(1, switch=anchored)
    assert engine.mode == SyncMode("fp32", 0, 1, 4)
