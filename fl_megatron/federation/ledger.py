"""Counting the payload bytes a run's collectives send, by scope and by network tier.

Payload bytes of one collective on one rank = the bytes of the data this rank hands to it:
the tensor of an all-reduce, the input shard of an all-gather, the full input of a
reduce-scatter. (Bytes on the wire depend on the algorithm; `fl_megatron.costs` has the
ring formulas.) Scalars for logging and metrics are not counted.
"""

from collections import Counter
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from ..costs import SCOPES, TIERS


class CommLedger:
    """Cumulative payload bytes of one rank, split by scope and by tier."""

    def __init__(self) -> None:
        self.by_scope = Counter({scope: 0 for scope in SCOPES})
        self.by_tier = Counter({tier: 0 for tier in TIERS})

    def add(self, scope: str, tier: str, nbytes: int) -> None:
        if scope not in SCOPES or tier not in TIERS:
            raise ValueError(f"unknown scope {scope!r} or tier {tier!r}")
        self.by_scope[scope] += int(nbytes)
        self.by_tier[tier] += int(nbytes)

    def state_tensor(self) -> torch.Tensor:
        """The totals as saved in a checkpoint (int64: scopes, then tiers)."""
        return torch.tensor([self.by_scope[s] for s in SCOPES] + [self.by_tier[t] for t in TIERS], dtype=torch.int64)

    def load_state_tensor(self, state: torch.Tensor) -> None:
        """Continue from saved totals (a resumed run's counters stay cumulative)."""
        values = [int(v) for v in state.tolist()]
        self.by_scope = Counter(dict(zip(SCOPES, values[:len(SCOPES)])))
        self.by_tier = Counter(dict(zip(TIERS, values[len(SCOPES):])))

    def snapshot(self) -> dict:
        """Plain dict of the totals so far."""
        return {"intra_group_bytes": self.by_scope["intra-group"],
                "inter_group_bytes": self.by_scope["inter-group"],
                "intra_node_bytes": self.by_tier["intra-node"],
                "inter_node_bytes": self.by_tier["inter-node"]}


def _tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(o) for o in obj)
    return 0


# c10d operator -> index of the argument holding this rank's payload.
_PAYLOAD_ARG = {
    "allreduce_": 0, "allreduce_coalesced_": 0, "broadcast_": 0, "reduce_": 0,
    "_allgather_base_": 1, "allgather_": 1, "allgather_into_tensor_coalesced_": 1,
    "allgather_coalesced_": 1, "_reduce_scatter_base_": 1, "reduce_scatter_": 1,
    "reduce_scatter_tensor_coalesced_": 1, "alltoall_": 1, "alltoall_base_": 1,
    # functional collectives (DTensor reductions, e.g. a gradient norm): the input comes first
    "all_reduce": 0, "all_reduce_coalesced": 0, "all_gather_into_tensor": 0,
    "all_gather_into_tensor_coalesced": 0, "reduce_scatter_tensor": 0,
    "reduce_scatter_tensor_coalesced": 0, "broadcast": 0, "all_to_all_single": 0,
    # point to point (gossip, a heal's atoms): the tensors sent or received
    "send": 0, "recv_": 0, "recv_any_source_": 0,
}
_NAMESPACES = ("c10d", "_c10d_functional")
# functional-collective helpers that move nothing between ranks
_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")


def collective_ranks(args) -> Optional[tuple]:
    """The global ranks of the process group a c10d operator's arguments name (a boxed
    ProcessGroup, or a functional collective's group name), or None if none is found."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    for arg in args:
        try:
            if isinstance(arg, torch.ScriptObject):
                return tuple(dist.get_process_group_ranks(dist.ProcessGroup.unbox(arg)))
            if isinstance(arg, str):
                return tuple(dist.get_process_group_ranks(_resolve_process_group(arg)))
        except (RuntimeError, ValueError, KeyError):
            continue  # another boxed object (a ReduceOp) or a string that names no group (a reduce op)
    return None


class CollectiveCounter(TorchDispatchMode):
    """Counts the c10d collectives issued while active: calls and payload bytes per operator.
    `on_collective(name, ranks, nbytes)`, if given, also hears of each one with the global ranks of
    its process group and this rank's payload bytes (tests that check which ranks meet, and which
    of their collectives are latency-bound).

    Every op of the step passes through Python while it is active, so use it to measure a
    step once (calibration) or in tests, not on every step. Only the thread that entered it is
    seen (dispatch modes are per thread).
    """

    def __init__(self, on_collective: Optional[Callable[[str, Optional[tuple], int], None]] = None) -> None:
        super().__init__()
        self.calls: Counter = Counter()
        self.payload: Counter = Counter()
        self.on_collective = on_collective

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(func, "namespace", "") in _NAMESPACES:
            name = func._schema.name.split("::")[-1]
            self.calls[name] += 1
            index = _PAYLOAD_ARG.get(name)
            nbytes = _tensor_bytes(args[index]) if index is not None and index < len(args) else 0
            self.payload[name] += nbytes
            if self.on_collective is not None and name not in _NOT_COLLECTIVES:
                self.on_collective(name, collective_ranks(args), nbytes)
        return func(*args, **(kwargs or {}))

    @property
    def total_bytes(self) -> int:
        return sum(self.payload.values())
