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
from .topology import DEFAULT_RANKS_PER_NODE, GroupSharding, Layout, WorldShape, make_layout


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
                          ranks_per_node: int, node_sizes: Sequence[int] = ()) -> List[str]:
    """Every reason the sizes do not form a valid layout of unequal groups (empty: valid).
    `node_sizes`: each group's ranks per node where the sites differ (then every group covers
    whole nodes of its own size)."""
    if node_sizes:
        return _site_problems(group_sizes, shard_sizes, node_sizes)
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


def _site_problems(group_sizes: Sequence[int], shard_sizes: Sequence[int], node_sizes: Sequence[int]) -> List[str]:
    """`group_layout_problems` where each group has nodes of its own size."""
    problems = [f"{len(node_sizes)} node sizes for {len(group_sizes)} groups: give one per group"] \
        if len(node_sizes) != len(group_sizes) else []
    problems += [p for f, n in enumerate(node_sizes) if (p := _positive(f"ranks per node of group {f}", n))]
    if problems:
        return problems
    for f, (g, s, n) in enumerate(zip(group_sizes, shard_sizes, node_sizes)):
        if g % s:
            problems.append(f"group {f}: shard size {s} does not divide its size {g}")
        elif g % n:
            problems.append(f"group {f} ({g} ranks) must cover whole nodes of its {n} ranks per node")
        elif s < g and (s % n if s >= n else n % s):
            problems.append(f"group {f}: its shard groups of {s} ranks would straddle its nodes of {n} ranks "
                            f"(give a multiple or a divisor of {n})")
    return problems


