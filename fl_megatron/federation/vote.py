"""The vote at a sync, before any data moves: which federation groups are sick, every group's
figures of the step (loss, gradient norm) and whether any rank asked to stop.

Two tiny all-reduces (MAX): inside the federation group (its ranks' flags), then across the groups
(over the peer group, one rank of every group; with groups of unequal size over the groups' first
ranks, who pass it on to their group), so every rank of the job ends with the same vote and no
collective spans the job. Each group fills its own slots of the peer vector; the others hold
-inf, so MAX gathers the groups' figures (in elastic mode the slots of absent groups stay -inf).
The previous sync's metric sums ride here too (one world): each rank brings its own (squared
deviations, squares, sample count) in its own slots of the in-group vector, each group their sum in
its slots of the table, and every rank adds the groups' up alike: the job's totals, with no round
of their own (docs/metrics.md, "When a sync's metrics are reported").
In elastic mode --fl-tune's choice rides here too: each group brings the mode it chose, and the
lowest-numbered group that chose one decides for all who met. With per-group step counts
(rounds.py) each group also brings the tokens it trained since the last sync, which weight the
average, and its step time, from which every rank plans the next round alike.
"""

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..config.sync_mode import VALUE_CODES, SyncMode
from .failed_collective import call_directly


EXACT_CHECK_ELEMENTS = 1 << 24  # the exact check's slice: 16 MiB of booleans at most


class AllGroupsSick(RuntimeError):
    """Every group is sick: there is nothing to average (the run stops; no checkpoint is written)."""


@dataclass
class GroupFigures:
    """What this rank brings to a vote: its group's step figures (the same on every rank of the
    group: the trainer reduces them inside the group first) and its own stop requests."""

    loss: Optional[float] = None        # the group's mean loss of the step
    grad_norm: Optional[float] = None   # the group's gradient norm of the step
    signalled: bool = False             # this rank received SIGTERM (--exit-signal-handler)
    timed_out: bool = False             # this rank is past --exit-duration-in-mins
    healing: bool = False               # the group took the live groups' state at this quorum (elastic)
    tune_choice: Optional[SyncMode] = None  # the mode --fl-tune chose at this sync (elastic: agreed in the vote)
    tokens: Optional[int] = None        # per-group step counts: the group's tokens since the last sync
    step_seconds: Optional[float] = None  # per-group step counts: the group's step time since the last sync


@dataclass
class Vote:
    """The outcome, identical on every rank."""

    step: int
    sick: list = field(default_factory=list)    # groups left out of this average
    losses: list = field(default_factory=list)  # per group (None where no loss was given)
    grad_norms: list = field(default_factory=list)
    signalled: bool = False   # some rank received SIGTERM
    timed_out: bool = False   # some rank is past its time limit
    joining: list = field(default_factory=list)  # groups that healed at this quorum: they receive only
    tune_choice: Optional[SyncMode] = None  # the lowest-numbered group's --fl-tune choice, if any group chose
    tokens: list = field(default_factory=list)        # per group, since the last sync (None where not given)
    step_seconds: list = field(default_factory=list)  # per group (None where not given)
    carried_sums: Optional[list] = None  # the previous sync's metric sums over the job (None: none carried)


MODE_SLOTS = 6  # a SyncMode as numbers: precision, error feedback, overlap, fragments, interval, density
METRIC_SLOTS = 3  # a sync's metric sums: squared deviations, squares, sample count (result.metric_sums)
# each group's numbers in the vote: sick, loss, norm, healing, tokens, step time, mode, carried metric sums
GROUP_SLOTS = 6 + MODE_SLOTS + METRIC_SLOTS


def _mode_slots(mode: Optional[SyncMode]) -> list[float]:
    if mode is None:
        return [-math.inf] * MODE_SLOTS
    return [float(VALUE_CODES.index(mode.sync_dtype)), float(mode.error_feedback), float(mode.overlap_steps),
            float(mode.fragments), float(mode.sync_interval), float(mode.topk_density)]


def _slots_mode(values: list[float]) -> Optional[SyncMode]:
    if values[0] == -math.inf:
        return None
    dtype, feedback, overlap, fragments, interval = (int(v) for v in values[:5])
    return SyncMode(VALUE_CODES[dtype], overlap, fragments, interval, bool(feedback), values[5])


def any_nonfinite(shards: list[torch.Tensor]) -> bool:
    """Whether any shard holds a NaN or an infinity. One fused norm over all shards (a
    non-finite value makes its norm non-finite); only when a norm is not finite (or overflowed,
    which needs values near 1e19) the exact elementwise check runs."""
    if not shards:
        return False
    norms = torch._foreach_norm(shards)
    if bool(torch.isfinite(torch.stack(norms)).all()):
        return False
    # exact, in slices: one byte per element of a slice at a time, not of a whole shard
    return any(not bool(torch.isfinite(piece).all()) for s in shards
               for piece in s.reshape(-1).split(EXACT_CHECK_ELEMENTS))


