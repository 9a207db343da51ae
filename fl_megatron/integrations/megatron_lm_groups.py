"""Federation groups carved out of Megatron-LM's partial distributed optimizer, and the gating of
its per-step cross-instance gradient all-reduce.

megatron's `parallel_state` (initialised with num_distributed_optimizer_instances = N) gives each
rank an inter-instance group: the N ranks holding the same optimizer-shard position, one per
instance. A federation group is P = N/F consecutive instances, so that group splits into
- the replica group: the P instances of this rank's federation group (gradients all-reduced
  every step; FL+HSDP), and
- the peer group: the same replica position in each of the F federation groups (fp32 shards
  averaged every H iterations).

Gating (runtime, megatron-core itself unchanged): each DDP bucket group gets a copy of the DDP
config with num_distributed_optimizer_instances = P and the replica group as its inter-instance
group, so `start_grad_sync` all-reduces over the replicas only (P > 1) or not at all (P = 1);
each bucket's gradient scaling becomes 1/(instance size * P) instead of 1/(N * instance size).
"""

import dataclasses
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from ..federation.groups import ProcessGroups
from ..topology import Layout, federation_groups, peer_groups, replica_groups


@dataclass
class MegatronLMGroups(ProcessGroups):
    """This rank's place in the federation, as the engine sees it (`ProcessGroups` without a
    device mesh: the groups are carved out of megatron's own, so no shard-group communicator is
    made twice). The layout is (F groups, P replicas, S = world/(F*P) ranks of one instance,
    tensor and pipeline ranks included); megatron's groups are checked to match it."""

    peer_group: Optional[dist.ProcessGroup] = None     # size F: same shard position in every group
    replica_group: Optional[dist.ProcessGroup] = None  # size P: this shard's replicas in this group
    device: str = "cpu"

    @property
    def peer(self) -> dist.ProcessGroup:
        return self.peer_group

    @property
    def replica(self) -> Optional[dist.ProcessGroup]:
        return self.replica_group

    @property
    def device_type(self) -> str:
        return self.device

    @property
    def num_groups(self) -> int:
        return self.layout.num_groups

    @property
    def replicas(self) -> int:
        return self.layout.replicas

    @property
    def group_index(self) -> int:
        return self.coords[0]

    @property
    def replica_index(self) -> int:
        return self.coords[1]

    @property
    def peer_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.peer_group)

    @property
    def replica_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self.replica_group) if self.replica_group else [self.rank]


def _instance_index() -> int:
    """This rank's distributed-optimizer instance (0 .. N-1) inside its data-parallel group."""
    from megatron.core import parallel_state as ps

    rank = ps.get_data_parallel_rank(with_context_parallel=True)
    size = ps.get_data_parallel_world_size(with_context_parallel=True, partial_data_parallel=True)
    return rank // size


