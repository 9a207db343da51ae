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
