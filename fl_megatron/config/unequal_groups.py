"""What a federation of groups of unequal size (--fl-group-sizes) or unequal speed (per-group step
counts) runs today, and what it refuses with the reason: the rest of issue 40 lifts these one by
one (docs/heterogeneous.md)."""

from typing import Optional

from .checkpoint import CheckpointConfig
from .parallel import FederationConfig


def unequal_group_problems(backend: str, fed: FederationConfig, checkpoint: CheckpointConfig,
                           deepspeed: Optional[dict] = None) -> list[str]:
    """Every setting a layout of unequal groups cannot run yet, each with why."""
    problems = []
    if "train_batch_size" in (deepspeed or {}):
        problems.append("a DeepSpeed train_batch_size: it is one group's batch, which differs between groups of "
                        "unequal size; give --global-batch-size (over all ranks) or gradient_accumulation_steps")
    if fed.gossip or fed.dbench_metrics:
        problems.append(f"topology {fed.topology}{' with DBench metrics' if fed.dbench_metrics else ''}: gossip and "
                        "the consensus metrics pair the ranks of a peer group, which groups of unequal size lack")
    if fed.tune:
        problems.append("tune: its probe and trial exchange time a peer group, which groups of unequal size lack")
    if fed.elastic and backend == "megatron":
        problems.append("backend megatron in elastic mode: its distributed optimizer's buckets place each "
                        "parameter's elements by its own rules, so every group's ranges are gathered across the "
                        "groups at start-up, which elastic groups (separate jobs) cannot do before they meet; use "
                        "fsdp2 or deepspeed")
    if checkpoint.save and checkpoint.ckpt_mode == "compact":
        problems.append("ckpt_mode compact: it saves group 0's state for every group, whose shards differ here")
    return problems


def per_group_steps_problems(fed: FederationConfig, num_groups: int) -> list[str]:
    """What per-group step counts cannot run with in this layout (the settings' own conflicts are
    FederationConfig's), each with why."""
    if not fed.per_group_steps:
        return []
    problems = []
    if num_groups < 2:
        problems.append("a single federation group: there is nobody to plan steps against")
    pinned = fed.pinned_intervals
    if pinned and len(pinned) != num_groups:
        problems.append(f"group_intervals={fed.group_intervals!r} gives {len(pinned)} counts for {num_groups} "
                        "groups: give one per group")
    return problems
