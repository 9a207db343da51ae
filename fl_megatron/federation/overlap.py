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

The thread has communicators of its own (ProcessGroups.exchange_peer / exchange_replica): the
training thread's collectives and the exchange's never share one, so their order on each
communicator is the same on every rank. On CUDA the thread works on the rank's own device and
on a stream of its own: it starts after the launch's copies (an event on the training stream)
and training waits for it only at landing, so the exchange overlaps compute.
"""

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

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
    """Launches averages in one background thread and merges them when they land. `threaded`
    False runs each average at its launch instead (the same arithmetic in the same order: the
    reference the threaded path is tested against)."""

    def __init__(self, threaded: bool = True) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fl-sync") if threaded else None
        self.stream: Optional["torch.cuda.Stream"] = None  # the exchange's CUDA stream, made at first use

    @torch.no_grad()
    def launch(self, average, outer, shards: list, **fields) -> InFlight:
        """Start averaging the pseudo-gradients (anchor - shard) across groups with `average(buffers)`."""
        own = [s.clone() for s in shards]
        outer.to_pseudo_gradients(own)
        averaged = [o.clone() for o in own]
        return InFlight(future=self.submit(average, averaged), averaged=averaged, own=own, **fields)

    def submit(self, work, buffers: list) -> Future:
        """Run `work(buffers)` in the exchange's thread (at once when not threaded); on CUDA on the
        buffers' device and the exchange's own stream, after the training stream's work so far."""
        device = buffers[0].device if buffers else torch.device("cpu")
        if self.pool is None:
            future: Future = Future()
            future.set_result(work(buffers))
            return future
        if device.type != "cuda":
            return self.pool.submit(work, buffers)
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=device)
        ready = torch.cuda.current_stream(device).record_event()  # the buffers' copies are done
        return self.pool.submit(self._on_stream, work, buffers, device, ready)

    def _on_stream(self, average, averaged: list, device: torch.device, ready):
        """The exchange in the thread: the rank's device (a thread starts on cuda:0), its own stream."""
        with torch.cuda.device(device), torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            return average(averaged)

    def wait(self, flight: InFlight):
        """The landed average's statistics; on CUDA the training stream then waits for the exchange's."""
        stats = flight.future.result()
        if self.stream is not None and flight.averaged and flight.averaged[0].is_cuda:
            torch.cuda.current_stream(flight.averaged[0].device).wait_stream(self.stream)
        return stats

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
        if self.pool is not None:
            self.pool.shutdown(wait=True)
