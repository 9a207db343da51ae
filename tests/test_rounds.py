"""Per-group step counts as pure arithmetic (federation/rounds.py): the plan, the trim of the last
round, the learning rate's position in federation tokens, and the weights of the vote."""

from fractions import Fraction

import pytest

from fl_megatron.config import TrainingConfig
from fl_megatron.federation.rounds import RoundClock, balanced_steps
from fl_megatron.federation.vote import token_weight
from fl_megatron.training.lr_schedule import learning_rate


def _walk(clock: RoundClock, group: int, times=None) -> list:
    """Every position `group` runs at, round by round, until the budget is trained."""
    positions = []
    while not clock.finished:
        positions += [clock.position(group, j) for j in range(clock.round.steps[group])]
        clock.advance(times)
    return positions


@pytest.mark.parametrize("train_iters,interval", [(40, 8), (37, 8), (5, 8), (12, 1)])
def test_equal_groups_run_at_todays_steps_exactly(train_iters, interval):
    """Equal groups with equal counts: every position is today's step index, the last round cut to
    the steps left, and the learning rate is today's, bit for bit."""
    cfg = TrainingConfig(train_iters=train_iters, lr=0.3, min_lr=0.01, lr_warmup_iters=3, lr_decay_style="cosine")
    for groups in ((4, 4), (6, 6, 6)):
        clock = RoundClock(groups, interval, train_iters, pinned=(interval,) * len(groups))
        positions = _walk(clock, 1)
        assert positions == list(range(train_iters))
        assert all(type(p) is float and p == int(p) for p in positions)
        assert [learning_rate(p, cfg) for p in positions] == [learning_rate(s, cfg) for s in range(train_iters)]
        assert clock.group_steps == [train_iters] * len(groups)


def test_a_pinned_plan_follows_the_federations_tokens():
    """(8, 4) with equal batches: B = 2 b, a round trains 12 b = 6 federation steps; group 0's step j
    runs at 6k + 6j/8, group 1's at 6k + 6j/4; the budget of 30 steps ends after 5 rounds, with
    both groups' positions covering [0, 30) at their own pace."""
    clock = RoundClock([100, 100], 8, 30, pinned=(8, 4))
    assert clock.step_tokens == 200 and clock.budget == 6000 and clock.round.tokens == 1200
    assert [clock.position(0, j) for j in range(8)] == [float(Fraction(6 * j, 8)) for j in range(8)]
    assert [clock.position(1, j) for j in range(4)] == [0.0, 1.5, 3.0, 4.5]
    assert clock.sync_step() == 6
    fast = _walk(clock, 0)
    assert len(fast) == 40 and fast[-1] == 30 - 6 / 8 and clock.group_steps == [40, 20]
    # groups of unequal size: tokens per step 3 : 1 (B = 4 b); group 1 (4 steps of b) and group 0
    # (8 steps of 3 b) train 28 b per round = 7 federation steps
    clock = RoundClock([300, 100], 8, 14, pinned=(8, 4))
    assert clock.round.tokens == 2800 and clock.sync_step() == 7
    assert [clock.position(1, j) for j in range(4)] == [0.0, 1.75, 3.5, 5.25]


def test_the_last_round_is_cut_in_proportion_to_the_tokens_left():
    """A budget that ends inside a round cuts each group's count to ceil(H_i x left / dP)."""
    clock = RoundClock([100, 100], 8, 9, pinned=(8, 4))  # 1800 tokens: one round of 1200, then 600 left
    clock.advance()
    assert clock.last_round and clock.round.steps == (4, 2) and clock.round.tokens == 600
    clock.advance()
    assert clock.finished and clock.group_steps == [12, 6]
    clock = RoundClock([100, 100], 8, 7, pinned=(8, 4))  # 200 left: ceil(8/6), ceil(4/6)
    clock.advance()
    assert clock.round.steps == (2, 1)
    # the cut passes the budget by less than B, so the last sync is named by --train-iters
    for sizes, pinned in (((100, 100, 100), (8, 4, 4)), ((300, 100), (3, 8)), ((100, 200, 50), (7, 5, 1))):
        for train_iters in range(1, 40):
            clock = RoundClock(sizes, 8, train_iters, pinned=pinned)
            while not clock.last_round:
                clock.advance()
            assert clock.sync_step() == train_iters, (sizes, pinned, train_iters)


def test_balancing_plans_from_the_step_times():
    """The first round takes one step each (it measures them); after it the fastest group takes H and
    the others what fits in its time, or one more step where that raises the round's rate."""
    assert balanced_steps(8, [0.15, 0.40]) == (8, 3)
    # 8 x 0.15 / 0.41 = 2.93: a third step ends at 1.23 s, before the fast group's ninth could (1.35 s),
    # and 11 steps in 1.23 s beat 10 in 1.2 s; with a fast group of 10x the tokens it does not pay
    assert balanced_steps(8, [0.15, 0.41]) == (8, 3)
    assert balanced_steps(8, [0.15, 0.41], [10, 1]) == (8, 2)
    assert balanced_steps(8, [0.15, 0.48]) == (8, 2)
    assert balanced_steps(8, [0.40, 0.15]) == (3, 8)
    assert balanced_steps(8, [0.1, 10.0]) == (8, 1)  # at least one step
    with pytest.raises(ValueError):
        balanced_steps(8, [0.1, 0.0])
    clock = RoundClock([100, 100], 8, 100, balance=True)
    assert clock.round.steps == (1, 1)
    clock.advance([0.15, 0.40])
    assert clock.round.steps == (8, 3) and clock.round.start_tokens == 200
    clock.advance([None, 0.40])  # a group that gave no time keeps the plan
    assert clock.round.steps == (8, 3)
    clock.advance([0.15, 0.15])
    assert clock.round.steps == (8, 8)


def test_token_weights_are_none_for_equal_tokens_and_sum_to_the_senders():
    assert token_weight([800, 800], [0, 1], 0) is None
    assert token_weight([None, None], [0, 1], 0) is None
    assert token_weight([], [0, 1], 0) is None
    assert token_weight([800, 400], [0, 1], 0) == pytest.approx(4 / 3)
    assert token_weight([800, 400], [0, 1], 1) == pytest.approx(2 / 3)
    # a sick group is left out: the senders' weights renormalise over the others
    assert token_weight([800, 400, 400], [1, 2], 1) is None
    weights = [token_weight([800, 400, 200], [0, 1, 2], g) for g in range(3)]
    assert sum(weights) == pytest.approx(3) and weights[0] == pytest.approx(4 * weights[2])


def test_bad_plans_are_refused():
    with pytest.raises(ValueError, match="one count >= 1 per group"):
        RoundClock([100, 100], 8, 10, pinned=(8,))
    with pytest.raises(ValueError, match="exclude each other"):
        RoundClock([100, 100], 8, 10, pinned=(8, 4), balance=True)


def test_a_checkpoints_rounds_resume_only_into_groups_of_the_same_tokens_per_step():
    clock = RoundClock([100, 100], 8, 30, pinned=(8, 4))
    clock.advance()
    state = clock.state()
    again = RoundClock([100, 100], 8, 30, pinned=(8, 4))
    assert again.restore(state) is None and again.state() == state and again.group_steps == [8, 4]
    with pytest.raises(ValueError, match=r"trained \[100, 100\] tokens per step and this run's train \[200, 100\]"):
        RoundClock([200, 100], 8, 30, pinned=(8, 4)).restore(state)
