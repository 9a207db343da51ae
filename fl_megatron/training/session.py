"""One world as the training loop sees it: every group in one job, meeting at syncs, evaluations
and the end. The training loop asks its session what differs from elastic mode
(fl_megatron/elastic/session.py, the same calls) instead of asking which mode it runs in."""

from datetime import timedelta
from typing import Optional

import torch

from ..config import ResolvedRun
from ..federation import SyncResult, build_process_groups
from ..federation.unequal_groups import build_unequal_groups
from ..group_layout import GroupLayout


class OneWorldSession:
    """The default session: nothing to join, nothing to record about membership."""

    joined_sync: Optional[SyncResult] = None

    def __init__(self, run: ResolvedRun, env) -> None:
        self.run, self.env = run, env
        self.groups = None

    def process_groups(self, device_type: str, timeout: timedelta):
        """Every group of the job (collective over the job), with the exchange's own communicators
        where a sync may run in the background (an overlap, or --fl-tune's trial of one)."""
        cfg = self.run.cfg
        fed = cfg.federation
        if isinstance(self.run.layout, GroupLayout):  # groups of unequal size: no rectangular mesh
            self.groups = build_unequal_groups(self.run.layout, device_type, timeout,
                                               async_checkpoint=cfg.checkpoint.async_save,
                                               exchange=bool(fed.overlap_steps))
            return self.groups
        self.groups = build_process_groups(self.run.layout, device_type, timeout,
                                           exchange=bool(fed.overlap_steps) or (fed.tune and fed.tune_overlap),
                                           async_checkpoint=cfg.checkpoint.async_save)
        return self.groups

    def link_probe_scope(self) -> Optional[str]:
        """What the start-up link probe covers: every tier ("job") in a federated run that syncs,
        unless turned off (None)."""
        fed, layout = self.run.cfg.federation, self.run.layout
        # groups of unequal size have no peer group for the probe to time (docs/heterogeneous.md)
        probes = layout.is_federated and fed.syncing and fed.link_probe and not isinstance(layout, GroupLayout)
        return "job" if probes else None

    def join(self, backend, engine, loaded: int, start_step: int, tuner=None, rounds=None) -> int:
        """Every group starts together: the step to start from is the one resumed."""
        return start_step

    def at_step(self, done: int) -> None:
        """Nothing to keep per step."""

    def after_sync(self, sync: SyncResult) -> None:
        """Nothing to record about who met: every group always does."""

    def healed_step(self, sync: Optional[SyncResult]) -> Optional[int]:
        """No group falls behind in one world."""
        return None

    def record_fields(self, sync: Optional[SyncResult]) -> dict:
        return {}

    def evaluation_share(self) -> tuple[int, int]:
        """(rank, ranks) the held-out set is split over: every rank of the job."""
        return self.env.rank, self.env.world_size

    def reduce_evaluation(self, loss: torch.Tensor) -> None:
        self.groups.all_reduce_job(loss)  # an evaluation is a meeting of the groups

    def losses_cross_groups(self) -> bool:
        """Whether a final train loss is averaged over the groups (federated runs)."""
        return self.run.layout.is_federated

    def summary(self) -> dict:
        return {}

    def exports(self) -> bool:
        return True
