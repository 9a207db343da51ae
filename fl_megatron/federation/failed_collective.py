"""Telling a failed collective (a peer died, or hung past the timeout) from any other error."""

from typing import Optional

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
    group can agree afterwards that the sync failed.

    `deadline` (NCCL, where a lost or hung peer never raises): each call runs inside its
    `bound()`; a call that outlives it has the communicator aborted under it and counts as failed,
    whatever it then returned or raised (elastic/peer_deadline.py)."""

    def __init__(self, deadline=None) -> None:
        self._error = None
        self.deadline = deadline

    @property
    def error(self) -> Optional[BaseException]:
        """The sync's first failure: a call that raised for a lost peer, or the deadline's abort."""
        if self._error is None and self.deadline is not None and self.deadline.expired:
            self._error = self.deadline.error()
        return self._error

    def __call__(self, fn, *args, **kwargs):
        if self.error is not None:
            return None
        try:
            if self.deadline is None:
                return fn(*args, **kwargs)
            with self.deadline.bound():
                result = fn(*args, **kwargs)
        except RuntimeError as e:  # DistError is one
            if self.error is not None:  # the deadline aborted the call: whatever it raised, the peer is gone
                return None
            if not is_failed_collective(e):
                raise
            self._error = e
            return None
        return None if self.error is not None else result

    def settle(self) -> Optional[BaseException]:
        """The sync's failure, if any, once its cross-group work has finished or been aborted
        (on CUDA the calls return before their kernels end): call before the group agrees."""
        if self.error is None and self.deadline is not None:
            self.deadline.settle()
        return self.error


def has_failed(call) -> bool:
    """Whether a sync's peer calls went through a PeerLatch that caught a failure."""
    return getattr(call, "error", None) is not None
