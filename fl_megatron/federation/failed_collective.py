"""Telling a failed collective (a peer died, or hung past the timeout) from any other error."""

import torch.distributed as dist

from ..error_text import one_line

# Words of gloo's and NCCL's errors for a lost peer: a closed connection, a timeout, an aborted
# communicator (they raise plain RuntimeErrors for some, DistBackendError for others). Not the
# bare word "NCCL": ncclInvalidUsage, a version mismatch or an out-of-memory in NCCL's buffers
# are errors of this rank, to be reported as they are, not as a dead peer.
_WORDS = ("gloo", "Gloo", "Connection", "connection", "timed out", "Timed out", "Broken pipe",
          "ncclRemoteError", "remote process exited", "ncclSystemError", "communicator was aborted",
          "Watchdog caught collective operation timeout")


def is_failed_collective(err: BaseException) -> bool:
    if isinstance(err, dist.DistError):
        return True
    text = one_line(err)
    return isinstance(err, RuntimeError) and any(word in text for word in _WORDS)


def call_directly(fn, *args, **kwargs):
    """A peer collective as it is: a failure raises (one world, where a lost rank ends the job)."""
    return fn(*args, **kwargs)


class PeerLatch:
    """The peer collectives of one sync that the groups may vote down (elastic mode). The first
    that fails (a peer lost) is remembered in `error` and every later one of the sync is skipped
    (returns None), as torchft's managed group does after an error, whatever its kind: all-reduce,
    all-to-all, all-gather or point-to-point. The in-group collectives are never routed here, so
    every rank of a group makes the same in-group calls whatever happened to its peers, and the
    group can agree afterwards that the sync failed."""

    def __init__(self) -> None:
        self.error = None

    def __call__(self, fn, *args, **kwargs):
        if self.error is not None:
            return None
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:  # DistError is one
            if not is_failed_collective(e):
                raise
            self.error = e
            return None


def has_failed(call) -> bool:
    """Whether a sync's peer calls went through a PeerLatch that caught a failure."""
    return getattr(call, "error", None) is not None