def _layout(world: int, num_groups: int, replicas: int) -> Layout:
    """The (F, P, S) layout; nodes of LOCAL_WORLD_SIZE ranks (torchrun's) where they tile it,
    else one node (then every group reports its tier as intra-node)."""
    group = world // num_groups
    per_node = min(int(os.environ.get("LOCAL_WORLD_SIZE", world)), world)
    try:
        return Layout(world, per_node, group, group // replicas)
    except ValueError:
        return Layout(world, world, group, group // replicas)


def _checked(name: str, megatron_lists: set, expected: list) -> list[list[int]]:
    """Megatron's rank lists of one kind, which must be the layout's (same order on every rank)."""
    found = sorted(map(sorted, megatron_lists))
    if found != sorted(expected):
        raise RuntimeError(f"megatron's {name} groups {found} are not the blocks fl-megatron expects {expected}: "
                           "federation groups must be consecutive ranks (with PP > 1 add --use-tp-pp-dp-mapping)")
    return expected


def build_federation_groups(num_groups: int, exchange: bool = False, device_type: str = "cpu",
                            timeout: Optional[timedelta] = None) -> MegatronLMGroups:
    """Split megatron's inter-instance groups into replica and peer groups, and make the group of
    each federation group's ranks (collective: every rank creates every group, in the same
    order). `exchange`: also the peer and replica groups of a sync in flight (--fl-overlap-steps),
    communicators never used by the training thread."""
    from megatron.core import parallel_state as ps

    inter = ps.get_inter_distributed_optimizer_instance_group()
    n = inter.size()
    if num_groups < 2 or n % num_groups:
        raise ValueError(f"{num_groups} federation groups do not divide the {n} distributed-optimizer instances")
    replicas = n // num_groups
    mine = (dist.get_rank(), _instance_index(), tuple(dist.get_process_group_ranks(inter)))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    instance = {rank: idx for rank, idx, _ in everyone}
    replica_lists, peer_lists = set(), set()
    for members in {ranks for _, _, ranks in everyone}:
        ordered = sorted(members, key=instance.__getitem__)
        if [instance[r] for r in ordered] != list(range(n)):
            raise RuntimeError(f"megatron's inter-instance group {list(members)} does not hold one rank of each "
                               f"of the {n} instances (instances {[instance[r] for r in ordered]})")
        replica_lists.update(tuple(sorted(ordered[f * replicas:(f + 1) * replicas])) for f in range(num_groups))
        peer_lists.update(tuple(sorted(ordered[p::replicas])) for p in range(replicas))
    federation_lists = {tuple(r for r, idx in instance.items() if idx // replicas == f) for f in range(num_groups)}
    layout = _layout(len(everyone), num_groups, replicas)
    peers = _checked("peer", peer_lists, peer_groups(layout))
    replica_sets = _checked("replica", replica_lists, replica_groups(layout))
    members = _checked("federation", federation_lists, federation_groups(layout))

    def subgroups(lists):
        return dist.new_subgroups_by_enumeration(lists, timeout=timeout)[0]

    peer_group = subgroups(peers)
    replica_group = subgroups(replica_sets) if replicas > 1 else None
    federation = subgroups(members)
    exchange_peer = subgroups(peers) if exchange else None
    exchange_replica = subgroups(replica_sets) if exchange and replicas > 1 else None
    groups = MegatronLMGroups(layout=layout, rank=dist.get_rank(), mesh=None, shard_mesh=None, federation=federation,
                              exchange_peer=exchange_peer, exchange_replica=exchange_replica,
                              peer_group=peer_group, replica_group=replica_group, device=device_type)
    if instance[groups.rank] != groups.group_index * replicas + groups.replica_index:
        raise RuntimeError(f"rank {groups.rank} is in distributed-optimizer instance {instance[groups.rank]} but at "
                           f"(group {groups.group_index}, replica {groups.replica_index}) of the layout")
    return groups


def _bucket_groups(chunk) -> list:
    return list(chunk.bucket_groups) + list(chunk.expert_parallel_bucket_groups)


def gate_gradient_reduction(model_chunks: list, groups: MegatronLMGroups) -> None:
    """Make every DDP chunk reduce gradients inside the federation group only (see the module
    docstring). Idempotent; checks that the chunks were built with N = F*P instances."""
    n = groups.num_groups * groups.replicas
    for i, chunk in enumerate(model_chunks):
        config = chunk.ddp_config
        if not config.use_distributed_optimizer or config.num_distributed_optimizer_instances != n:
            raise ValueError(f"model chunk {i}: DDP was built with use_distributed_optimizer="
                             f"{config.use_distributed_optimizer} and {config.num_distributed_optimizer_instances} "
                             f"distributed-optimizer instances; the federation needs True and {n}")
        if chunk.expert_parallel_buffers:
            raise ValueError(f"model chunk {i} has expert-parallel parameters; they are not gated")
        gated = dataclasses.replace(config, num_distributed_optimizer_instances=groups.replicas)
        intra = chunk.intra_dp_cp_group.size()
        scale = 1.0 if config.average_in_collective else 1.0 / (intra * groups.replicas)
        for bucket_group in _bucket_groups(chunk):
            bucket_group.ddp_config = gated
            bucket_group.inter_distributed_optimizer_instance_group = groups.replica_group
        for buffer in chunk.buffers:
            buffer.gradient_scaling_factor = scale
            for bucket in buffer.buckets:
                bucket.gradient_scaling_factor = scale
