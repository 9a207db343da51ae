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
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist


@dataclass
class FederationGroups:
    """This rank's place in the federation."""

    num_groups: int                  # F
    replicas: int                    # P (replicas per federation group)
    group_index: int                 # f: this rank's federation group
    replica_index: int               # p: this rank's instance inside its federation group
    peer_group: object               # size F: same shard position in every federation group
    replica_group: Optional[object]  # size P: the replicas of this shard in this group (None if P = 1)
    peer_ranks: list
    replica_ranks: list


def _instance_index() -> int:
    """This rank's distributed-optimizer instance (0 .. N-1) inside its data-parallel group."""
    from megatron.core import parallel_state as ps

    rank = ps.get_data_parallel_rank(with_context_parallel=True)
    size = ps.get_data_parallel_world_size(with_context_parallel=True, partial_data_parallel=True)
    return rank // size


def build_federation_groups(num_groups: int) -> FederationGroups:
    """Split megatron's inter-instance groups into replica and peer groups (collective: every
    rank creates every group, in the same order)."""
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
    peer_group, _ = dist.new_subgroups_by_enumeration(sorted(map(list, peer_lists)))
    replica_group = None
    if replicas > 1:
        replica_group, _ = dist.new_subgroups_by_enumeration(sorted(map(list, replica_lists)))
    own = instance[dist.get_rank()]
    groups = FederationGroups(
        num_groups=num_groups, replicas=replicas, group_index=own // replicas, replica_index=own % replicas,
        peer_group=peer_group, replica_group=replica_group,
        peer_ranks=dist.get_process_group_ranks(peer_group),
        replica_ranks=dist.get_process_group_ranks(replica_group) if replica_group else [dist.get_rank()])
    if replica_group is not None and dist.get_rank(replica_group) != groups.replica_index:
        raise RuntimeError(f"rank {dist.get_rank()} is replica {groups.replica_index} of its federation group but "
                           f"rank {dist.get_rank(replica_group)} of the replica group {groups.replica_ranks}")
    return groups


def _bucket_groups(chunk) -> list:
    return list(chunk.bucket_groups) + list(chunk.expert_parallel_bucket_groups)


def gate_gradient_reduction(model_chunks: list, groups: FederationGroups) -> None:
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
