"""Telling a failed collective (a peer died, or hung past the timeout) from any other error."""

import torch.distributed as dist

from ..error_text import one_line

# Words of gloo's and NCCL's errors for a closed connection or a timeout (they raise plain
# RuntimeErrors for some of them, DistBackendError for others).
_WORDS = ("gloo", "Gloo", "NCCL", "Connection", "connection", "timed out", "Timed out", "Broken pipe")


def is_failed_collective(err: BaseException) -> bool:
    if isinstance(err, dist.DistError):
        return True
    text = one_line(err)
    return isinstance(err, RuntimeError) and any(word in text for word in _WORDS)
