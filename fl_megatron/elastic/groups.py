"""The process groups of one rank in elastic mode: its own job is one federation group (the shard
and replica groups live in it), the peer group is the current quorum's torchft group."""

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist

from ..config.parallel import FederationConfig
from ..federation.groups import ProcessGroups, build_process_groups
from ..federation.membership import Membership
from ..federation.transaction import RollbackTransaction
from ..topology import Layout, replica_groups
from .peer_tier import ElasticPeerTier
from .refusal import Refusal
from .signature import Signature
from .waiting import WaitWatch


class ElasticMembership:
    """Elastic mode's membership calls (the engine's meet before each sync and commit after it),
    passed to what keeps this rank's quorum (`_quorum_keeper`): a sync the live groups may vote
    down, every rank restoring what it had (transaction.py)."""

    def _quorum_keeper(self):
        raise NotImplementedError

    def transaction(self, backend, state) -> RollbackTransaction:
        return RollbackTransaction(self, backend, state)

    def meet(self) -> Membership:
        return self._quorum_keeper().meet()

    def commit(self) -> bool:
        return self._quorum_keeper().commit()

    def report_error(self, error: Exception) -> None:
        self._quorum_keeper().report_error(error)

    def peer_deadline(self):
        """The time bound of one sync's cross-group collectives (elastic/peer_deadline.py)."""
        return self._quorum_keeper().deadline()


@dataclass
class ElasticProcessGroups(ElasticMembership, ProcessGroups):
    """`ProcessGroups` whose layout is the whole federation (ranks and coordinates are federation
    ranks) while every group below the peer tier is built in this job's own world. The engine
    calls `meet` before each sync and `commit` after it, as in one world."""

    elastic_tier: Optional[ElasticPeerTier] = None

    def has_exchange_groups(self) -> bool:
        """The quorum's peer group passes between the threads (the training thread leaves it
        from an overlapped sync's launch to its landing, and torchft rebuilds it only at the next
        meeting); the HSDP replica gathers need a group of their own (`exchange=True`)."""
        return not self.layout.is_hsdp or self.exchange_replica is not None

    @property
    def peer(self) -> Optional[dist.ProcessGroup]:
        """The ranks holding this rank's shard position in the live groups of the current quorum
        (None before the first quorum: the engine binds its averagers at each sync's `meet`)."""
        tier = self.elastic_tier  # (None until the session joins it)
        return tier.group if tier is not None and tier.has_quorum else None

    def _quorum_keeper(self) -> ElasticPeerTier:
        return self.elastic_tier


def build_elastic_process_groups(layout: Layout, rank: int, device_type: str, tier: Optional[ElasticPeerTier],
                                 timeout: Optional[timedelta] = None, async_checkpoint: bool = False,
                                 exchange: bool = False) -> ElasticProcessGroups:
    """This job's groups (collective over the job) for federation rank `rank` of `layout`.
    `exchange`: also the HSDP replica group of an overlapped sync's background exchange."""
    if dist.get_world_size() != layout.group_size:
        raise ValueError(f"elastic mode: this job has {dist.get_world_size()} ranks but a federation group has "
                         f"{layout.group_size}; launch one group per job")
    local = Layout(layout.group_size, min(layout.ranks_per_node, layout.group_size), layout.group_size,
                   layout.shard_size)
    own = build_process_groups(local, device_type, timeout, async_checkpoint=async_checkpoint)
    exchange_replica = None
    if exchange and local.is_hsdp:
        exchange_replica, _ = dist.new_subgroups_by_enumeration(replica_groups(local), timeout=timeout)
    return ElasticProcessGroups(layout=layout, rank=rank, mesh=own.mesh, shard_mesh=own.shard_mesh,
                                federation=own.federation, checkpoint=own.checkpoint,
                                exchange_replica=exchange_replica, elastic_tier=tier)


def join_tier(fed: FederationConfig, job_rank: int, job_size: int, device_type: str, timeout: timedelta,
              state_dict: Callable[[], dict], load_state_dict: Callable[[dict], None],
              training_step: Callable[[], int], signature: Signature, say: Callable[[str], None],
              run_dir: Optional[str] = None, position: Optional[Callable[[], int]] = None,
              leader_only: bool = False):
    """This rank's torchft manager (collective over the job). Its group's manager server starts
    on rank 0 first: torchft publishes the server's address in the job's store, where a restarted
    job would otherwise find its previous attempt's address. `signature`: what the groups must
    agree on (refused at the first meeting otherwise, see waiting.py); `say`: the console;
    `position`: torchft's step (default: the training step). `leader_only` (groups of unequal
    size, group_quorum.py): one manager for the group, on rank 0; returns (its tier or None on the
    other ranks, this rank's WaitWatch)."""
    address = fed.lighthouse if "://" in fed.lighthouse else f"http://{fed.lighthouse}"
    store_addr, store_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])

    # every rank watches from here on, also while rank 0 alone reaches the lighthouse
    refusal = Refusal(store_addr, store_port, job_rank, job_size, run_dir,
                      os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    watch = WaitWatch(fed.lighthouse, fed.group_id, signature, job_rank, say, refusal)

    def tier() -> ElasticPeerTier:
        rank, size = (0, 1) if leader_only else (job_rank, job_size)
        return ElasticPeerTier(fed.group_id, rank, size, address, store_addr, store_port, fed.min_groups,
                               state_dict, load_state_dict, device_type, timeout=timeout,
                               quorum_timeout=timedelta(minutes=fed.quorum_timeout_minutes),
                               training_step=training_step, num_groups=fed.group_slots, watch=watch,
                               position=position,
                               replica_id=signature.replica_id(fed.group_id),
                               peer_timeout=timedelta(seconds=fed.peer_timeout_seconds))

    made = tier() if job_rank == 0 else None
    dist.barrier()
    if leader_only:
        return made, watch
    return made or tier()
