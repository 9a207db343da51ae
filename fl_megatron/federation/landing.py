"""An overlapped sync (--fl-overlap-steps K): launched at a sync step, its exchange runs in the
background thread while the group trains K more steps, then it lands.

At launch step t every rank keeps two fp32 shard-sized buffers: its own pseudo-gradient
d = anchor - x_t (kept) and a copy that the background thread averages across groups. At
landing (step t + K) the outer optimizer steps the anchors with the average, and every rank
keeps its own progress since the launch on top of the new anchor:

    x <- x_{t+K} - x_t + anchor_new,   where x_t = anchor_old - d

This is the delayed variant: the outer update is the one computed from the state at t, applied
K steps later, with no local estimate of it (the "eager" variant's proxy). We chose it because
it needs no extra outer computation per step and keeps each group's steps since t intact. A
group found sick at launch discards its own progress and takes the new anchor.
"""

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .averaging import Peers, ShardAverager, SyncStats
from .consensus import Consensus
from .membership import Membership
from .outer import OuterOptimizer
from .overlap import Overlapper
from .vote import Senders


@dataclass
class InFlight:
    """A launched sync: what to wait for and what landing needs."""

    step: int
    due: int
    future: Future            # -> SyncStats of the background average
    averaged: list            # the copies being averaged (become the mean pseudo-gradients)
    own: list                 # this rank's pseudo-gradients at launch
    senders: Senders
    peers: Peers
    consensus: Optional[Consensus] = None  # DBench metrics measured at launch
    fragment: int = 0         # the fragment in flight (--fl-fragments)
    membership: Optional[Membership] = None  # the groups that met at launch
    transaction: object = None  # how it ends at landing (transaction.py): commit, or a rollback
    carried: object = None      # the previous sync's metrics, which the launch's vote carried (result.Carried)


class OverlappedSyncs:
    """Launches syncs into the background thread and lands them; at most one is in flight."""

    def __init__(self, overlapper: Optional[Overlapper] = None) -> None:
        self.overlapper = overlapper
        self.flight: Optional[InFlight] = None

    def thread(self) -> Overlapper:
        """The background thread (made at first use)."""
        if self.overlapper is None:
            self.overlapper = Overlapper()
        return self.overlapper

    @torch.no_grad()
    def launch(self, step: int, due: int, averager: ShardAverager, outer: OuterOptimizer, shards: list,
               senders: Senders, peers: Peers, consensus: Optional[Consensus], fragment: int,
               membership: Optional[Membership] = None, transaction=None,
               before_exchange: Callable[[], None] = lambda: None, carried=None) -> None:
        """Start averaging the pseudo-gradients (anchor - shard) of `shards` across groups; it lands
        at step `due`. `membership`, `transaction`: who met at launch and how the sync ends (both
        kept for the landing). `before_exchange` runs in the thread first (a test's slowed link)."""
        if self.flight is not None:
            raise RuntimeError(f"an overlapped sync of step {self.flight.step} is still in flight")
        own = [s.clone() for s in shards]
        outer.to_pseudo_gradients(own)
        averaged = [o.clone() for o in own]

        def average(buffers: list) -> SyncStats:
            began = time.perf_counter()
            before_exchange()
            stats = averager.average(buffers, senders.include, senders.contributors, peers=peers,
                                     weight=senders.weight)
            stats.exchange_seconds = time.perf_counter() - began
            return stats

        self.flight = InFlight(step, due, self.thread().submit(average, averaged), averaged, own, senders, peers,
                               consensus, fragment, membership, transaction, carried)

    @torch.no_grad()
    def land(self, outer: OuterOptimizer, shards: list,
             before_merge: Callable[[], None] = lambda: None) -> tuple[InFlight, SyncStats]:
        """Wait for the sync in flight and merge it into `shards` (its fragment): step the outer
        optimizer with the averaged pseudo-gradients, then shard <- shard + own - old anchor + new
        anchor (a left-out group takes the new anchor). `before_merge`: called once the exchange
        is done, before anything changes (a sync that may be voted down keeps the shards)."""
        flight, self.flight = self.flight, None
        stats = self.overlapper.result(flight.future, flight.averaged)
        before_merge()
        include = flight.senders.include
        if include:
            for shard, own, anchor in zip(shards, flight.own, outer.anchors):
                shard.add_(own).sub_(anchor)
        outer.step(flight.averaged)  # the buffers now hold the new anchors
        for shard, new in zip(shards, flight.averaged):
            if include:
                shard.add_(new)
            else:
                shard.copy_(new)
        return flight, stats

    def close(self) -> None:
        """Wait for a sync still in flight (its result is dropped: the run is ending) and stop the thread."""
        if self.overlapper is not None:
            if self.flight is not None:
                self.overlapper.result(self.flight.future, self.flight.averaged)
                self.flight = None
            self.overlapper.close()