def _slot(value: Optional[float]) -> float:
    """A figure as sent: -inf when absent (MAX takes the others'), +inf when not finite."""
    if value is None:
        return -math.inf
    return value if math.isfinite(value) else math.inf


def across_peer_group(peer_group) -> Callable:
    """The vote's reduction across groups over a peer group (one rank of every group per rank)."""
    def reduce(tensor: torch.Tensor, op, call=call_directly) -> None:
        call(dist.all_reduce, tensor, op=op, group=peer_group)
    return reduce


def _rank_sums(carried: Optional[list], federation_group) -> list[float]:
    """This rank's carried metric sums in its own slots of the in-group vector (-inf elsewhere:
    MAX gathers every rank's)."""
    slots = [-math.inf] * (METRIC_SLOTS * dist.get_world_size(federation_group))
    if carried is not None:
        at = METRIC_SLOTS * dist.get_rank(federation_group)
        slots[at:at + METRIC_SLOTS] = [_slot(v) for v in carried]
    return slots


def _added(rows: list) -> Optional[list]:
    """Rows of metric sums added up in order (the same on every rank); None without rows."""
    return [math.fsum(column) for column in zip(*rows)] if rows else None


class Ballot:
    """What one group brings to the vote of sync `step`, agreed by its ranks (the vote's in-group
    round, made by `cast`): counted either over a collective of its own (`count`) or from a
    payload that rides on the sync's first data all-reduce (`rider`, `counted_rider`)."""

    def __init__(self, step: int, mine: torch.Tensor, group: int, num_groups: int, loss_ratio: float) -> None:
        self.step, self.mine, self.group, self.num_groups, self.loss_ratio = step, mine, group, num_groups, loss_ratio

    @staticmethod
    def cast(step: int, shards: list[torch.Tensor], figures: GroupFigures, group: int, num_groups: int,
             loss_ratio: float, federation_group, device_type: str, carried: Optional[list] = None) -> "Ballot":
        """This group's ballot: a MAX over its ranks (its slowest rank's step time; every rank brings
        the same tokens) and its ranks' `carried` metric sums added up (on the device: no host sync)."""
        mine = torch.tensor([float(any_nonfinite(shards)), _slot(figures.loss), _slot(figures.grad_norm),
                             float(figures.healing), _slot(figures.tokens), _slot(figures.step_seconds),
                             *_mode_slots(figures.tune_choice), *([-math.inf] * METRIC_SLOTS),
                             float(figures.signalled), float(figures.timed_out), *_rank_sums(carried, federation_group)],
                            dtype=torch.float64, device=device_type)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=federation_group)
        ranks = mine[GROUP_SLOTS + 2:].view(-1, METRIC_SLOTS)  # every rank's carried sums, the same on each
        if ranks.numel():  # the group's: their sum where every rank brought some
            mine[GROUP_SLOTS - METRIC_SLOTS:GROUP_SLOTS] = torch.where((ranks == -math.inf).any(), -math.inf,
                                                                       ranks.sum(0))
        return Ballot(step, mine[:GROUP_SLOTS + 2], group, num_groups, loss_ratio)

    @property
    def sick_here(self) -> bool:
        """Whether this group is sick by its own figures (non-finite shards or loss): it sends nothing."""
        bad, loss = self.mine[:2].tolist()
        return bad > 0 or loss == math.inf

    def _table(self, fill: float) -> torch.Tensor:
        """The table every group fills its own slots of (one block of num_groups per figure), the
        others holding `fill`; the stop flags last."""
        g, per_group = self.num_groups, GROUP_SLOTS
        table = torch.full((per_group * g + 2,), fill, dtype=torch.float64, device=self.mine.device)
        table[[k * g + self.group for k in range(per_group)]] = self.mine[:per_group]
        table[per_group * g:] = self.mine[per_group:]
        return table

    def count(self, across, peer_call=call_directly) -> Vote:
        """The vote, over a collective of its own: `across(tensor, op, call)` takes the MAX of the
        table across the groups (-inf: another group's slot)."""
        table = self._table(-math.inf)
        across(table, dist.ReduceOp.MAX, peer_call)
        return self._counted(table.tolist())

    def rider(self) -> torch.Tensor:
        """The table as an fp32 payload for a SUM across the groups: another group's slots hold 0,
        so each slot sums to its owner's value exactly (-inf: absent, +inf: not finite); each
        value as two fp32 numbers (high part, rest), so nothing is lost of its float64."""
        table = self._table(0.0)
        high = table.float()
        rest = torch.where(torch.isfinite(high), table - high.double(), 0.0).float()
        return torch.cat([high, rest])

    def counted_rider(self, summed: torch.Tensor) -> Vote:
        """The vote from the rider summed over every group of the meeting."""
        high, rest = summed.double().chunk(2)
        return self._counted((high + rest).tolist())

    def _counted(self, values: list) -> Vote:
        num_groups = self.num_groups
        bad, losses, norms, healing, tokens, seconds, *rest = (values[k * num_groups:(k + 1) * num_groups]
                                                               for k in range(GROUP_SLOTS))
        modes, sums = rest[:MODE_SLOTS], rest[MODE_SLOTS:]
        present = [g for g in range(num_groups) if sums[0][g] != -math.inf]
        carried_sums = _added([[column[g] for column in sums] for g in present])
        chosen = (_slots_mode([m[g] for m in modes]) for g in range(num_groups))
        tune_choice = next((mode for mode in chosen if mode is not None), None)
        sick = {g for g in range(num_groups) if bad[g] > 0 or losses[g] == math.inf}
        known = {g: v for g, v in enumerate(losses) if v != -math.inf}
        if self.loss_ratio > 0:
            finite = [v for g, v in known.items() if g not in sick]
            if finite:
                best = min(finite)
                sick |= {g for g, v in known.items() if g not in sick and v > self.loss_ratio * best}
        shown = lambda v: None if v == -math.inf else v  # noqa: E731
        return Vote(self.step, sorted(sick), [shown(v) for v in losses], [shown(v) for v in norms],
                    values[-2] > 0, values[-1] > 0, [g for g in range(num_groups) if healing[g] > 0], tune_choice,
                    [None if v == -math.inf else int(v) for v in tokens], [shown(v) for v in seconds], carried_sums)


