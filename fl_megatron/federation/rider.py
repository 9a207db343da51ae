"""A few numbers that travel with an average's data instead of in a round of their own: inside a
packed bucket's buffer (after the data), or beside a bucket that is summed in place, in an
all-reduce that progresses together with it (NCCL: one group launch; gloo: its worker threads run
the two concurrently). Either way the network's latency is paid once."""

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist


@dataclass
class Rider:
    """A small fp32 payload summed over the peers with an average's first bucket, and what to do
    when it lands: `landed(summed)` returns how many groups sent, known only then (every bucket
    is corrected where not all did)."""

    payload: torch.Tensor
    landed: Callable[[torch.Tensor], int]


class _Both:
    """Two collectives in flight, waited for as one."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True


def sum_together(data: torch.Tensor, payload: torch.Tensor, group) -> object:
    """SUM-all-reduce `data` and `payload` over `group` in place, issued together; returns what
    to wait on. On NCCL they are coalesced into one group launch (the payload's latency hides in
    the data's); elsewhere both are issued asynchronously back to back."""
    op = dist.ReduceOp.SUM
    if dist.get_backend(group) == "nccl":
        with dist._coalescing_manager(group=group, device=data.device, async_ops=True) as together:
            dist.all_reduce(data, op=op, group=group)
            dist.all_reduce(payload, op=op, group=group)
        return together
    return _Both([dist.all_reduce(t, op=op, group=group, async_op=True) for t in (data, payload)])
