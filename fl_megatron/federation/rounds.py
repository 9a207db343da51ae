"""Per-group step counts (--fl-group-intervals, --fl-balance-steps): round by round, how many
optimizer steps each federation group trains before the sync that ends the round, and the
federation's progress in tokens, which the learning rate and --train-iters follow.

Pure arithmetic on numbers every rank holds alike (the plan, the groups' tokens per step, and the
step times the vote carries), so every rank derives the same rounds without a collective of its
own. With equal groups and equal counts every position is today's step, exactly.

B, the tokens of one federation step, is the sum of the groups' tokens per optimizer step: what
the federation trains in one step when every group takes one. --train-iters N is a budget of
N x B tokens. Round k starts at P_k tokens and trains dP_k = sum_i H_i x b_i; step j of group i
in it runs at the learning rate of today's schedule at (P_k + j / H_i x dP_k) / B.
"""

from dataclasses import dataclass
from typing import Optional, Sequence


def resume_problem(saved: dict, tokens_per_step: Sequence[int]) -> Optional[str]:
    """Why a checkpoint's rounds (`saved`, RoundClock.state) cannot go on in a run whose groups
    train `tokens_per_step`, or None: its positions are counted in those tokens."""
    if list(saved["tokens_per_step"]) != list(tokens_per_step):
        return (f"the checkpoint's groups trained {saved['tokens_per_step']} tokens per step and this run's train "
                f"{list(tokens_per_step)}: resume with the same groups and batch sizes")
    return None


def balanced_steps(interval: int, step_seconds: Sequence[float],
                   tokens_per_step: Optional[Sequence[int]] = None) -> tuple[int, ...]:
    """Each group's steps for a round in which the fastest group trains `interval` steps: as many
    as fit in that time (at least one), or one more where that raises the round's rate (its
    tokens over its slowest group's time) and still ends before the fastest group could have
    taken another step. Deterministic in its inputs, so every rank plans alike."""
    if interval < 1 or not step_seconds or min(step_seconds) <= 0:
        raise ValueError(f"interval={interval}, step_seconds={list(step_seconds)}: need >= 1 and positive times")
    tokens = list(tokens_per_step) if tokens_per_step else [1] * len(step_seconds)
    fastest = min(step_seconds)
    base, limit = interval * fastest, (interval + 1) * fastest

    def plan(round_seconds: float) -> tuple[int, ...]:
        return tuple(max(1, min(interval, int(round_seconds / t * (1 + 1e-9)))) for t in step_seconds)

    def rate(steps: tuple[int, ...]) -> float:
        return sum(n * b for n, b in zip(steps, tokens)) / max(n * t for n, t in zip(steps, step_seconds))

    later = sorted((int(base / t) + 1) * t for t in step_seconds if base < (int(base / t) + 1) * t < limit)
    return max((plan(seconds) for seconds in [base, *later]), key=rate)  # the first of equal rates: the earliest


@dataclass(frozen=True)
class Round:
    """One round: where it starts in the federation's tokens and how many steps each group takes."""

    index: int
    start_tokens: int          # P_k: the federation's tokens before this round
    steps: tuple[int, ...]     # H_i of each group
    tokens_per_step: tuple[int, ...]  # b_i of each group

    @property
    def tokens(self) -> int:
        """dP_k: what the round trains, all groups together."""
        return sum(h * b for h, b in zip(self.steps, self.tokens_per_step))

    def group_tokens(self, group: int) -> int:
        return self.steps[group] * self.tokens_per_step[group]