def take_vote(step: int, shards: list[torch.Tensor], figures: GroupFigures, group: int, num_groups: int,
              loss_ratio: float, federation_group, across, device_type: str, peer_call=call_directly,
              carried: Optional[list] = None) -> Vote:
    """The vote of sync `step`, in a collective of its own. Sick: a non-finite value in any shard
    of the group, a non-finite loss, or (with `loss_ratio` > 0) a loss above `loss_ratio` times
    the best group's. `across(tensor, op, call)` reduces the group's table across the groups
    (`across_peer_group`, or `ProcessGroups.reduce_across_groups`); its collective goes through
    `peer_call` (elastic mode: the sync's PeerLatch). `carried`: this rank's metric sums of the
    previous sync, to add up over the job (the vote's `carried_sums`; None where every rank
    brings none)."""
    ballot = Ballot.cast(step, shards, figures, group, num_groups, loss_ratio, federation_group, device_type,
                         carried)
    return ballot.count(across, peer_call)


@dataclass(frozen=True)
class Senders:
    """Who sends at a sync, from its vote: sick and healing groups send nothing and receive the
    average of the others."""

    sick: tuple               # groups left out as sick
    include: bool             # whether this rank's group sends
    contributors: Optional[int]  # groups that send, or None when every group of the meeting does
    weight: Optional[float] = None  # this group's weight in the mean (its tokens over the senders' mean); None: 1 each

    @staticmethod
    def of(vote: Vote, members: tuple, group: int, vote_failed: bool = False) -> "Senders":
        """From `vote` over the meeting's groups `members`, for `group`. AllGroupsSick when nobody
        is left to send, unless the vote itself failed (elastic: a lost peer; it knows nothing)."""
        left_out = set(vote.sick) | set(vote.joining)
        contributors = sum(g not in left_out for g in members)
        if contributors == 0 and not vote_failed:
            raise AllGroupsSick(f"every federation group is sick at step {vote.step} (non-finite shards or a "
                                "diverged loss): nothing is left to average; stopping without saving")
        include = group not in left_out
        weight = token_weight(vote.tokens, [g for g in members if g not in left_out], group) if include else None
        return Senders(tuple(vote.sick), include, contributors if contributors != len(members) else None, weight)


def token_weight(tokens: list, senders: list, group: int) -> Optional[float]:
    """`group`'s weight in a mean over `senders` weighted by the tokens each trained since the last
    sync: its tokens over the senders' mean, so that the weights sum to the number of senders and
    the mean stays a sum divided by that number. None (every weight 1: the plain mean, bit for
    bit) where the senders' tokens are equal or not given."""
    counts = [tokens[g] if g < len(tokens) else None for g in senders]
    if not counts or any(c is None for c in counts) or len(set(counts)) == 1:
        return None
    return tokens[group] * len(counts) / sum(counts)
