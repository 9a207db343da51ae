"""The process groups of one rank, built as a (federation, replica, shard) device mesh."""

from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .failed_collective import call_directly
from .membership import Membership, whole_federation
from .transaction import OneWorldTransaction
from ..topology import (MESH_DIM_NAMES, Layout, coords, federation_groups, mesh_shape, peer_groups, replica_groups,
                        shard_groups, spans_nodes)


@dataclass
class ProcessGroups:
    """A rank's view of the layout: the world mesh and the groups the engine and backends use."""

    layout: Layout
    rank: int
    mesh: DeviceMesh
    shard_mesh: DeviceMesh
    # every rank of this rank's federation group (the shard group itself unless HSDP)
    federation: dist.ProcessGroup
    # communicators of their own for a sync in flight (--fl-overlap-steps): the background
    # exchange's peer and HSDP replica groups, never shared with the training thread's collectives
    exchange_peer: Optional[dist.ProcessGroup] = None
    exchange_replica: Optional[dist.ProcessGroup] = None
    # a gloo group over the federation group for checkpoints written in the background
    # (--async-save): torch.distributed.checkpoint's writer thread plans and finishes over it
    checkpoint: Optional[dist.ProcessGroup] = None

    @property
    def device_type(self) -> str:
        """Where this rank's collectives run their tensors ('cuda' or 'cpu')."""
        return self.mesh.device_type

    @property
    def coords(self) -> tuple[int, int, int]:
        """(federation group, replica index, shard index) of this rank."""
        return coords(self.layout, self.rank)

    @property
    def peer(self) -> dist.ProcessGroup:
        """This rank and the ranks holding the same shard in every other federation group."""
        return self.mesh.get_group(MESH_DIM_NAMES[0])

    @property
    def replica(self) -> dist.ProcessGroup:
        """The HSDP replicas of this rank's shard inside its federation group."""
        return self.mesh.get_group(MESH_DIM_NAMES[1])

    def tier(self, kind: str) -> str:
        """'inter-node' if this rank's `kind` group ('peer', 'replica' or 'shard') spans nodes."""
        lists = {"peer": peer_groups, "replica": replica_groups, "shard": shard_groups}[kind](self.layout)
        mine = next(g for g in lists if self.rank in g)
        return "inter-node" if spans_nodes(self.layout, mine) else "intra-node"

    def has_exchange_groups(self) -> bool:
        """Whether a sync's exchange can run in the background: on communicators the training
        thread never uses (built with `exchange=True`)."""
        return self.exchange_peer is not None

    # --- membership: the same calls in one world and in elastic mode (elastic.groups) -------
    def transaction(self, backend, state) -> OneWorldTransaction:
        """How a blocking sync ends (transaction.py): in one world it always stands."""
        return OneWorldTransaction(self)

    def meet(self) -> Membership:
        """The groups that meet at this sync; in one world every group, at once."""
        return whole_federation(self.layout.num_groups, self.coords[0])

    def commit(self) -> bool:
        """Whether the sync that just ran may be kept; in one world a failed sync raised instead."""
        return True

    def report_error(self, error: Exception) -> None:
        """A collective of this sync failed; in one world the error ends the job (training.failures)."""
        raise error

    def reduce_across_groups(self, tensor, op=dist.ReduceOp.SUM, call=call_directly) -> None:
        """Reduce `tensor`, the same on every rank of each group, across the groups in place: over
        this rank's peer group (in elastic mode the quorum's), through `call`."""
        call(dist.all_reduce, tensor, op=op, group=self.peer)

    def all_reduce_job(self, tensor, op=dist.ReduceOp.SUM) -> None:
        """Reduce `tensor` over every rank of the job in place without a world collective: inside
        the federation group, then across groups over the peer group (one rank of each group).
        SUM, MAX and MIN give a world all-reduce's result; only at a sync, an evaluation or the end."""
        dist.all_reduce(tensor, op=op, group=self.federation)
        if self.layout.is_federated:
            dist.all_reduce(tensor, op=op, group=self.peer)


def _timeout_options(device_type: str, timeout: timedelta):
    """(backend, options) giving a mesh dimension's groups `timeout`: without them torch gives
    subgroups its default (30 min gloo, 10 min NCCL), not the job's --distributed-timeout-minutes.
    The job's own library: NCCL for CUDA ranks unless the job runs them on gloo."""
    if device_type == "cuda" and dist.get_backend() == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        backend, options = "nccl", dist.ProcessGroupNCCL.Options()
    else:
        backend, options = "gloo", dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return backend, options


def build_process_groups(layout: Layout, device_type: str, timeout: Optional[timedelta] = None,
                         exchange: bool = False, async_checkpoint: bool = False) -> ProcessGroups:
    """Create every group on every rank (collective: all ranks call it in the same order), each
    with `timeout` (None: torch's default for subgroups). `exchange`: also the background
    exchange's own peer and replica groups (a federated run with --fl-overlap-steps).
    `async_checkpoint`: also a gloo copy of the federation group for background checkpoint writes.

    The sharding mesh is 1-D (shard) for FSDP inside the group and 2-D (replica, shard) for HSDP.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call init_process_group first")
    if dist.get_world_size() != layout.world_size:
        raise ValueError(f"the layout is for {layout.world_size} ranks but the job has "
                         f"{dist.get_world_size()}")
    # a dimension spanning the whole job reuses the default group (and its timeout): no second communicator
    override = None if timeout is None else {
        name: _timeout_options(device_type, timeout)
        for name, size in zip(MESH_DIM_NAMES, mesh_shape(layout)) if size < layout.world_size} or None
    mesh = init_device_mesh(device_type, mesh_shape(layout), mesh_dim_names=MESH_DIM_NAMES, backend_override=override)
    shard_mesh = mesh[MESH_DIM_NAMES[1:]] if layout.is_hsdp else mesh[MESH_DIM_NAMES[2]]
    if layout.is_hsdp:
        federation, _ = dist.new_subgroups_by_enumeration(federation_groups(layout), timeout=timeout)
    else:
        federation = mesh.get_group(MESH_DIM_NAMES[2])
    exchange_peer = exchange_replica = None
    if exchange and layout.is_federated:
        exchange_peer, _ = dist.new_subgroups_by_enumeration(peer_groups(layout), timeout=timeout)
        if layout.is_hsdp:
            exchange_replica, _ = dist.new_subgroups_by_enumeration(replica_groups(layout), timeout=timeout)
    checkpoint = None
    if async_checkpoint:
        checkpoint, _ = dist.new_subgroups_by_enumeration(federation_groups(layout), timeout=timeout, backend="gloo")
    return ProcessGroups(layout=layout, rank=dist.get_rank(), mesh=mesh, shard_mesh=shard_mesh,
                         federation=federation, exchange_peer=exchange_peer, exchange_replica=exchange_replica,
                         checkpoint=checkpoint)
