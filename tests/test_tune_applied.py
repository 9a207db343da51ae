"""Where --fl-tune applies a choice (tuning_hook.before_or_after): in one world before the due sync
wherever the engine can switch between syncs, so that sync runs in the new mode; after a full
sync otherwise, under planned rounds, and in elastic mode (where the vote agrees the choice)."""

from types import SimpleNamespace

import pytest

from fl_megatron.config.sync_mode import SyncMode
from fl_megatron.training.tuning_hook import TuningHook

CHOICE = SyncMode("int4", 1, 4, 8)


def _hook(by_vote: bool) -> TuningHook:
    tuner = SimpleNamespace(by_vote=by_vote, last_record={"step": 8, "tune": {"switched": True}})
    return TuningHook(tuner)


def _engine(carries: bool):
    return SimpleNamespace(can_switch_between_syncs=lambda mode: carries and mode == CHOICE)


@pytest.mark.parametrize("by_vote,planned,carries,expected", [
    (False, False, True, (CHOICE, None)),   # one world, anchors carry over: before the sync
    (False, False, False, (None, CHOICE)),  # from the plain average: after a full sync
    (False, True, True, (None, CHOICE)),    # per-group step counts: the rounds plan the current mode
    (True, False, True, (None, CHOICE)),    # elastic: the vote agrees it, inside the sync
])
def test_a_choice_applies_before_the_sync_only_where_the_anchors_carry_over_in_one_world(by_vote, planned, carries,
                                                                                         expected):
    hook = _hook(by_vote)
    assert hook.before_or_after(_engine(carries), CHOICE, planned) == expected
    applied = hook.tuner.last_record["tune"].get("applied")
    if by_vote:
        assert applied is None
    else:
        assert applied == ("before this sync" if expected[0] else
                           "after this sync, which averages every fragment and blocks")
    assert hook.before_or_after(_engine(carries), None, planned) == (None, None)
