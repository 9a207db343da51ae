"""The process groups of one rank in elastic mode when the groups differ in size: its own job's
groups (built as for an equal group of its size), the atom communicators of each quorum
(quorum_atoms.py) and the leaders' quorum (group_quorum.py) instead of a peer group."""

from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ..atom_plan import AtomPlan
from ..federation.failed_collective import call_directly
from ..federation.unequal_groups import UnequalGroups
from ..group_layout import GroupLayout
from ..topology import Layout
from .group_quorum import GroupQuorum
from .groups import ElasticMembership, build_elastic_process_groups
from .quorum_atoms import QuorumAtoms


@dataclass
class ElasticUnequalGroups(ElasticMembership, UnequalGroups):
    """`UnequalGroups` whose groups are separate jobs: `whole` is the federation's layout (ranks
    are federation ranks), every communicator below the quorum is this job's own. The engine
    plans its atoms at start-up (`atom_communicators`); they are made at each quorum."""

    quorum: Optional[GroupQuorum] = None
    quorum_atoms: Optional[QuorumAtoms] = None

    @property
    def peer(self) -> Optional[dist.ProcessGroup]:
        """The quorum's group over the live groups' leaders, on this group's leader (None elsewhere)."""
        return self.quorum.leaders if self.quorum is not None else None

    def tier(self, kind: str) -> str:
        """The atoms join separate jobs: 'inter-node'; inside the job as `UnequalGroups` says."""
        return "inter-node" if kind == "peer" else super().tier(kind)

    def atom_communicators(self, plan: AtomPlan, timeout: Optional[timedelta] = None) -> dict:
        """This rank's communicators of `plan`: a mapping each quorum fills anew (empty until the
        first meeting; no collective here)."""
        backend = "nccl" if self.device_type == "cuda" else "gloo"
        self.quorum_atoms = QuorumAtoms(plan, self.rank, backend, timeout or self.timeout or timedelta(minutes=10))
        return self.quorum_atoms.communicators

    def _quorum_keeper(self) -> GroupQuorum:
        return self.quorum

    def reduce_across_groups(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, call=call_directly) -> None:
        self.quorum.reduce_across_groups(tensor, op, call)


def build_elastic_unequal_groups(whole: GroupLayout, rank: int, device_type: str,
                                 timeout: Optional[timedelta] = None, async_checkpoint: bool = False
                                 ) -> ElasticUnequalGroups:
    """This job's groups (collective over the job) for federation rank `rank` of `whole`."""
    group = whole.groups[whole.group_of(rank)]
    local = Layout(group.size, group.size, group.size, group.shard_size)
    own = build_elastic_process_groups(local, rank - group.first_rank, device_type, None, timeout,
                                       async_checkpoint=async_checkpoint)
    return ElasticUnequalGroups(layout=whole.seen_from(rank), rank=rank, mesh=own.mesh, shard_mesh=own.shard_mesh,
                                federation=own.federation, checkpoint=own.checkpoint, whole=whole,
                                replica_group=own.replica if local.is_hsdp else None, timeout=timeout)
