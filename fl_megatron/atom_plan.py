"""Which ranks average which elements when federation groups differ in size.

Every group shards each tensor over its own S ranks (with HSDP, each shard is further split
into P replica slices, one per replica: the replica split). Cutting a tensor at every group's
boundaries gives *atoms*: runs of elements with exactly one owner rank in each group. An atom
is averaged over the communicator of its owners, so every element of every group is averaged
exactly once, no rank ever holds more than its own shard, and with equal groups the owner
tuples are exactly the peer groups of `topology.peer_groups`.

Cost, per sync: each rank averages the elements it owns once, so a group still moves its whole
model; the ranks of a smaller group own G_max / G_min times more elements than those of a larger
one. The communicators are the distinct owner tuples: a rank is in one for every run of ranks
of the other groups its range meets.

Pure Python, no torch: a 512-rank plan of an 8B model takes well under a second.
"""

import math
from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Sequence, Tuple

Cuts = Tuple[int, ...]  # S + 1 non-decreasing flat offsets: shard s holds [cuts[s], cuts[s + 1])
OwnerRun = Tuple[int, int, int]  # (start, stop, owner rank), a non-empty run of one tensor
CUT_RULES = ("fsdp2", "flat")


@dataclass(frozen=True)
class GroupShape:
    """One federation group: its first global rank, its size G and its shard size S (P = G / S)."""

    first_rank: int
    size: int
    shard_size: int

    def __post_init__(self) -> None:
        for name in ("size", "shard_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.size % self.shard_size:
            raise ValueError(f"shard_size={self.shard_size} does not divide the group's size={self.size}")
        if self.first_rank < 0:
            raise ValueError(f"first_rank={self.first_rank} must not be negative")

    @property
    def replicas(self) -> int:
        return self.size // self.shard_size

    def rank(self, replica: int, shard: int) -> int:
        """The global rank holding replica `replica` of shard `shard`: first + r * S + s."""
        return self.first_rank + replica * self.shard_size + shard


def fsdp2_cuts(shape: Sequence[int], shards: int) -> Cuts:
    """FSDP2's cut of a tensor: dim 0 in chunks of ceil(rows / S) rows (`torch.chunk`), the last
    ranks possibly short or empty; as flat element offsets."""
    rows = shape[0] if shape else 1
    row_elements = math.prod(shape[1:])
    per = -(-rows // shards)
    return tuple(min(s * per, rows) * row_elements for s in range(shards + 1))


def flat_cuts(numel: int, shards: int) -> Cuts:
    """DeepSpeed ZeRO-3's cut of a flattened tensor: ceil(n / S) elements per rank, the tail of
    the last ranks padding (not elements of the tensor)."""
    per = -(-numel // shards)
    return tuple(min(s * per, numel) for s in range(shards + 1))


def tensor_cuts(rule: str, shape: Sequence[int], shards: int) -> Cuts:
    """A backend's cut of one tensor of `shape` over `shards` ranks (see CUT_RULES)."""
    if rule == "fsdp2":
        return fsdp2_cuts(shape, shards)
    if rule == "flat":
        return flat_cuts(math.prod(shape), shards)
    raise ValueError(f"unknown cut rule {rule!r}; known: {', '.join(CUT_RULES)}")


def _check_cuts(cuts: Cuts, numel: int, group: GroupShape, tensor: int) -> None:
    if len(cuts) != group.shard_size + 1:
        raise ValueError(f"tensor {tensor}: {len(cuts)} cuts for a group of {group.shard_size} shards "
                         f"(need {group.shard_size + 1})")
    if cuts[0] != 0 or cuts[-1] != numel or any(a > b for a, b in zip(cuts, cuts[1:])):
        raise ValueError(f"tensor {tensor}: cuts {list(cuts)} do not tile [0, {numel}) in order")


def owner_runs(group: GroupShape, cuts: Cuts) -> List[OwnerRun]:
    """Who in `group` averages which elements of one tensor: shard s's range split into P
    near-equal replica slices (ceil), replica r owning slice r; empty runs dropped."""
    runs = []
    p = group.replicas
    for s in range(group.shard_size):
        lo, hi = cuts[s], cuts[s + 1]
        per = -(-(hi - lo) // p)
        for r in range(p):
            a, b = min(lo + r * per, hi), min(lo + (r + 1) * per, hi)
            if a < b:
                runs.append((a, b, group.rank(r, s)))
    return runs


class Atom(NamedTuple):
    """Elements [start, stop) of tensor `tensor`, averaged over `owners` (one rank per group)."""

    tensor: int
    start: int
    stop: int
    owners: Tuple[int, ...]

    @property
    def length(self) -> int:
        return self.stop - self.start


def _merge(runs_per_group: List[List[OwnerRun]], tensor: int) -> List[Atom]:
    """Atoms of one tensor from each group's owner runs (each tiling the same [0, n)): one atom
    per stretch between consecutive boundaries of any group, with each group's owner there."""
    stops = sorted({stop for runs in runs_per_group for _, stop, _ in runs})
    columns = []
    for runs in runs_per_group:
        column, i = [], 0
        for stop in stops:
            while runs[i][1] < stop:
                i += 1
            column.append(runs[i][2])
        columns.append(column)
    starts = [0] + stops[:-1]
    return [Atom(tensor, a, b, owners) for a, b, owners in zip(starts, stops, zip(*columns))]


@dataclass(frozen=True)
class GroupCost:
    """What one group's ranks carry in a sync: the most elements any of its ranks averages
    across groups, the fewest, and the most communicators (owner tuples) any of them is in."""

    group: int
    size: int
    shard_size: int
    max_elements: int
    min_elements: int
    max_communicators: int

    def line(self, element_bytes: float) -> str:
        """One line for the dry run and the cost model."""
        mib = self.max_elements * element_bytes / 2 ** 20
        return (f"group {self.group}: {self.size} ranks ({self._inner()}), up to {self.max_elements:,} elements "
                f"({mib:,.1f} MiB) averaged per rank per sync, in up to {self.max_communicators} "
                f"communicator{'s' * (self.max_communicators != 1)}")

    def _inner(self) -> str:
        p = self.size // self.shard_size
        return f"HSDP {p} x {self.shard_size}" if p > 1 else f"FSDP {self.shard_size}"


@dataclass
class AtomPlan:
    """Every tensor cut into atoms over `groups`; `numels[t]` is tensor t's element count."""

    groups: Tuple[GroupShape, ...]
    numels: Tuple[int, ...]
    cuts: Tuple[Tuple[Cuts, ...], ...]  # cuts[t][f]: group f's cut of tensor t
    atoms: List[Atom]
    _by_rank: Dict[int, List[Atom]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for atom in self.atoms:
            for rank in atom.owners:
                self._by_rank.setdefault(rank, []).append(atom)

    @property
    def world_size(self) -> int:
        return sum(g.size for g in self.groups)

    def owner_tuples(self) -> List[Tuple[int, ...]]:
        """The distinct owner tuples, sorted: one communicator each, created (and used) in this
        order on every rank, which no two ranks can deadlock on."""
        return sorted({atom.owners for atom in self.atoms})

    def rank_atoms(self, rank: int) -> List[Atom]:
        """The atoms `rank` averages, in (tensor, start) order: the same order on all owners."""
        return self._by_rank.get(rank, [])

    def group_of(self, rank: int) -> int:
        return group_index(self.groups, rank)

    def shard_of(self, rank: int) -> Tuple[int, int, int]:
        """(group, replica, shard) of a global rank."""
        f = self.group_of(rank)
        r, s = divmod(rank - self.groups[f].first_rank, self.groups[f].shard_size)
        return f, r, s

    def shard_range(self, rank: int, tensor: int) -> Tuple[int, int]:
        """The elements of `tensor` in `rank`'s local shard: its shard's range (every replica of
        a shard holds all of it)."""
        f, _, s = self.shard_of(rank)
        cut = self.cuts[tensor][f]
        return cut[s], cut[s + 1]

    def replica_runs(self, rank: int, tensor: int) -> List[OwnerRun]:
        """The runs of `rank`'s shard of `tensor` and the replica of that shard owning each."""
        f, _, s = self.shard_of(rank)
        lo, hi = self.shard_range(rank, tensor)
        return [run for run in owner_runs(self.groups[f], self.cuts[tensor][f]) if lo <= run[0] and run[1] <= hi]

    def costs(self) -> List[GroupCost]:
        """Per group: elements averaged and communicators, over its ranks."""
        out = []
        for f, g in enumerate(self.groups):
            ranks = range(g.first_rank, g.first_rank + g.size)
            elements = [sum(a.length for a in self.rank_atoms(r)) for r in ranks]
            comms = [len({a.owners for a in self.rank_atoms(r)}) for r in ranks]
            out.append(GroupCost(f, g.size, g.shard_size, max(elements), min(elements), max(comms)))
        return out


def group_index(groups: Sequence[GroupShape], rank: int) -> int:
    """The index of the group holding global `rank` (ValueError if none does)."""
    for f, g in enumerate(groups):
        if g.first_rank <= rank < g.first_rank + g.size:
            return f
    raise ValueError(f"rank={rank} is in none of the groups (ranks 0-{sum(g.size for g in groups) - 1})")


def groups_from_sizes(sizes: Sequence[int], shard_sizes: Sequence[int] = ()) -> Tuple[GroupShape, ...]:
    """Contiguous groups of `sizes` ranks (group f starts after group f - 1), each sharded over
    its `shard_sizes[f]` (default: its size, FSDP)."""
    if shard_sizes and len(shard_sizes) != len(sizes):
        raise ValueError(f"{len(shard_sizes)} shard sizes for {len(sizes)} groups")
    groups, first = [], 0
    for f, size in enumerate(sizes):
        groups.append(GroupShape(first, size, shard_sizes[f] if shard_sizes else size))
        first += size
    return tuple(groups)


def plan_atoms(groups: Sequence[GroupShape], cuts: Sequence[Sequence[Cuts]],
               numels: Sequence[int]) -> AtomPlan:
    """The atoms of every tensor: `cuts[t][f]` is group f's cut of tensor t (S_f + 1 offsets),
    as its backend makes it (a rule above, or a backend's own range map read at start-up)."""
    groups = tuple(groups)
    if not groups:
        raise ValueError("a plan needs at least one group")
    if len(cuts) != len(numels):
        raise ValueError(f"{len(cuts)} tensors' cuts for {len(numels)} tensors")
    atoms: List[Atom] = []
    checked = []
    for t, (tensor_cuts_, numel) in enumerate(zip(cuts, numels)):
        if len(tensor_cuts_) != len(groups):
            raise ValueError(f"tensor {t}: cuts for {len(tensor_cuts_)} groups, the plan has {len(groups)}")
        runs = []
        for g, c in zip(groups, tensor_cuts_):
            _check_cuts(tuple(c), numel, g, t)
            runs.append(owner_runs(g, tuple(c)))
        checked.append(tuple(tuple(c) for c in tensor_cuts_))
        atoms.extend(_merge(runs, t))
    return AtomPlan(groups, tuple(numels), tuple(checked), atoms)


def plan_for_shapes(groups: Sequence[GroupShape], shapes: Sequence[Sequence[int]], rule: str = "fsdp2") -> AtomPlan:
    """`plan_atoms` for tensors of `shapes`, every group cutting them by one backend's `rule`."""
    numels = [math.prod(shape) for shape in shapes]
    cuts = [[tensor_cuts(rule, shape, g.shard_size) for g in groups] for shape in shapes]
    return plan_atoms(groups, cuts, numels)
