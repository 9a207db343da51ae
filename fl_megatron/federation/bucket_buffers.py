"""The packed bucket buffers of an average, kept between syncs on CPU.

A fresh CPU buffer of a bucket's size (32 MiB by default) is memory the allocator maps anew, and
every page of it faults in on first touch: per sync that is a pass over the bytes on top of the
packing itself. So on CPU the averager takes its buffers from here and gives them back when a
bucket is done; a sync keeps at most MAX_PACKED_IN_FLIGHT of them alive, and no more stay here.
On CUDA the caching allocator already keeps freed blocks, with the stream bookkeeping a buffer
handed between an overlapped sync's side stream and the default stream needs, so there a buffer
is allocated as before and nothing is kept."""

import threading

import torch


class BucketBuffers:
    """Free buffers by dtype and device (CPU only), at most `keep` of them; thread-safe (an
    overlapped sync packs in its own thread)."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, like: torch.Tensor, numel: int) -> torch.Tensor:
        """A buffer of `numel` elements of `like`'s dtype and device, its contents undefined."""
        if like.device.type == "cpu":
            with self._lock:
                for i, buffer in enumerate(self._free):
                    if buffer.dtype == like.dtype and buffer.numel() >= numel:
                        return self._free.pop(i).narrow(0, 0, numel)
        return like.new_empty(numel)

    def give_back(self, buffer: torch.Tensor) -> None:
        """A buffer `take` gave and nothing reads or writes any more (its collective waited for)."""
        if buffer.device.type != "cpu":
            return
        whole = buffer if buffer._base is None else buffer._base
        with self._lock:
            self._free.append(whole)
            self._free.sort(key=torch.Tensor.numel)
            if len(self._free) > self.keep:  # the largest stay
                del self._free[:len(self._free) - self.keep]
