"""A blocking sync whose vote rides on its data: one latency-bound round across the groups, the
data's own (docs/architecture.md, "A sync"). The vote's in-group round tells each group whether it
is sick by its own figures; a sick group sends zeros from the start, so none of its values reaches
the sum. Every bucket is a SUM divided by the senders the rider counts when the first bucket
lands (where every group sent, the division the exact path's AVG makes). A sick group found
there makes every group average the other fragments too (the sick one is reset whole)."""

import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..config.parallel import FederationConfig
from .ada import Choice
from .averaging import Peers
from .contract import ShardOwner
from .exchange import Exchanged, average_fragments
from .inner_state import settle_inner_state
from .rider import Rider
from .sync_state import SyncState
from .vote import Ballot, GroupFigures, Senders, Vote


def vote_can_ride(config: FederationConfig, state: SyncState, equal_groups: bool,
                  figures: Optional[GroupFigures], shards: list) -> bool:
    """Whether a one-world sync's vote can ride on its first data all-reduce: a plain fp32 average
    of whole, equal groups, whose senders each group knows from its own figures (no loss ratio
    against the others, no tokens to weigh, no gossip, no consensus measured first). Every input
    is the same on every rank of the job (the settings; tokens are given by every group or none),
    so every rank takes the same path."""
    if (not equal_groups or config.topology != "complete" or config.measures_consensus
            or config.sick_loss_ratio > 0 or (figures is not None and figures.tokens is not None)):
        return False
    views = state.views(shards)
    return all(averager.can_carry(view) for averager, view in zip(state.averagers, views))


@torch.no_grad()
def exchange_with_the_vote(state: SyncState, backend: ShardOwner, shards: list, ballot: Ballot,
                           first: tuple, members: tuple, group: int, peers: Peers,
                           keep_inner_state: Callable[[], None] = lambda: None) -> tuple[Exchanged, Vote, float]:
    """Average the fragments `first` (all, or the one due) with the ballot riding on the first
    one's first bucket, then every other fragment if a group turned out sick; then the inner
    state. Returns what was done, the vote counted from the rider and when it landed (the host
    clock: where this group stopped waiting for the slower ones). AllGroupsSick (after the data
    moved: every group sent zeros) when no group was healthy."""
    include = not ballot.sick_here
    counted: dict = {}

    def landed(summed: torch.Tensor) -> int:
        vote = ballot.counted_rider(summed)
        senders = Senders.of(vote, members, group, vote_failed=True)  # an all-sick vote raises below
        if senders.include != include:
            raise RuntimeError(f"the vote of step {ballot.step} counted group {group} as "
                               f"{'sick' if include else 'healthy'} against its own ballot")
        counted.update(vote=vote, senders=senders, at=time.perf_counter())
        # the ranks of the SUM where every group sent; no sender at all: the zeros stay zeros
        return senders.contributors or dist.get_world_size(peers.group)

    views = state.views(shards)
    fragment = first[0]
    outer = state.outer(fragment)
    if outer is not None:
        outer.to_pseudo_gradients(views[fragment])
    stats = state.averagers[fragment].average(views[fragment], include, peers=peers,
                                              rider=Rider(ballot.rider(), landed))
    vote = counted["vote"]
    senders = Senders.of(vote, members, group)  # AllGroupsSick where nobody was left to send
    if outer is not None:
        outer.step(views[fragment])
    moved = tuple(range(state.fragments)) if senders.sick else first
    stats.merge(average_fragments(state, views, tuple(f for f in moved if f != fragment), senders, peers))
    settle_inner_state(state.settings.inner_state, backend, state, stats, senders, peers,
                       group in senders.sick, moved[0] if len(moved) == 1 else None, keep_inner_state)
    return Exchanged(stats, senders.sick, None, Choice("complete"), moved, shards), vote, counted["at"]
