"""One group's side of per-group step counts (federation/rounds.py): its step within the round,
its step times, and what it brings to the round's vote."""

import time
from typing import Optional

from ..config import ResolvedRun
from ..federation.rounds import Round, RoundClock
from ..group_layout import group_sizes_of


def group_rounds(run: ResolvedRun, group: int) -> Optional["GroupRounds"]:
    """Group `group`'s rounds where the run plans per-group step counts, else None. A group's
    tokens per step are its share of the run's (its ranks' micro-batches)."""
    fed = run.cfg.federation
    if not fed.per_group_steps:
        return None
    per_rank = run.tokens_per_step // run.world_size
    clock = RoundClock([per_rank * size for size in group_sizes_of(run.layout)[0]], fed.sync_interval,
                       run.cfg.training.train_iters, fed.pinned_intervals, fed.balance_steps)
    return GroupRounds(clock, group)


class GroupRounds:
    """Where group `group` stands in the rounds of `clock`."""

    def __init__(self, clock: RoundClock, group: int) -> None:
        self.clock, self.group = clock, group
        self.in_round = 0          # steps this group trained in the current round
        self.round_began = 0.0     # when its first step began (perf_counter)
        self.ended: Optional[Round] = None  # the round whose sync the last step ended with

    @property
    def own_steps(self) -> int:
        """This group's optimizer steps so far (its data position)."""
        return self.clock.group_steps[self.group] + self.in_round

    def resume(self, state: Optional[dict], iteration: int) -> None:
        """Go on from a checkpoint of step `iteration`: its recorded rounds (`state`), or, saved by
        a run without per-group counts, every group at that step."""
        if state is not None:
            self.clock.restore(state)
        else:
            self.clock.restore_equal(iteration)

    @property
    def federation_step(self) -> int:
        """The federation step of the last sync (0 before the first): the rounds' tokens so far
        over one step of every group."""
        return self.clock.round.start_tokens // self.clock.step_tokens

    @property
    def running(self) -> bool:
        return not self.clock.finished

    @property
    def steps(self) -> int:
        """This group's steps in the current round."""
        return self.clock.round.steps[self.group]

    def position(self) -> float:
        """The learning-rate schedule's position of the step about to run."""
        return self.clock.position(self.group, self.in_round)

    def begin_step(self) -> None:
        """A step begins (before anything of it: its data, a slowed group's sleep)."""
        if self.in_round == 0:
            self.round_began = time.perf_counter()

    def stepped(self) -> None:
        self.in_round += 1
        self.ended = None

    @property
    def due(self) -> bool:
        """Whether the step just trained ends this group's part of the round (the sync follows)."""
        return self.in_round >= self.steps

    @property
    def last(self) -> bool:
        """Whether that sync is the run's last."""
        return self.due and self.clock.last_round

    def vote_fields(self) -> dict:
        """What the group brings to the round's vote: its tokens (the weight of its shards in the
        average) and its step time (the next round's plan): the round's wall time over its steps.
        Call after the group's figures were reduced, which waits for the device: on a GPU the host
        runs ahead of the steps, so only a time read after such a wait counts them whole."""
        seconds = (time.perf_counter() - self.round_began) / self.in_round if self.in_round else None
        return {"tokens": self.clock.round.group_tokens(self.group), "step_seconds": seconds}

    def advance(self, step_seconds: Optional[list]) -> Round:
        """The round's sync is done: plan the next one (every rank alike, from the vote's step
        times). Returns the round that ended."""
        self.in_round = 0
        self.ended = self.clock.advance(step_seconds)
        return self.ended

    def crossed(self, interval: int) -> bool:
        """Whether the sync just done passed a multiple of `interval` federation steps (an
        evaluation every --eval-interval steps lands at the first sync at or after it)."""
        if self.ended is None or interval <= 0:
            return False
        b = self.clock.step_tokens
        before, after = self.ended.start_tokens // b, (self.ended.start_tokens + self.ended.tokens) // b
        return after // interval > before // interval
