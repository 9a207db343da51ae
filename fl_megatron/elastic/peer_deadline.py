"""A time bound on each cross-group collective of an elastic sync, on NCCL.

NCCL does not raise when a peer is lost or hangs: the host blocks at its next read of a result
until torch's watchdog fires, and under TORCH_NCCL_ASYNC_ERROR_HANDLING=1 the watchdog kills the
process (and with it the group the sync was meant to spare). torchft's own wrapper bounds its
collectives with its timer thread and aborts the communicator when one outlives the timeout; the
engine calls the quorum's raw communicator, so each of its cross-group calls is bounded here the
same way, with torchft's timers: while the host waits in the call, and, on CUDA, until the stream
has finished what the call queued. An abort unblocks the call (it then raises or returns
garbage); the sync's PeerLatch then treats it as a failed collective, skips the rest of the sync,
and the group votes the sync down. gloo needs none of this: its communicator times out by itself
(the tier builds it with the same timeout) and raises.
"""

import logging
import sys
from contextlib import contextmanager
from datetime import timedelta
from typing import Callable, Iterator, Optional

logger = logging.getLogger(__name__)


class PeerDeadline:
    """Bounds calls by `timeout`; when one outlives it, `abort` runs once (on torchft's timer
    thread) and `expired` is set. `on_stream`: also bound the work a call queued on the current
    CUDA stream. One per sync: a communicator aborted once stays aborted until the next quorum."""

    def __init__(self, timeout: timedelta, abort: Callable[[], None], on_stream: bool,
                 context_timeout: Callable, stream_timeout: Optional[Callable] = None) -> None:
        self.timeout, self._abort, self.on_stream = timeout, abort, on_stream
        self._context_timeout, self._stream_timeout = context_timeout, stream_timeout
        self.expired = False

    def _fire(self) -> None:
        if self.expired:
            return
        self.expired = True  # read by the training thread once the aborted call returns or raises
        message = (f"fl-megatron: a cross-group collective of this sync took over {self.timeout.total_seconds():g} s "
                   f"(--fl-peer-timeout-seconds): aborting the quorum's communicator; the sync will be voted down")
        logger.error(message)
        print(message, file=sys.stderr, flush=True)
        self._abort()

    def error(self) -> TimeoutError:
        return TimeoutError(f"a cross-group collective outlived --fl-peer-timeout-seconds "
                            f"{self.timeout.total_seconds():g}: a peer hung or was lost (communicator aborted)")

    @contextmanager
    def bound(self) -> Iterator[None]:
        """Run one cross-group call inside the bound."""
        with self._context_timeout(self._fire, self.timeout):
            yield
        if self.on_stream and self._stream_timeout is not None:
            self._stream_timeout(self._fire, self.timeout)

    def settle(self) -> None:
        """Wait, within the bound, until the stream has finished the sync's cross-group work (or
        the abort ended it): after this, `expired` says whether any of it outlived the bound."""
        if self.on_stream:
            import torch
            with self._context_timeout(self._fire, self.timeout):
                torch.cuda.current_stream().synchronize()


def torchft_deadline(pg_wrapper, timeout: timedelta, backend: str) -> Optional[PeerDeadline]:
    """The bound of one sync on torchft's quorum communicator `pg_wrapper` (NCCL; None on gloo,
    whose communicator times out by itself)."""
    if backend != "nccl":
        return None
    from torchft.futures import context_timeout, stream_timeout
    return PeerDeadline(timeout, pg_wrapper.abort, True, context_timeout, stream_timeout)
