"""Commit or roll back: how a blocking sync ends. The groups object chooses (`ProcessGroups.
transaction`): in one world a sync always stands (a failed collective raised and ends the job);
in elastic mode torchft's commit may vote it down, and then every rank restores what it had.

Either way the transaction also agrees the sync's metric sums over whom it spans, with the
collective it needs anyway: one world reduces them over the job (inside the group, then over the
peer group); elastic mode over the group only, beside the error flag that decides the commit.
"""

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..faults import commit_refused
from .contract import ShardOwner
from .failed_collective import PeerLatch, call_directly
from .rollback import HostBackup, host_backup
from .sync_state import SyncState


@dataclass(frozen=True)
class Verdict:
    """How the sync ended: kept or not, and its metric sums agreed (None: not asked for)."""

    committed: bool
    totals: Optional[list] = None


class OneWorldTransaction:
    """One world: nothing to undo; the sums are reduced over the job, where asked for (otherwise
    the next vote carries them: `carries_metrics`)."""

    peer_call: Callable = staticmethod(call_directly)
    carries_metrics = True  # a sync's metric sums may wait for the next vote (no round of their own)

    def __init__(self, groups) -> None:
        self.groups = groups

    def begin(self) -> None:
        """Before the sync's first collective: nothing to keep."""

    def keep_shards(self) -> None:
        """Before the sync changes the shards: nothing to keep."""

    def keep_inner_state(self) -> None:
        """Before the sync changes the inner optimizer's state: nothing to keep."""

    def conclude(self, step: int, sums: Optional[list], device) -> Verdict:
        if sums is None:
            return Verdict(True)
        totals = torch.tensor(sums, dtype=torch.float64, device=device)
        self.groups.all_reduce_job(totals)
        return Verdict(True, totals.tolist())


class RollbackTransaction:
    """A sync the live groups may vote down (elastic mode). Every peer collective goes through the
    sync's PeerLatch: the first that fails (a peer lost midway) is remembered and the later ones are
    skipped, while the in-group ones (HSDP's replica gathers) go on, so every rank of the group
    makes the same in-group calls. Then one more, the error flag and the metric sums over the group,
    tells the group whether any of its ranks failed; then torchft's commit. Voted down: the shards,
    the sync state and (where the sync changed it) the inner optimizer's state are restored from
    host copies taken before the sync (one more fp32 copy of the shards in host memory while it
    runs, and of the optimizer's state with --fl-inner-state average or in a sick group)."""

    carries_metrics = False  # the sums ride on the commit's in-group round, at once

    def __init__(self, groups, backend: ShardOwner, state: SyncState) -> None:
        self.groups, self.backend, self.state = groups, backend, state
        self.latch = PeerLatch(groups.peer_deadline())
        self.backup: Optional[HostBackup] = None
        self.inner: Optional[list] = None  # the inner optimizer's state, if the sync changes it

    @property
    def peer_call(self) -> PeerLatch:
        return self.latch

    def begin(self) -> None:
        """Before the sync's first collective (an overlapped sync's launch): the sync state."""
        self.backup = host_backup(self.state.state_tensors())
        self.inner = None

    def keep_shards(self) -> None:
        """Before the sync changes the shards (a blocking sync: at once; an overlapped one: at its
        landing, after the steps trained meanwhile)."""
        self.backup.keep_shards(self.backend.local_shards())

    def keep_inner_state(self) -> None:
        """Before the sync averages or resets the inner optimizer's state (--fl-inner-state
        average, a sick group): a host copy of all of it, step counts included (what a healing
        group receives), once per sync."""
        if self.inner is None:
            self.inner = [t.detach().to("cpu", copy=True) for t in self.backend.optimizer_transfer_state()]

    def conclude(self, step: int, sums: Optional[list], device) -> Verdict:
        failed = self.latch.settle()  # a peer lost or hung during the sync's collectives: the later ones were skipped
        agreed = torch.tensor([float(failed is not None), *(sums or [])], dtype=torch.float64, device=device)
        dist.all_reduce(agreed, group=self.groups.federation)
        if agreed[0] > 0:  # this rank's peers or a group mate's: the group votes the sync down
            self.groups.report_error(failed or RuntimeError(f"a rank of this group lost a peer in the sync of "
                                                            f"step {step}"))
        elif commit_refused(self.groups.coords[0], step):  # a test's split commit (FL_MEGATRON_FAULT)
            self.groups.report_error(RuntimeError(f"injected: group {self.groups.coords[0]} votes down the sync "
                                                  f"of step {step}"))
        if not self.groups.commit():
            self.restore()
            return Verdict(False)
        if failed is not None:
            raise RuntimeError(f"the sync of step {step} failed on this rank but was committed") from failed
        return Verdict(True, agreed[1:].tolist() if sums is not None else None)

    def restore(self) -> None:
        """The shards, the sync state and the inner optimizer's state as they were before the
        sync, and what derives from them."""
        shards = self.backend.local_shards()
        device = shards[0].device if shards else "cpu"
        self.backup.restore(shards, lambda saved: self.state.load_state_tensors(
            {k: v.to(device) for k, v in saved.items()}))
        if self.inner is not None:
            self.backend.load_optimizer_transfer_state(self.inner)
        self.backend.refresh_after_sync()
