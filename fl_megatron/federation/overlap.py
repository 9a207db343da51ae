"""The background thread an overlapped sync's exchange runs in (and the tuner's trial exchange).

It has communicators of its own (ProcessGroups.exchange_peer / exchange_replica): the training
thread's collectives and the exchange's never share one, so their order on each communicator is
the same on every rank. On CUDA the thread works on the rank's own device and on a stream of its
own: it starts after the training stream's work so far (an event), and training waits for it only
when the result is taken, so the exchange overlaps compute.
"""

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch


class Overlapper:
    """Runs work on buffers in one background thread. `threaded` False runs it at submission
    instead (the same arithmetic in the same order: the reference the threaded path is tested against)."""

    def __init__(self, threaded: bool = True) -> None:
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fl-sync") if threaded else None
        self.stream: Optional["torch.cuda.Stream"] = None  # the exchange's CUDA stream, made at first use

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

    def _on_stream(self, work, buffers: list, device: torch.device, ready):
        """The work in the thread: the rank's device (a thread starts on cuda:0), its own stream."""
        with torch.cuda.device(device), torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            return work(buffers)

    def result(self, future: Future, buffers: list):
        """The work's result; on CUDA the training stream then waits for the exchange's."""
        value = future.result()
        if self.stream is not None and buffers and buffers[0].is_cuda:
            torch.cuda.current_stream(buffers[0].device).wait_stream(self.stream)
        return value

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
