"""A sync in flight (--fl-overlap-steps K): the exchange runs in a background thread while the
group trains K more steps, then lands.

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

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch


@dataclass
class InFlight:
    """A launched sync: what to wait for and what landing needs."""

    step: int
    due: int
    future: Future            # -> SyncStats of the background average
    averaged: list            # the copies being averaged (become the mean pseudo-gradients)
    own: list                 # this rank's pseudo-gradients at launch
    include: bool
    contributors: object
    sick: tuple
    consensus: object = None  # DBench metrics measured at launch
    fragment: int = 0         # the fragment in flight (--fl-fragments)


class Overlapper:
    """Launches averages in one background thread and merges them when they land."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fl-sync")

    @torch.no_grad()
    def launch(self, average, outer, shards: list, **fields) -> InFlight:
        """Start averaging the pseudo-gradients (anchor - shard) across groups with `average(buffers)`."""
        own = [s.clone() for s in shards]
        outer.to_pseudo_gradients(own)
        averaged = [o.clone() for o in own]
        return InFlight(future=self.pool.submit(average, averaged), averaged=averaged, own=own, **fields)

    @staticmethod
    @torch.no_grad()
    def land(flight: InFlight, outer, shards: list) -> None:
        """Step the outer optimizer with the averaged pseudo-gradients and merge: shard <- shard
        + own - old anchor + new anchor (a left-out group takes the new anchor)."""
        if flight.include:
            for shard, own, anchor in zip(shards, flight.own, outer.anchors):
                shard.add_(own).sub_(anchor)
        outer.step(flight.averaged)  # the buffers now hold the new anchors
        for shard, new in zip(shards, flight.averaged):
            if flight.include:
                shard.add_(new)
            else:
                shard.copy_(new)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
