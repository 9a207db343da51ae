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
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..atom_plan import AtomPlan, plan_for_shapes
from ..group_layout import GroupLayout
from ..topology import MESH_DIM_NAMES
from .atom_average import build_atom_groups


@dataclass
class UnequalGroups:
    """A rank's view of a layout of unequal groups."""

    layout: GroupLayout
    rank: int
    shard_mesh: DeviceMesh
    federation: dist.ProcessGroup  # every rank of this rank's group
    replica: Optional[dist.ProcessGroup]  # the HSDP replicas of this rank's shard (None: FSDP)
    leaders: dist.ProcessGroup  # the first rank of every group
    atoms: Dict[Tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)  # by owner tuple
    checkpoint: Optional[dist.ProcessGroup] = None

    @property
    def group(self) -> int:
        return self.layout.group_of(self.rank)

    @property
    def is_leader(self) -> bool:
        return self.rank == self.layout.groups[self.group].first_rank

    def all_reduce_job(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        """Reduce `tensor` over every rank of the job in place without a world collective: inside
        the group, across the leaders, then from the leader back to its group."""
        dist.all_reduce(tensor, op=op, group=self.federation)
        if self.layout.num_groups > 1:
            if self.is_leader:
                dist.all_reduce(tensor, op=op, group=self.leaders)
            dist.broadcast(tensor, group_src=0, group=self.federation)


def build_unequal_groups(layout: GroupLayout, device_type: str,
                         timeout: Optional[timedelta] = None) -> UnequalGroups:
    """Create every group's communicators on every rank (collective over the world: all ranks
    call it with the same layout) and this rank's sharding mesh (1-D shard for FSDP, 2-D
    (replica, shard) for HSDP)."""
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
    if mine.replicas > 1:
        grid = torch.tensor([[mine.rank(r, s) for s in range(mine.shard_size)] for r in range(mine.replicas)])
        mesh = DeviceMesh.from_group([replica, shard], device_type, mesh=grid, mesh_dim_names=MESH_DIM_NAMES[1:])
    else:
        mesh = DeviceMesh.from_group(federation, device_type, mesh_dim_names=MESH_DIM_NAMES[2:])
    return UnequalGroups(layout, rank, mesh, federation, replica, leaders)


def plan_shards(groups: UnequalGroups, shapes: Sequence[Sequence[int]], rule: str = "fsdp2",
                timeout: Optional[timedelta] = None) -> AtomPlan:
    """The atom plan of tensors of `shapes` (the model's parameters, in its order) cut by the
    backend's `rule`, with this rank's atom communicators made into `groups.atoms`
    (collective over the world, as `build_unequal_groups`)."""
    plan = plan_for_shapes(groups.layout.groups, shapes, rule)
    groups.atoms = build_atom_groups(plan, groups.rank, timeout=timeout)
    return plan
