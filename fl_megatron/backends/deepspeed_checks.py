"""DeepSpeed's ZeRO-3 sanity checks, kept inside the federation group.

While ZeRO-3 records its module trace (the first steps, and again whenever the order of
submodules changes) it checks that every rank recorded the same order, by broadcasting lists
of ids from global rank 0 over the whole world (`assert_ints_same_as_other_ranks`). In a
federated run that is a collective across every group at every such step. `within_group`
swaps in the same check over the ZeRO group (from its first rank) for the duration of a
forward or backward: the ranks that must agree are the group's, and no other group waits.
"""

from contextlib import contextmanager

import torch
import torch.distributed as dist

# the modules that imported the check by name (DeepSpeed 0.19.8)
_USERS = ("deepspeed.runtime.zero.partitioned_param_coordinator", "deepspeed.runtime.zero.stage3",
          "deepspeed.runtime.zero.partition_parameters")
_NAME = "assert_ints_same_as_other_ranks"


def _same_in_group(group, device: torch.device):
    def check(ints: list) -> None:
        """RuntimeError unless every rank of `group` holds the same list as its first rank."""
        size = torch.tensor([len(ints)], dtype=torch.int64, device=device)
        dist.broadcast(size, group_src=0, group=group)
        first = torch.tensor(ints if dist.get_rank(group) == 0 else [-1] * int(size), dtype=torch.int64,
                             device=device)
        if int(size) != len(ints):
            raise RuntimeError(f"ZeRO-3 trace: group rank 0 recorded {int(size)} entries, global rank "
                               f"{dist.get_rank()} recorded {len(ints)}")
        dist.broadcast(first, group_src=0, group=group)
        if first.tolist() != list(ints):
            raise RuntimeError(f"ZeRO-3 trace: global rank {dist.get_rank()} disagrees with its group's first rank "
                               f"on the order of {len(ints)} entries")
    return check


@contextmanager
def within_group(group, device: torch.device):
    """Run DeepSpeed with its trace checks over `group` instead of the world."""
    import importlib

    modules = [importlib.import_module(name) for name in _USERS]
    saved = [getattr(m, _NAME, None) for m in modules]
    check = _same_in_group(group, device)
    for m in modules:
        if hasattr(m, _NAME):
            setattr(m, _NAME, check)
    try:
        yield
    finally:
        for m, original in zip(modules, saved):
            if original is not None:
                setattr(m, _NAME, original)
