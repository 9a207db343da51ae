"""A stop agreed at a sync holds for a group that healed at it (elastic mode). Such a group voted
at its own older step and goes on at the live groups' step, so the vote's step is not the step it
ends; the decision is checked here on the loop's own method, without processes."""

from types import SimpleNamespace

import pytest

from fl_megatron.federation.vote import Vote
from fl_megatron.training.trainer import Trainer


def _loop(vote: Vote):
    """The parts of a federated Trainer that `_agreed_stop` reads: a watching StopPolicy and the
    engine's vote."""
    return SimpleNamespace(_stop=SimpleNamespace(watching=True), federated=True,
                           engine=SimpleNamespace(active=True, vote=vote))


@pytest.mark.parametrize("signalled,timed_out", [(True, False), (False, True)])
def test_a_group_healed_at_a_sync_takes_the_stop_agreed_there(signalled, timed_out):
    # group 1 missed a quorum at step 6, so its sync came after its own step 9; it healed there and
    # goes on at the live groups' step 12, where they agreed to stop
    vote = Vote(step=9, signalled=signalled, timed_out=timed_out)
    sync = SimpleNamespace(step=9)
    assert Trainer._agreed_stop(_loop(vote), 12, None, sync) == (signalled, timed_out)
    # the same vote at a step without a sync (the vote is an older one) agrees nothing
    assert Trainer._agreed_stop(_loop(vote), 13, None, None) is None


def test_a_group_that_stays_in_step_reads_its_own_syncs_vote():
    vote = Vote(step=12, signalled=True)
    assert Trainer._agreed_stop(_loop(vote), 12, None, SimpleNamespace(step=12)) == (True, False)
    # an overlapped launch votes without a sync result: the vote of that step still counts
    assert Trainer._agreed_stop(_loop(vote), 12, None, None) == (True, False)
    assert Trainer._agreed_stop(_loop(Vote(step=8, signalled=True)), 12, None, None) is None
