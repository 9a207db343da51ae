"""The exchange of a blocking sync: the shards (or some fragments of them) averaged over the peer
group, through each fragment's outer optimizer, or mixed along a gossip round, then the inner
optimizer's state as --fl-inner-state says. Everything it needs is passed in: who sends, over
which peers, which graph; it changes only the shards and the sync state, in place."""

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .ada import Choice
from .averaging import Peers, SyncStats
from .consensus import Consensus
from .contract import ShardOwner
from .graphs import gossip_round
from .inner_state import settle_inner_state
from .sync_state import SyncState
from .vote import Senders


@dataclass(frozen=True)
class ExchangeContext:
    """One sync's exchange as every rank of the job agreed it before any data moved."""

    step: int
    senders: Senders
    peers: Peers
    choice: Choice
    fragments: tuple        # the fragments a complete average moves (all, or the one due)
    group: int              # this rank's federation group
    num_groups: int         # the federation's group slots (a gossip round's graph)
    keep_inner_state: Callable[[], None] = lambda: None  # before the inner moments change (a rollback's copy)


@dataclass
class Exchanged:
    """What a sync's exchange did on this rank, before the refresh and the metrics."""

    stats: SyncStats
    sick: tuple
    consensus: Optional[Consensus]
    choice: Choice
    moved: tuple            # the fragments averaged (empty: a gossip round or no exchange)
    shards: list


def average_fragments(state: SyncState, views: list, fragments: tuple, senders: Senders,
                      peers: Peers) -> SyncStats:
    """Each fragment in `fragments`: pseudo-gradients (with an outer optimizer), their average
    over the peers, the outer step; plain FedAvg averages the shards themselves."""
    stats = SyncStats()
    for fragment in fragments:
        outer = state.outer(fragment)
        if outer is not None:
            outer.to_pseudo_gradients(views[fragment])
        stats.merge(state.averagers[fragment].average(views[fragment], senders.include, senders.contributors,
                                                      peers=peers, weight=senders.weight))
        if outer is not None:
            outer.step(views[fragment])
    return stats


@torch.no_grad()
def exchange(state: SyncState, backend: ShardOwner, shards: list, context: ExchangeContext,
             consensus: Optional[Consensus]) -> Exchanged:
    """The exchange of one sync on this rank's `shards` (in place), then the inner state."""
    choice, senders = context.choice, context.senders
    moved: tuple = ()
    if choice.graph == "complete":
        moved = context.fragments
        stats = average_fragments(state, state.views(shards), moved, senders, context.peers)
    elif choice.graph == "none":
        stats = SyncStats()
    else:
        mixing = gossip_round(choice.graph, context.num_groups, context.group, choice.round_index)
        stats = state.averagers[0].average(shards, mixing=mixing, peers=context.peers)
    settle_inner_state(state.settings.inner_state, backend, state, stats, senders, context.peers,
                       context.group in senders.sick, moved[0] if len(moved) == 1 else None, context.keep_inner_state)
    return Exchanged(stats, senders.sick, consensus, choice, moved, shards)