class RoundClock:
    """The rounds of one run. `tokens_per_step`: b_i of each group; `interval`: H, the fastest
    group's steps in a balanced round; `train_iters`: the budget in federation steps; `pinned`:
    fixed counts per group (--fl-group-intervals); `balance`: plan each round from the step times
    of the last (the first round is one step each, which measures them)."""

    def __init__(self, tokens_per_step: Sequence[int], interval: int, train_iters: int,
                 pinned: Sequence[int] = (), balance: bool = False) -> None:
        if not tokens_per_step or min(tokens_per_step) < 1 or interval < 1 or train_iters < 1:
            raise ValueError(f"tokens_per_step={list(tokens_per_step)}, interval={interval}, "
                             f"train_iters={train_iters}: need positive values")
        if pinned and (len(pinned) != len(tokens_per_step) or min(pinned) < 1):
            raise ValueError(f"pinned steps {list(pinned)}: need one count >= 1 per group "
                             f"({len(tokens_per_step)} groups)")
        if pinned and balance:
            raise ValueError("pinned steps and balancing exclude each other: pin the plan or let it balance")
        self.tokens_per_step = tuple(int(b) for b in tokens_per_step)
        self.interval, self.pinned, self.balance = interval, tuple(pinned), balance
        self.step_tokens = sum(self.tokens_per_step)  # B
        self.budget = train_iters * self.step_tokens
        self.group_steps = [0] * len(self.tokens_per_step)  # each group's steps in the rounds that ended
        first = self.pinned or ((1,) * len(self.tokens_per_step) if balance else (interval,) * len(self.tokens_per_step))
        self.round = self._trimmed(Round(0, 0, first, self.tokens_per_step))

    @property
    def num_groups(self) -> int:
        return len(self.tokens_per_step)

    @property
    def finished(self) -> bool:
        """Whether the budget is trained (after the last round's sync)."""
        return self.round.start_tokens >= self.budget

    @property
    def last_round(self) -> bool:
        return self.round.start_tokens + self.round.tokens >= self.budget

    def _trimmed(self, plan: Round) -> Round:
        """`plan`, its counts cut in proportion where it would pass the budget (the last round):
        ceil(H_i x left / dP). With equal groups that is exactly the steps left."""
        left = self.budget - plan.start_tokens
        if left <= 0 or plan.tokens <= left:
            return plan
        steps = tuple(max(1, -(-h * left // plan.tokens)) for h in plan.steps)
        return Round(plan.index, plan.start_tokens, steps, plan.tokens_per_step)

    def position(self, group: int, step_in_round: int) -> float:
        """Where the learning-rate schedule stands (in federation steps) at step `step_in_round`
        (0-based) of `group` in this round: (P_k + j / H_i x dP_k) / B, exact in integers."""
        r = self.round
        h = r.steps[group]
        return (r.start_tokens * h + step_in_round * r.tokens) / (h * self.step_tokens)

    def sync_step(self) -> int:
        """The federation step the round's sync ends at, the same on every rank: floor((P_k + dP_k) / B)
        (each round adds at least one: every group takes a step). At the last it is --train-iters:
        the cut passes the budget by less than one step of each group, B in all."""
        return (self.round.start_tokens + self.round.tokens) // self.step_tokens

    def advance(self, step_seconds: Optional[Sequence[Optional[float]]] = None) -> Round:
        """The round ended at its sync: the next one, planned from the groups' step times of this
        one (the vote's; with balancing, a group that gave none keeps its count). Returns the
        round that ended."""
        ended = self.round
        self.group_steps = [n + h for n, h in zip(self.group_steps, ended.steps)]
        start = ended.start_tokens + ended.tokens
        steps = self.pinned or ((self.interval,) * self.num_groups)
        if self.balance:
            times = list(step_seconds or [])
            if len(times) == self.num_groups and all(t is not None and t > 0 for t in times):
                steps = balanced_steps(self.interval, times, self.tokens_per_step)
            elif ended.index > 0:
                steps = ended.steps
        self.round = self._trimmed(Round(ended.index + 1, start, steps, self.tokens_per_step))
        return ended

    def state(self) -> dict:
        """Where the rounds stand, for a checkpoint taken at a sync: the round about to start, its
        planned counts, and each group's steps so far (plain JSON)."""
        r = self.round
        return {"round": r.index, "start_tokens": r.start_tokens, "steps": list(r.steps),
                "group_steps": list(self.group_steps), "tokens_per_step": list(self.tokens_per_step)}

    def restore(self, state: dict) -> None:
        """Go on from `state` (a checkpoint's). This run's pinned counts win over the recorded
        plan; the budget is this run's. ValueError where the groups' tokens per step differ."""
        problem = resume_problem(state, self.tokens_per_step)
        if problem:
            raise ValueError(problem)
        self.group_steps = list(state["group_steps"])
        steps = self.pinned or tuple(state["steps"])
        self.round = self._trimmed(Round(state["round"], state["start_tokens"], steps, self.tokens_per_step))

    def restore_equal(self, iteration: int) -> None:
        """Go on from a checkpoint of a run without per-group counts, at step `iteration`: every
        group took that many steps."""
        self.restore({"round": 0, "start_tokens": iteration * self.step_tokens, "steps": list(self.round.steps),
                      "group_steps": [iteration] * self.num_groups, "tokens_per_step": list(self.tokens_per_step)})
