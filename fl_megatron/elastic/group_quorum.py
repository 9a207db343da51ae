"""Elastic mode for groups of unequal size: one torchft Manager per group, on its first rank.

torchft's per-rank Managers pair rank k of every group, which groups of unequal size do not
have. Here only each group's first rank (its leader) runs a Manager, so the lighthouse sees one
replica per group and the quorum's process group joins the leaders: the vote and the job-wide
sums run over it and are broadcast into each group. After each quorum the leader tells its group
who met, who healed and where the quorum's store is; every rank then makes its atom
communicators for the live groups on that store (quorum_atoms.py), and a group that healed takes
its state from a live group atom by atom (heal_across_sizes.py). A sync commits where torchft's
vote on the leader says so, and the leader tells its group.
"""

import pickle
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ..federation.failed_collective import PeerLatch, call_directly, has_failed
from ..federation.membership import Membership, TooFewGroups
from .heal_across_sizes import HealAcrossSizes
from .peer_tier import ElasticPeerTier
from .quorum_atoms import QuorumAtoms


class LeaderLost(RuntimeError):
    """The group's first rank saw a peer lost in a cross-group collective (the words make it a
    failed collective to failed_collective.is_failed_collective, so the sync's latch takes it)."""


class GroupQuorum:
    """One rank's view of its group's quorum; `tier` is the leader's torchft tier (None on the
    group's other ranks), `job` the group's own process group."""

    def __init__(self, job: dist.ProcessGroup, tier: Optional[ElasticPeerTier], atoms: QuorumAtoms,
                 heal: HealAcrossSizes, device: torch.device, store, wait: timedelta, watch=None) -> None:
        """`store`: the group's own store, where the leader posts each meeting's news (the others
        may wait for it as long as a quorum takes, `wait`, longer than a collective's timeout);
        `watch`: the other ranks' WaitWatch (the leader's is its tier's)."""
        self.job, self.tier, self.atoms, self.heal, self.device = job, tier, atoms, heal, device
        self.store, self.wait, self.watch = store, wait, watch
        self.meetings = 0

    @property
    def is_leader(self) -> bool:
        return self.tier is not None

    @property
    def leaders(self) -> Optional[dist.ProcessGroup]:
        """The current quorum's group over the live groups' leaders (on the leader; None elsewhere)."""
        return self.tier.group if self.is_leader and self.tier.has_quorum else None

    def meet(self) -> Membership:
        """Form this sync's quorum (the leader, through torchft) and tell the group; make the atom
        communicators of the live groups; copy a healing group's state to it. Collective over the
        group, and across groups over the leaders and the atoms."""
        start = time.perf_counter()
        key = f"fl_megatron/group_quorum/{self.meetings}"
        self.meetings += 1
        if self.is_leader:
            self.store.set(key, pickle.dumps(self._leader_meets()))
            if self.meetings > 1:  # every rank read the previous post before the group's next collective
                self.store.delete_key(f"fl_megatron/group_quorum/{self.meetings - 2}")
        else:
            self.store.wait([key], self.wait)
        told = pickle.loads(self.store.get(key))
        if "error" in told:
            kind = TooFewGroups if told["too_few"] else RuntimeError
            raise kind(told["error"])
        membership: Membership = told["membership"]
        self.atoms.build(membership.quorum_id, membership.groups, told["store"])
        healing = tuple(told["healing"])
        if healing:
            source = min(g for g in membership.groups if g not in healing)
            self.heal.take_part(source, healing, membership.groups, told["taken"])
        if not self.is_leader:  # the group's wait, as the leader saw it, plus the copy
            membership = Membership(membership.quorum_id, membership.groups, membership.rank, membership.healed,
                                    time.perf_counter() - start + membership.seconds)
        return membership

    def _leader_meets(self) -> dict:
        """The leader's part of `meet`: torchft's quorum, then which groups healed (one sum over
        the leaders). Failures become news for the group, which raises them alike on every rank."""
        try:
            membership = self.tier.meet()
            flags = torch.zeros(max(membership.groups) + 1, dtype=torch.int64, device=self.device)
            flags[membership.groups[membership.rank]] = int(membership.healed)
            latch = PeerLatch(self.tier.deadline())  # bounded on NCCL too, where a lost peer raises nothing
            latch(dist.all_reduce, flags, group=self.tier.group)
            if latch.settle() is not None:
                raise RuntimeError(f"a peer was lost right after the quorum formed: {latch.error}")
            healing = [g for g, f in enumerate(flags.tolist()) if f]
            if healing and len(healing) == len(membership.groups):
                raise RuntimeError(f"every live group ({', '.join(map(str, membership.groups))}) healed at once: "
                                   "none is left to heal from")
            taken, self.heal.pending = self.heal.pending, None
            return {"membership": membership, "healing": healing, "store": self.tier.quorum_store,
                    "taken": taken if membership.healed else None}
        except TooFewGroups as e:
            return {"error": str(e), "too_few": True}
        except Exception as e:  # noqa: BLE001 - told to the group, raised there on every rank
            return {"error": f"elastic: the group's first rank could not meet the others: {type(e).__name__}: {e}",
                    "too_few": False}

    def reduce_across_groups(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, call=call_directly) -> None:
        """Reduce `tensor`, the same on every rank of the group, across the live groups: over the
        leaders (through `call`), then from the leader to its group with whether that failed; a
        failure seen by the leader is raised through `call` on the others, so every rank of the
        group skips the sync's later cross-group collectives alike."""
        failed = torch.zeros(1, dtype=tensor.dtype, device=tensor.device)
        if self.is_leader:
            call(dist.all_reduce, tensor, op=op, group=self.leaders)
            failed.fill_(float(has_failed(call)))
        both = torch.cat([tensor.reshape(-1), failed])
        dist.broadcast(both, group_src=0, group=self.job)
        if not self.is_leader:
            tensor.copy_(both[:-1].view_as(tensor))
            if both[-1] > 0:
                call(_raise_leader_lost)

    def commit(self) -> bool:
        """torchft's vote on the leader (the group agreed on its ranks' errors before: the sync's
        transaction reported them to `report_error` on every rank), told to the group."""
        decision = torch.zeros(1, dtype=torch.int64, device=self.device)
        if self.is_leader:
            decision.fill_(int(self.tier.commit()))
        dist.broadcast(decision, group_src=0, group=self.job)
        return bool(decision.item())

    def report_error(self, error: Exception) -> None:
        if self.is_leader:
            self.tier.report_error(error)

    def deadline(self):
        """The leader's bound on its cross-group collectives (NCCL); the atom communicators' own
        timeouts bound the rest."""
        return self.tier.deadline() if self.is_leader else None

    def close(self) -> None:
        self.atoms.close()
        if self.is_leader:
            self.tier.close()
        elif self.watch is not None:
            self.watch.close()


def _raise_leader_lost() -> None:
    raise LeaderLost("the group's first rank lost a peer in the sync's vote (a connection to a peer group was "
                     "lost, or timed out)")
