"""Rank layout of federated sharded data parallelism (FL+FSDP, FL+HSDP).

N ranks are split into F federation groups of G contiguous ranks. Inside a group the
model is sharded over S ranks and replicated over P = G / S replicas (FSDP when P == 1).

    global rank = f * G + l,   local rank l = r * S + s
    f: federation group, r: replica index, s: shard index

so ranks form a row-major (F, P, S) mesh over range(N) (see ``mesh_shape``):

* shard groups   -- the S ranks with the same (f, r): slices along dim 2;
* replica groups -- the P ranks with the same (f, s): slices along dim 1;
* peer groups    -- the F ranks with the same local rank l = (r, s): slices along dim 0.
  They hold the same shard; the federation average all-reduces over them.

A node holds ranks_per_node (R) consecutive ranks: node of rank = rank // R.
Everything here is pure Python and has no torch dependency.
"""

from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple

# Names of the (F, P, S) mesh dimensions, in mesh order.
MESH_DIM_NAMES = ("federation", "replica", "shard")

DEFAULT_RANKS_PER_NODE = 8


def _divisors(n: int) -> List[int]:
    """All positive divisors of n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _aligned(size: int, ranks_per_node: int, world_size: int) -> bool:
    """Whether blocks of `size` consecutive ranks either cover whole nodes or tile a node."""
    if world_size <= ranks_per_node:
        return True  # a single (possibly partial) node: every block is inside it
    if size >= ranks_per_node:
        return size % ranks_per_node == 0
    return ranks_per_node % size == 0


def valid_group_sizes(world_size: int, ranks_per_node: int) -> List[int]:
    """Group sizes that divide world_size and are aligned to nodes of ranks_per_node."""
    return [g for g in _divisors(world_size) if _aligned(g, ranks_per_node, world_size)]


def valid_shard_sizes(group_size: int, ranks_per_node: int, world_size: int) -> List[int]:
    """Shard sizes that divide group_size and are aligned to nodes of ranks_per_node."""
    return [s for s in _divisors(group_size) if _aligned(s, ranks_per_node, world_size)]


def _fmt(values: Sequence[int]) -> str:
    return ", ".join(str(v) for v in values) if values else "none"


def _not_positive(name: str, value) -> List[str]:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return [f"{name}={value!r} must be a positive integer"]
    return []


def _node_problems(world_size: int, ranks_per_node: int) -> List[str]:
    """Problems with the world and node sizes alone."""
    problems = _not_positive("world_size", world_size) + _not_positive("ranks_per_node",
                                                                          ranks_per_node)
    if not problems and world_size > ranks_per_node and world_size % ranks_per_node:
        problems.append(
            f"world_size={world_size} is not a multiple of ranks_per_node={ranks_per_node}; "
            f"valid ranks_per_node for world_size={world_size}: {_fmt(_divisors(world_size))} "
            f"(or any value >= {world_size}: one partial node)")
    return problems


def _block_problem(kind: str, label: str, size: int, whole: str, whole_size: int, rpn: int,
                   n: int, valid: List[int]) -> List[str]:
    """Problems with blocks of `size` ranks inside blocks of `whole_size` (aligned to nodes)."""
    hint = f"valid {kind} sizes for {whole}={whole_size}, ranks_per_node={rpn}: {_fmt(valid)}"
    if whole_size % size:
        return [f"{kind}_size={size} does not divide {whole}={whole_size}; {hint}"]
    if not _aligned(size, rpn, n):
        relation = "a multiple of" if size > rpn else "a divisor of"
        return [f"{kind}_size={size} is not {relation} ranks_per_node={rpn}, so {label} "
                f"would straddle nodes; {hint}"]
    return []


def layout_problems(world_size: int, ranks_per_node: int, group_size: Optional[int],
                    shard_size: Optional[int]) -> List[str]:
    """Every reason the numbers do not form a valid layout (empty list: valid).

    A size given as None is unknown and is not checked (nor anything depending on it).
    """
    problems = _node_problems(world_size, ranks_per_node)
    sizes_ok = not problems
    if group_size is not None:
        bad = _not_positive("group_size", group_size)
        problems += bad
        if sizes_ok and not bad:
            problems += _block_problem("group", "federation groups", group_size, "world_size", world_size,
                                       ranks_per_node, world_size,
                                       valid_group_sizes(world_size, ranks_per_node))
        sizes_ok = sizes_ok and not bad
    if shard_size is not None:
        bad = _not_positive("shard_size", shard_size)
        problems += bad
        if sizes_ok and group_size is not None and not bad:
            problems += _block_problem("shard", "shard groups", shard_size, "group_size", group_size,
                                       ranks_per_node, world_size,
                                       valid_shard_sizes(group_size, ranks_per_node,
                                                         world_size))
    return problems


class WorldShape:
    """What follows from a layout's world, node and group counts (`world_size`, `ranks_per_node`,
    `num_groups`): shared by `Layout` and group_layout's `GroupLayout`."""

    @property
    def num_nodes(self) -> int:
        """Nodes used (a world smaller than a node counts as one partial node)."""
        return -(-self.world_size // self.ranks_per_node)

    @property
    def is_federated(self) -> bool:
        return self.num_groups > 1


class GroupSharding:
    """What follows from a group's size G and shard size S (`group_size`, `shard_size`)."""

    @property
    def replicas(self) -> int:
        """P: replicas inside a group (1 for FSDP)."""
        return self.group_size // self.shard_size

    @property
    def is_hsdp(self) -> bool:
        return self.replicas > 1


@dataclass(frozen=True)
class Layout(WorldShape, GroupSharding):
    """A validated rank layout: N ranks, R per node, groups of G, shards of S."""

    world_size: int
    ranks_per_node: int
    group_size: int
    shard_size: int

    def __post_init__(self) -> None:
        missing = [p for name in ("group_size", "shard_size") if getattr(self, name) is None
                   for p in _not_positive(name, None)]
        problems = missing + layout_problems(self.world_size, self.ranks_per_node,
                                             self.group_size, self.shard_size)
        if problems:
            raise ValueError("invalid layout:\n  - " + "\n  - ".join(problems))

    @property
    def num_groups(self) -> int:
        """F: number of federation groups."""
        return self.world_size // self.group_size

    def describe(self) -> str:
        """Short multi-line human description of the layout."""
        n, g, s, p, f = (self.world_size, self.group_size, self.shard_size,
                         self.replicas, self.num_groups)
        nodes = self.num_nodes
        node_line = (f"{n} rank{'s' * (n != 1)} on {nodes} node{'s' * (nodes != 1)} "
                     f"x {min(self.ranks_per_node, n)}")
        shards = f"{s} shard{'s' * (s != 1)}"
        inner = f"HSDP: {p} replicas x {shards}" if self.is_hsdp else f"FSDP: {shards}"
        if self.is_federated:
            group_line = f"{f} federation groups of {g} ({inner})"
            sync_line = f"federation average over {g} peer groups of {f} ranks"
        else:
            group_line = f"1 group of {g}, no federation ({inner})"
            sync_line = "no federation average"
        return "\n".join((node_line, group_line, sync_line))


def make_layout(world_size: int, ranks_per_node: Optional[int] = None,
                group_size: Optional[int] = None, num_groups: Optional[int] = None,
                shard_size: Optional[int] = None) -> Layout:
    """Resolve defaults and validate; raise ValueError listing every problem.

    ranks_per_node defaults to world_size when world_size <= 8, else 8; with neither
    group_size nor num_groups there is one group of world_size (plain FSDP/HSDP);
    num_groups alone gives group_size = world_size / num_groups; both must agree;
    shard_size defaults to group_size (FSDP inside each group).
    """
    if ranks_per_node is None:
        small = isinstance(world_size, int) and 1 <= world_size <= DEFAULT_RANKS_PER_NODE
        ranks_per_node = world_size if small else DEFAULT_RANKS_PER_NODE
    problems = _group_count_problems(world_size, group_size, num_groups)
    if group_size is None and not problems:
        group_size = world_size if num_groups is None else world_size // num_groups
    if shard_size is None and group_size is not None and not layout_problems(
            world_size, ranks_per_node, group_size, None):
        shard_size = group_size  # default only a valid group size, to avoid echoed errors
    problems += layout_problems(world_size, ranks_per_node, group_size, shard_size)
    if problems:
        raise ValueError("invalid layout:\n  - " + "\n  - ".join(problems))
    return Layout(world_size, ranks_per_node, group_size, shard_size)


def _group_count_problems(world_size: int, group_size: Optional[int],
                          num_groups: Optional[int]) -> List[str]:
    """Problems with num_groups alone and with its agreement with group_size."""
    if num_groups is None:
        return []
    problems = _not_positive("num_groups", num_groups)
    if problems or _not_positive("world_size", world_size):
        return problems
    if world_size % num_groups:
        return [f"num_groups={num_groups} does not divide world_size={world_size}; "
                f"valid numbers of groups: {_fmt(_divisors(world_size))}"]
    if group_size is not None and group_size * num_groups != world_size:
        return [f"num_groups={num_groups} and group_size={group_size} disagree: "
                f"{num_groups} x {group_size} != world_size={world_size}; "
                f"num_groups={num_groups} needs group_size={world_size // num_groups}"]
    return []


def _check_rank(layout: Layout, rank: int) -> None:
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank={rank} outside range(world_size={layout.world_size})")


def coords(layout: Layout, rank: int) -> Tuple[int, int, int]:
    """(f, r, s) of a global rank: rank = f*G + r*S + s."""
    _check_rank(layout, rank)
    f, local = divmod(rank, layout.group_size)
    r, s = divmod(local, layout.shard_size)
    return f, r, s


def rank_at(layout: Layout, f: int, r: int, s: int) -> int:
    """Global rank at mesh coordinates (f, r, s); inverse of ``coords``."""
    if not (0 <= f < layout.num_groups and 0 <= r < layout.replicas
            and 0 <= s < layout.shard_size):
        raise ValueError(f"coords ({f}, {r}, {s}) outside mesh {mesh_shape(layout)}")
    return f * layout.group_size + r * layout.shard_size + s


def node_of(layout: Layout, rank: int) -> int:
    """Node index holding a rank: rank // ranks_per_node."""
    _check_rank(layout, rank)
    return rank // layout.ranks_per_node


def spans_nodes(layout: Layout, ranks: Iterable[int]) -> bool:
    """Whether the ranks live on more than one node."""
    return len({node_of(layout, rank) for rank in ranks}) > 1


def mesh_shape(layout: Layout) -> Tuple[int, int, int]:
    """(F, P, S): rank = f*G + r*S + s, i.e. row-major over range(N).

    For a mesh ``torch.arange(N).reshape(F, P, S)`` with dim names ``MESH_DIM_NAMES``,
    dim-0 slices (fixed r, s) are peer groups, dim-1 slices (fixed f, s) replica groups
    and dim-2 slices (fixed f, r) shard groups, matching the functions below.
    """
    return layout.num_groups, layout.replicas, layout.shard_size


def federation_groups(layout: Layout) -> List[List[int]]:
    """F groups of G contiguous ranks."""
    g = layout.group_size
    return [list(range(f * g, (f + 1) * g)) for f in range(layout.num_groups)]


def shard_groups(layout: Layout) -> List[List[int]]:
    """F*P groups of the S ranks sharing (f, r), ordered by (f, r)."""
    f_n, p_n, s_n = mesh_shape(layout)
    return [[rank_at(layout, f, r, s) for s in range(s_n)]
            for f in range(f_n) for r in range(p_n)]


def replica_groups(layout: Layout) -> List[List[int]]:
    """F*S groups of the P ranks sharing (f, s), ordered by (f, s)."""
    f_n, p_n, s_n = mesh_shape(layout)
    return [[rank_at(layout, f, r, s) for r in range(p_n)]
            for f in range(f_n) for s in range(s_n)]


def peer_groups(layout: Layout) -> List[List[int]]:
    """G groups of the F ranks sharing local rank l = r*S + s, ordered by l."""
    f_n, p_n, s_n = mesh_shape(layout)
    return [[rank_at(layout, f, r, s) for f in range(f_n)]
            for r in range(p_n) for s in range(s_n)]
