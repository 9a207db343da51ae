"""The layouts a run is compared with: FSDP and HSDP over every rank, and the federated ones."""

from typing import Optional

from ..topology import Layout, make_layout
from .timing import Variant


def baseline_variants(world: int, ranks_per_node: int) -> list[Variant]:
    """FSDP over all ranks, and HSDP sharded inside each node (when there are several nodes)."""
    out = [Variant("FSDP", make_layout(world, ranks_per_node))]
    if world > ranks_per_node and world % ranks_per_node == 0:
        out.append(Variant("HSDP", make_layout(world, ranks_per_node, shard_size=ranks_per_node)))
    return out


def federated_variants(layout: Layout, sync_interval: int, overlap_steps: int = 0,
                       graph: str = "complete", fragments: int = 1) -> list[Variant]:
    """A federated layout as run: FL+FSDP, or FL+HSDP with both averaging variants."""
    if not layout.is_federated:
        return []
    sync = dict(overlap_steps=overlap_steps, graph=graph, fragments=fragments)
    if not layout.is_hsdp:
        return [Variant("FL+FSDP", layout, sync_interval, **sync)]
    return [Variant("FL+HSDP naive", layout, sync_interval, replica_split=False, **sync),
            Variant("FL+HSDP split", layout, sync_interval, replica_split=True, **sync)]


def comparison_variants(world: int, ranks_per_node: int, group_size: Optional[int], shard_size: Optional[int],
                        sync_interval: int) -> list[Variant]:
    """Baselines, then FL+FSDP with `group_size` and, when `shard_size` < `group_size`, FL+HSDP."""
    out = baseline_variants(world, ranks_per_node)
    if group_size and group_size < world:
        out += federated_variants(make_layout(world, ranks_per_node, group_size), sync_interval)
        if shard_size and shard_size < group_size:
            out += federated_variants(make_layout(world, ranks_per_node, group_size, shard_size=shard_size),
                                      sync_interval)
    return out
