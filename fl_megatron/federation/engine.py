"""The federation engine: after each optimizer step, decide whether to sync and do it."""

import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..config.parallel import FederationConfig
from .averaging import ShardAverager, SyncStats
from .contract import ShardOwner
from .groups import ProcessGroups
from .ledger import CommLedger
from .schedule import sync_due


@dataclass
class SyncResult:
    """One sync as seen by this rank (variance and rms are over all ranks)."""

    step: int
    seconds: float
    inter_group_bytes: int
    intra_group_bytes: int
    variance: float     # mean over parameter elements of the variance across groups (sampled)
    param_rms: float    # root mean square of the averaged parameters (same sample)


class FederationEngine:
    """Averages the backend's local shards across federation groups every H steps and at the end."""

    def __init__(self, backend: ShardOwner, groups: ProcessGroups, config: FederationConfig,
                 ledger: Optional[CommLedger] = None) -> None:
        self.backend = backend
        self.groups = groups
        self.config = config
        self.ledger = ledger if ledger is not None else CommLedger()
        layout = groups.layout
        _, replica_index, _ = groups.coords
        self.averager = ShardAverager(
            groups.peer, layout.num_groups,
            replica_group=groups.replica if layout.is_hsdp else None, replicas=layout.replicas,
            replica_index=replica_index, replica_split=config.replica_split,
            bucket_bytes=int(config.bucket_mb * (1 << 20)), ledger=self.ledger,
            peer_tier=groups.tier("peer"), replica_tier=groups.tier("replica"))
        self.last_synced_step = 0

    @property
    def active(self) -> bool:
        """Whether this run averages at all (several groups, syncing enabled)."""
        return self.groups.layout.is_federated and self.config.syncing

    def after_step(self, step: int, last: bool = False) -> Optional[SyncResult]:
        """Call after optimizer step `step` (1-based); syncs when due and returns what it did."""
        interval = self.config.sync_interval if self.config.syncing else 0
        if not sync_due(step, interval, last, self.groups.layout.is_federated):
            return None
        return self.sync(step)

    def sync(self, step: int) -> SyncResult:
        """Average now (collective over all ranks)."""
        start = time.perf_counter()
        stats = self.averager.average(self.backend.local_shards())
        self.backend.refresh_after_sync()
        seconds = time.perf_counter() - start
        self.last_synced_step = step
        variance, rms = self._global_metrics(stats)
        return SyncResult(step, seconds, stats.inter_group_bytes, stats.intra_group_bytes, variance, rms)

    def _global_metrics(self, stats: SyncStats) -> tuple[float, float]:
        """Variance across groups and parameter rms, pooled over every rank's sample."""
        totals = torch.tensor([stats.sq_dev_sum, stats.sq_mean_sum, float(stats.samples)],
                              dtype=torch.float64, device=self.groups.mesh.device_type)
        dist.all_reduce(totals)
        sq_dev, sq_mean, count = totals.tolist()
        if count == 0:
            return 0.0, 0.0
        return sq_dev / count, (sq_mean / count) ** 0.5