@dataclass(frozen=True)
class GroupLayout(WorldShape):
    """A validated layout of F groups of sizes `group_sizes`, sharded over `shard_sizes`, on nodes
    of `ranks_per_node` ranks, or of `node_sizes[f]` ranks in group f (sites that differ)."""

    ranks_per_node: int
    group_sizes: Tuple[int, ...]
    shard_sizes: Tuple[int, ...]
    node_sizes: Tuple[int, ...] = ()

    def __post_init__(self) -> None:
        problems = group_layout_problems(self.group_sizes, self.shard_sizes, self.ranks_per_node, self.node_sizes)
        if problems:
            raise ValueError("invalid layout of groups:\n  - " + "\n  - ".join(problems))

    def node_size(self, group: int) -> int:
        """Ranks per node of `group`'s nodes."""
        return self.node_sizes[group] if self.node_sizes else self.ranks_per_node

    def node_of(self, rank: int) -> int:
        """The node holding global `rank` (nodes numbered in rank order over every group)."""
        if not self.node_sizes:
            return rank // self.ranks_per_node
        f = self.group_of(rank)
        before = sum(g // n for g, n in zip(self.group_sizes[:f], self.node_sizes))
        return before + (rank - self.groups[f].first_rank) // self.node_sizes[f]

    @property
    def num_nodes(self) -> int:
        return self.node_of(self.world_size - 1) + 1

    @property
    def world_size(self) -> int:
        return sum(self.group_sizes)

    @property
    def num_groups(self) -> int:
        return len(self.group_sizes)

    @property
    def is_hsdp(self) -> bool:
        """Whether any group replicates its shards (HSDP)."""
        return any(g.replicas > 1 for g in self.groups)

    @property
    def is_unequal(self) -> bool:
        """Always True: equal groups resolve to `topology.Layout` (see `resolve_group_layout`)."""
        return True

    @cached_property
    def groups(self) -> Tuple[GroupShape, ...]:
        """Each group's first rank, size and shard size: what `atom_plan` plans over."""
        return groups_from_sizes(self.group_sizes, self.shard_sizes)

    @property
    def is_equal(self) -> bool:
        return len(set(self.group_sizes)) == 1 and len(set(self.shard_sizes)) == 1 and len(set(self.node_sizes)) <= 1

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

    def coords(self, rank: int) -> Tuple[int, int, int]:
        """(group, replica index, shard index) of global `rank`."""
        f = self.group_of(rank)
        g = self.groups[f]
        r, s = divmod(rank - g.first_rank, g.shard_size)
        return f, r, s

    def seen_from(self, rank: int) -> "RankLayout":
        """The layout as rank `rank`'s own group sees it (what a backend and the trainer read)."""
        f = self.group_of(rank)
        return RankLayout(self, f, self.groups[f].size, self.groups[f].shard_size)

    def describe(self) -> str:
        """The banner's lines: the world, then a line per group."""
        n = self.world_size
        per_node = "/".join(map(str, self.node_sizes)) if self.node_sizes else min(self.ranks_per_node, n)
        head = (f"{n} ranks on {self.num_nodes} node{'s' * (self.num_nodes != 1)} x "
                f"{per_node}, {self.num_groups} federation groups of unequal size "
                f"({'+'.join(map(str, self.group_sizes))})")
        return "\n".join([head] + ["  " + line for line in self.group_lines()])

    def group_lines(self) -> List[str]:
        """A line per group: its ranks, nodes and sharding."""
        lines = []
        for f, g in enumerate(self.groups):
            last = g.first_rank + g.size - 1
            nodes = sorted({self.node_of(r) for r in (g.first_rank, last)})
            where = f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {nodes[0]}-{nodes[-1]}"
            inner = (f"HSDP {g.replicas} replicas x {g.shard_size} shards" if g.replicas > 1
                     else f"FSDP over {g.shard_size}")
            lines.append(f"group {f}: {g.size} rank{'s' * (g.size != 1)} ({g.first_rank}-{last}, {where}), {inner}")
        return lines


@dataclass(frozen=True)
class RankLayout(WorldShape, GroupSharding):
    """A layout of unequal groups seen from one rank: its own group's size G and shard size S,
    the world's size and group count. It reads like `topology.Layout` for everything that concerns
    the rank's own group; `whole` has every group."""

    whole: GroupLayout
    group: int
    group_size: int
    shard_size: int

    world_size = property(lambda self: self.whole.world_size)
    ranks_per_node = property(lambda self: self.whole.node_size(self.group))  # this rank's node's
    num_groups = property(lambda self: self.whole.num_groups)
    is_unequal = property(lambda self: True)

    def describe(self) -> str:
        return self.whole.describe()


def make_group_layout(group_sizes: Sequence[int], ranks_per_node: Optional[int] = None,
                      shard_sizes: Optional[Sequence[int]] = None,
                      node_sizes: Optional[Sequence[int]] = None) -> GroupLayout:
    """Resolve defaults (shards: each group's size, i.e. FSDP; ranks_per_node as `make_layout`,
    or the largest of `node_sizes`, each group's where the sites differ) and validate;
    ValueError listing every problem."""
    sizes = tuple(group_sizes)
    world = sum(s for s in sizes if isinstance(s, int))
    nodes = tuple(node_sizes or ())
    if nodes and all(isinstance(n, int) for n in nodes):
        ranks_per_node = max(nodes)
    if ranks_per_node is None:
        ranks_per_node = world if 1 <= world <= DEFAULT_RANKS_PER_NODE else DEFAULT_RANKS_PER_NODE
    return GroupLayout(ranks_per_node, sizes, tuple(shard_sizes) if shard_sizes is not None else sizes, nodes)


def layout_record(layout) -> dict:
    """A layout as metadata.json and summary.json record it: world, node, G, F, S (for groups of
    unequal size group 0's G and S) and every group's size and shard size."""
    sizes, shards = group_sizes_of(layout)
    whole = getattr(layout, "whole", layout)
    return {"world_size": layout.world_size, "ranks_per_node": whole.ranks_per_node, "group_size": sizes[0],
            "num_groups": len(sizes), "hsdp_shard_size": shards[0], "group_sizes": list(sizes),
            "hsdp_shard_sizes": list(shards), "group_ranks_per_node": list(getattr(whole, "node_sizes", ()))}


def group_sizes_of(layout) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """(every group's size, every group's shard size) of a `Layout`, `GroupLayout` or `RankLayout`."""
    whole = getattr(layout, "whole", layout)
    if isinstance(whole, GroupLayout):
        return whole.group_sizes, whole.shard_sizes
    return (whole.group_size,) * whole.num_groups, (whole.shard_size,) * whole.num_groups


def recorded_group_sizes(record: dict) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """`group_sizes_of` from a `layout_record` (older records: equal groups)."""
    f = record["num_groups"]
    return (tuple(record.get("group_sizes") or (record["group_size"],) * f),
            tuple(record.get("hsdp_shard_sizes") or (record["hsdp_shard_size"],) * f))
