"""Which federation groups are sick at a sync: decided together, before any data moves."""

import math
from typing import Optional

import torch
import torch.distributed as dist


class AllGroupsSick(RuntimeError):
    """Every group is sick: there is nothing to average (the run stops; no checkpoint is written)."""


def sick_groups(shards: list[torch.Tensor], loss: Optional[float], group: int, num_groups: int,
                loss_ratio: float, device_type: str) -> list[int]:
    """Groups with a non-finite value in any rank's shards, or (with `loss_ratio` > 0) whose
    largest rank loss exceeds `loss_ratio` times the best group's. Collective over all ranks:
    one all-reduce (MAX) of 2 x F numbers."""
    flags = torch.zeros(2 * num_groups, dtype=torch.float64, device=device_type)
    if shards:  # one device-side reduction, read once with the all-reduced flags
        flags[group] = (~torch.stack([torch.isfinite(s).all() for s in shards]).all()).to(flags.dtype)
    if loss is not None:
        flags[num_groups + group] = loss if math.isfinite(loss) else math.inf
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    bad, losses = flags[:num_groups].tolist(), flags[num_groups:].tolist()
    sick = {g for g in range(num_groups) if bad[g] > 0 or math.isinf(losses[g]) or math.isnan(losses[g])}
    if loss is not None and loss_ratio > 0:
        finite = [v for g, v in enumerate(losses) if g not in sick]
        if finite:
            best = min(finite)
            sick |= {g for g, v in enumerate(losses) if g not in sick and v > loss_ratio * best}
    return sorted(sick)
