"""The process groups of one rank when federation groups differ in size (one world).

No rectangular (F, P, S) mesh exists, so every rank creates every group's shard, replica and
federation communicators with `new_group`, in one common order (torch names groups by a count
and connects only their members), and builds its own sharding mesh from its group's
communicators (`DeviceMesh.from_group`). Across groups there is no peer group: shards are
averaged over the atom communicators of an `AtomPlan` (atom_average.py), and the vote and the
job-wide reductions run over the leaders, the first rank of every group.
"""

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..atom_plan import AtomPlan, plan_for_shapes
from ..group_layout import GroupLayout
from ..topology import MESH_DIM_NAMES
from .atom_average import AtomAverager, build_atom_groups
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
        return False

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
                         async_checkpoint: bool = False) -> UnequalGroups:
    """Create every group's communicators on every rank (collective over the world: all ranks
    call it with the same layout) and this rank's sharding mesh (1-D shard for FSDP, 2-D
    (replica, shard) for HSDP). `async_checkpoint`: also a gloo copy of every group for
    background checkpoint writes. The atom communicators come later (`plan_shards`), once the
    backend's shards are known."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call init_process_group first")
    if dist.get_world_size() != layout.world_size:
        raise ValueError(f"the groups hold {layout.world_size} ranks but the job has {dist.get_world_size()}")
    rank = dist.get_rank()
    federation = shard = replica = None
    for g in layout.groups:
        made = dist.new_group(list(range(g.first_rank, g.first_rank + g.size)), timeout=timeout)
        federation = made if g.first_rank <= rank < g.first_rank + g.size else federation
        if g.replicas > 1:
            for r in range(g.replicas):
                members = [g.rank(r, s) for s in range(g.shard_size)]
                made = dist.new_group(members, timeout=timeout)
                shard = made if rank in members else shard
            for s in range(g.shard_size):
                members = [g.rank(r, s) for r in range(g.replicas)]
                made = dist.new_group(members, timeout=timeout)
                replica = made if rank in members else replica
    mine = layout.groups[layout.group_of(rank)]
    leaders = dist.new_group([g.first_rank for g in layout.groups], timeout=timeout)
    checkpoint = None
    if async_checkpoint:
        for g in layout.groups:
            made = dist.new_group(list(range(g.first_rank, g.first_rank + g.size)), timeout=timeout, backend="gloo")
            checkpoint = made if g.first_rank <= rank < g.first_rank + g.size else checkpoint
    if mine.replicas > 1:
        grid = torch.tensor([[mine.rank(r, s) for s in range(mine.shard_size)] for r in range(mine.replicas)])
        mesh = DeviceMesh.from_group([replica, shard], device_type, mesh=grid, mesh_dim_names=MESH_DIM_NAMES[1:])
    else:
        mesh = DeviceMesh.from_group(federation, device_type, mesh_dim_names=MESH_DIM_NAMES[2:])
    return UnequalGroups(layout=layout.seen_from(rank), rank=rank, mesh=mesh, shard_mesh=mesh, federation=federation,
                         checkpoint=checkpoint, whole=layout, replica_group=replica, leaders=leaders, timeout=timeout)


def plan_shards(groups: UnequalGroups, shapes: Sequence[Sequence[int]], rule: str = "fsdp2",
                timeout: Optional[timedelta] = None) -> AtomPlan:
    """The atom plan of tensors of `shapes` (the model's parameters, in its order) cut by the
    backend's `rule`, with this rank's atom communicators made into `groups.atoms`
    (collective over the world, as `build_unequal_groups`)."""
    plan = plan_for_shapes(groups.whole.groups, shapes, rule)
    groups.atoms = build_atom_groups(plan, groups.rank, timeout=timeout if timeout is not None else groups.timeout)
    return plan


def atom_averagers(groups: UnequalGroups, backend, bucket_bytes: int,
                   ledger=None) -> Callable[[str, bool], AtomAverager]:
    """What makes this rank's averagers of `backend`'s shards, tensor by tensor (`TensorShards`),
    over the atom plan of its cut (`atom_cut`; collective over the world: it makes the plan's
    communicators)."""
    cut = getattr(backend, "atom_cut", None)
    if cut is None or not hasattr(backend, "atom_shards"):
        raise ValueError("this backend cannot average groups of unequal size: it does not say how it cuts its "
                         "parameters (atom_cut)")
    rule, shapes = cut()
    plan = plan_shards(groups, shapes, rule)
    return lambda sync_dtype="fp32", error_feedback=False: AtomAverager(
        plan, groups.rank, groups.atoms, replica_group=groups.replica, bucket_bytes=bucket_bytes, ledger=ledger,
        peer_tier=groups.tier("peer"), replica_tier=groups.tier("replica"), sync_dtype=sync_dtype,
        error_feedback=error_feedback)
