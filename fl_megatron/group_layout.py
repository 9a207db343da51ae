"""Rank layout of federation groups of unequal size (one world).

Group f holds G_f consecutive ranks, the first right after group f - 1's; inside it the model is
sharded over S_f ranks and replicated over P_f = G_f / S_f replicas (rank = first_f + r * S_f + s,
as `topology` within a group). Every group and every shard block is checked node by node: a
block either covers whole nodes or stays inside one. Equal groups are `topology.Layout`'s case
and `as_equal_layout` gives that layout. Pure Python, no torch.
"""

from dataclasses import dataclass
from functools import cached_property
from typing import List, Optional, Sequence, Tuple

from .atom_plan import GroupShape, group_index, groups_from_sizes
from .topology import DEFAULT_RANKS_PER_NODE, Layout, make_layout


def _block_problem(what: str, first: int, size: int, ranks_per_node: int, world_size: int) -> Optional[str]:
    """Why ranks [first, first + size) straddle nodes, or None when they do not."""
    if world_size <= ranks_per_node:
        return None  # one (possibly partial) node holds every block
    last = first + size - 1
    if size >= ranks_per_node:
        if first % ranks_per_node == 0 and size % ranks_per_node == 0:
            return None
        return (f"{what} (ranks {first}-{last}) must cover whole nodes of {ranks_per_node} ranks: "
                f"start at a multiple of {ranks_per_node} and hold a multiple of {ranks_per_node} ranks")
    if first // ranks_per_node == last // ranks_per_node:
        return None
    return (f"{what} (ranks {first}-{last}) straddles nodes {first // ranks_per_node} and "
            f"{last // ranks_per_node} of {ranks_per_node} ranks each")


def _positive(name: str, value) -> Optional[str]:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"{name}={value!r} must be a positive integer"
    return None


def group_layout_problems(group_sizes: Sequence[int], shard_sizes: Sequence[int],
                          ranks_per_node: int) -> List[str]:
    """Every reason the sizes do not form a valid layout of unequal groups (empty: valid)."""
    problems = [p for p in [_positive("ranks_per_node", ranks_per_node)] if p]
    if len(group_sizes) < 1:
        problems.append("no group sizes given")
    if len(shard_sizes) != len(group_sizes):
        problems.append(f"{len(shard_sizes)} shard sizes for {len(group_sizes)} groups: give one per group")
    problems += [p for f, g in enumerate(group_sizes) if (p := _positive(f"size of group {f}", g))]
    problems += [p for f, s in enumerate(shard_sizes) if (p := _positive(f"shard size of group {f}", s))]
    if problems:
        return problems
    world = sum(group_sizes)
    if world > ranks_per_node and world % ranks_per_node:
        problems.append(f"the groups hold {world} ranks, not a multiple of ranks_per_node={ranks_per_node}")
    first = 0
    for f, (g, s) in enumerate(zip(group_sizes, shard_sizes)):
        if g % s:
            problems.append(f"group {f}: shard size {s} does not divide its size {g}")
        else:
            problems += [p for p in [_block_problem(f"group {f}", first, g, ranks_per_node, world)] if p]
            shard_blocks = [_block_problem(f"a shard group of group {f}", first + k, s, ranks_per_node, world)
                            for k in range(0, g, s)] if s < g else []
            problems += [p for p in shard_blocks if p][:1]
        first += g
    return problems


@dataclass(frozen=True)
class GroupLayout:
    """A validated layout of F groups of sizes `group_sizes`, sharded over `shard_sizes`."""

    ranks_per_node: int
    group_sizes: Tuple[int, ...]
    shard_sizes: Tuple[int, ...]

    def __post_init__(self) -> None:
        problems = group_layout_problems(self.group_sizes, self.shard_sizes, self.ranks_per_node)
        if problems:
            raise ValueError("invalid layout of groups:\n  - " + "\n  - ".join(problems))

    @property
    def world_size(self) -> int:
        return sum(self.group_sizes)

    @property
    def num_groups(self) -> int:
        return len(self.group_sizes)

    @cached_property
    def groups(self) -> Tuple[GroupShape, ...]:
        """Each group's first rank, size and shard size: what `atom_plan` plans over."""
        return groups_from_sizes(self.group_sizes, self.shard_sizes)

    @property
    def is_equal(self) -> bool:
        return len(set(self.group_sizes)) == 1 and len(set(self.shard_sizes)) == 1

    def group_of(self, rank: int) -> int:
        """The group holding global `rank`."""
        return group_index(self.groups, rank)

    def as_equal_layout(self) -> Layout:
        """Today's `Layout` of equal groups (ValueError when the groups differ)."""
        if not self.is_equal:
            raise ValueError(f"groups of sizes {list(self.group_sizes)} (shards {list(self.shard_sizes)}) "
                             "are not equal")
        return make_layout(self.world_size, self.ranks_per_node, self.group_sizes[0],
                           shard_size=self.shard_sizes[0])

    def describe(self) -> List[str]:
        """A line per group: its ranks, nodes and sharding."""
        lines = []
        for f, g in enumerate(self.groups):
            last = g.first_rank + g.size - 1
            nodes = sorted({r // self.ranks_per_node for r in (g.first_rank, last)})
            where = f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {nodes[0]}-{nodes[-1]}"
            inner = (f"HSDP {g.replicas} replicas x {g.shard_size} shards" if g.replicas > 1
                     else f"FSDP over {g.shard_size}")
            lines.append(f"group {f}: {g.size} rank{'s' * (g.size != 1)} ({g.first_rank}-{last}, {where}), {inner}")
        return lines


def make_group_layout(group_sizes: Sequence[int], ranks_per_node: Optional[int] = None,
                      shard_sizes: Optional[Sequence[int]] = None) -> GroupLayout:
    """Resolve defaults (shards: each group's size, i.e. FSDP; ranks_per_node as `make_layout`)
    and validate; ValueError listing every problem."""
    sizes = tuple(group_sizes)
    world = sum(s for s in sizes if isinstance(s, int))
    if ranks_per_node is None:
        ranks_per_node = world if 1 <= world <= DEFAULT_RANKS_PER_NODE else DEFAULT_RANKS_PER_NODE
    return GroupLayout(ranks_per_node, sizes, tuple(shard_sizes) if shard_sizes is not None else sizes)
