"""The process groups of one rank when federation groups differ in size (one world).

No rectangular (F, P, S) mesh exists, so every rank creates every group's shard, replica and
federation communicators with `new_group`, in one common order (torch names groups by a count
and connects only their members), and builds its own sharding mesh from its group's
communicators (`DeviceMesh.from_group`). Across groups there is no peer group: shards are
averaged over the atom communicators of an `AtomPlan` (atom_average.py), and the vote and the
job-wide reductions run over the leaders, the first rank of every group.
"""

import math
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..atom_plan import AtomPlan, plan_atoms, plan_for_shapes
from ..group_layout import GroupLayout
from ..topology import MESH_DIM_NAMES
from .atom_average import AtomAverager, build_atom_groups, fragment_windows, window_views
from .failed_collective import call_directly
from .groups import ProcessGroups


@dataclass
class UnequalGroups(ProcessGroups):
    """A rank's view of a layout of unequal groups: `layout` is the rank's own group as an equal
    layout reads (`RankLayout`), `mesh` its own sharding mesh. There is no peer group: `peer` is
    None, `atoms` holds the averaging communicators (`plan_shards`)."""

    whole: Optional[GroupLayout] = None
    replica_group: Optional[dist.ProcessGroup] = None  # the HSDP replicas of this rank's shard (None: FSDP)
    leaders: Optional[dist.ProcessGroup] = None  # the first rank of every group
    atoms: Dict[Tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)  # by owner tuple
    timeout: Optional[timedelta] = None

    @property
    def coords(self) -> Tuple[int, int, int]:
        return self.whole.coords(self.rank)

    @property
    def peer(self) -> None:
        """No peer group: a rank of a group of 8 has no counterpart in a group of 4."""
        return None

    @property
    def replica(self) -> Optional[dist.ProcessGroup]:
        return self.replica_group

    @property
    def group(self) -> int:
        return self.layout.group

    @property
    def is_leader(self) -> bool:
        return self.rank == self.whole.groups[self.group].first_rank

    def tier(self, kind: str) -> str:
        """'inter-node' if this rank's `kind` communicators ('peer': the atom tuples, one rank of
        every group; 'replica'; 'shard') span nodes."""
        g = self.whole.groups[self.group]
        _, r, s = self.coords
        ranks = {"peer": [h.first_rank for h in self.whole.groups],
                 "replica": [g.rank(k, s) for k in range(g.replicas)],
                 "shard": [g.rank(r, k) for k in range(g.shard_size)]}[kind]
        return "inter-node" if len({self.whole.node_of(rank) for rank in ranks}) > 1 else "intra-node"

    def has_exchange_groups(self) -> bool:
        """Whether an overlapped sync can run in the background: the atom communicators serve only
        syncs; HSDP groups need the exchange's own replica groups (`exchange=True`)."""
        return not self.whole.is_hsdp or self.exchange_replica is not None

    def atom_communicators(self, plan: AtomPlan, timeout: Optional[timedelta] = None) -> dict:
        """This rank's communicators of `plan`'s owner tuples (collective over the world)."""
        return build_atom_groups(plan, self.rank, timeout=timeout if timeout is not None else self.timeout)

    def reduce_across_groups(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, call=call_directly) -> None:
        """Reduce a tensor that is the same on every rank of each group across the groups: over the
        leaders, then from each leader to its group (the vote's table)."""
        if self.whole.num_groups > 1:
            if self.is_leader:
                call(dist.all_reduce, tensor, op=op, group=self.leaders)
            dist.broadcast(tensor, group_src=0, group=self.federation)

    def all_reduce_job(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        """Reduce `tensor` over every rank of the job in place without a world collective: inside
        the group, across the leaders, then from the leader back to its group."""
        dist.all_reduce(tensor, op=op, group=self.federation)
        self.reduce_across_groups(tensor, op)


def build_unequal_groups(layout: GroupLayout, device_type: str, timeout: Optional[timedelta] = None,
                         async_checkpoint: bool = False, exchange: bool = False) -> UnequalGroups:
    """Create every group's communicators on every rank (collective over the world: all ranks
    call it with the same layout) and this rank's sharding mesh (1-D shard for FSDP, 2-D
    (replica, shard) for HSDP). `async_checkpoint`: also a gloo copy of every group for
    background checkpoint writes. `exchange`: also the HSDP replica groups of an overlapped
    sync's thread (the atom communicators serve only syncs, so that thread uses them as they
    are). The atom communicators come later (`plan_shards`), once the
    backend's shards are known."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call init_process_group first")
    if dist.get_world_size() != layout.world_size:
        raise ValueError(f"the groups hold {layout.world_size} ranks but the job has {dist.get_world_size()}")
    rank = dist.get_rank()
    hsdp = [g for g in layout.groups if g.replicas > 1]
    whole = [list(range(g.first_rank, g.first_rank + g.size)) for g in layout.groups]
    replicas = [[g.rank(r, s) for r in range(g.replicas)] for g in hsdp for s in range(g.shard_size)]
    federation = _new_groups(whole, rank, timeout)
    shard = _new_groups([[g.rank(r, s) for s in range(g.shard_size)] for g in hsdp for r in range(g.replicas)],
                        rank, timeout)
    replica = _new_groups(replicas, rank, timeout)
    leaders = _new_groups([[g.first_rank for g in layout.groups]], rank, timeout, every_rank=True)
    # an overlapped sync's HSDP broadcasts, never on the training thread's replica group
    exchange_replica = _new_groups(replicas, rank, timeout) if exchange else None
    checkpoint = _new_groups(whole, rank, timeout, backend="gloo") if async_checkpoint else None
    mine = layout.groups[layout.group_of(rank)]
    if mine.replicas > 1:
        grid = torch.tensor([[mine.rank(r, s) for s in range(mine.shard_size)] for r in range(mine.replicas)])
        mesh = DeviceMesh.from_group([replica, shard], device_type, mesh=grid, mesh_dim_names=MESH_DIM_NAMES[1:])
    else:
        mesh = DeviceMesh.from_group(federation, device_type, mesh_dim_names=MESH_DIM_NAMES[2:])
    return UnequalGroups(layout=layout.seen_from(rank), rank=rank, mesh=mesh, shard_mesh=mesh, federation=federation,
                         exchange_replica=exchange_replica, checkpoint=checkpoint, whole=layout, replica_group=replica,
                         leaders=leaders, timeout=timeout)


def _new_groups(member_lists: list, rank: int, timeout: Optional[timedelta], backend: Optional[str] = None,
                every_rank: bool = False) -> Optional[dist.ProcessGroup]:
    """One `new_group` per list of ranks, on every rank in the same order; the one holding `rank`
    (None if none does). `every_rank`: return the last group made even where `rank` is not in it
    (torch's placeholder for non-members)."""
    mine = None
    for members in member_lists:
        made = dist.new_group(members, timeout=timeout, backend=backend)
        if rank in members or every_rank:
            mine = made
    return mine


def plan_shards(groups: UnequalGroups, shapes: Sequence[Sequence[int]], rule: str = "fsdp2",
                timeout: Optional[timedelta] = None, ranges: Optional[list] = None) -> AtomPlan:
    """The atom plan of tensors of `shapes` (the model's parameters, in its order) cut by the
    backend's `rule`, with this rank's atom communicators made into `groups.atoms`
    (collective over the world, as `build_unequal_groups`). Rule "ranges": every rank's
    `ranges` (its shard's [start, stop) of each tensor, None where it holds none) are gathered,
    as its backend laid them out, instead of a rule computing them."""
    if rule == "ranges":
        numels = [math.prod(shape) for shape in shapes]
        plan = plan_atoms(groups.whole.groups, gathered_cuts(groups, ranges, numels), numels)
    else:
        plan = plan_for_shapes(groups.whole.groups, shapes, rule)
    groups.atoms = groups.atom_communicators(plan, timeout)
    return plan


def gathered_cuts(groups: UnequalGroups, ranges: list, numels: Sequence[int]) -> list:
    """cuts[t][f] (S_f + 1 offsets) of every group, from each rank's own `ranges`: gathered in the
    shard group, then over the groups' first ranks, then from each to its group (start-up only)."""
    shard_group = groups.shard_mesh.get_group(MESH_DIM_NAMES[2])
    mine: list = [None] * dist.get_world_size(shard_group)
    dist.all_gather_object(mine, ranges, group=shard_group)
    cuts = [_cut_of(numel, [r[t] for r in mine]) for t, numel in enumerate(numels)]
    every = [cuts]
    if groups.whole.num_groups > 1:
        every = [None] * groups.whole.num_groups
        if groups.is_leader:
            dist.all_gather_object(every, cuts, group=groups.leaders)
        dist.broadcast_object_list(every, group_src=0, group=groups.federation)
    return [[every[f][t] for f in range(len(every))] for t in range(len(numels))]


def _cut_of(numel: int, spans: list) -> tuple:
    """The S + 1 offsets of a tensor cut over S ranks from each rank's [start, stop) (None: none)."""
    cut = [0]
    for span in spans:
        if span is not None and span[0] != cut[-1]:
            raise ValueError(f"a rank's range {span} of a tensor does not start where the previous rank's ends "
                             f"({cut[-1]}): the backend's shards are not contiguous in rank order")
        cut.append(cut[-1] if span is None else span[1])
    if cut[-1] != numel:
        raise ValueError(f"the ranks' ranges of a tensor of {numel} elements end at {cut[-1]}")
    return tuple(cut)


@dataclass
class AtomAveraging:
    """What makes a rank's averagers over an atom plan (one per fragment) and cuts its shards into
    the fragments they average; SyncState asks it where groups differ in size."""

    plan: AtomPlan
    groups: UnequalGroups
    bucket_bytes: int
    ledger: object = None

    def make(self, sync_dtype: str = "fp32", error_feedback: bool = False,
             fragment: Optional[Tuple[int, int]] = None) -> AtomAverager:
        """The averager of fragment `fragment` = (index, count), or of the whole model."""
        window = fragment_windows(self.plan, fragment[1])[fragment[0]] if fragment and fragment[1] > 1 else None
        g = self.groups
        return AtomAverager(self.plan, g.rank, g.atoms, replica_group=g.exchange_replica or g.replica,
                            bucket_bytes=self.bucket_bytes,
                            ledger=self.ledger, peer_tier=g.tier("peer"), replica_tier=g.tier("replica"),
                            sync_dtype=sync_dtype, error_feedback=error_feedback, window=window)

    def views(self, shards: list, fragments: int) -> list:
        """`shards` (one flat shard per tensor) cut into the fragments' views, the same elements in
        every group."""
        if fragments == 1:
            return [list(shards)]
        return [window_views(self.plan, self.groups.rank, shards, w) for w in fragment_windows(self.plan, fragments)]


def atom_averaging(groups: UnequalGroups, backend, bucket_bytes: int, ledger=None) -> AtomAveraging:
    """This rank's averaging of `backend`'s shards, tensor by tensor (`TensorShards`), over the atom
    plan of its cut (`atom_cut`; collective over the world: it makes the plan's communicators)."""
    cut = getattr(backend, "atom_cut", None)
    if cut is None or not hasattr(backend, "atom_shards"):
        raise ValueError("this backend cannot average groups of unequal size: it does not say how it cuts its "
                         "parameters (atom_cut)")
    rule, shapes = cut()
    ranges = backend.atom_ranges() if rule == "ranges" else None
    return AtomAveraging(plan_shards(groups, shapes, rule, ranges=ranges), groups, bucket_bytes, ledger)
