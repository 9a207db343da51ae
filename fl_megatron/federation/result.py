"""Report: what one sync did, as this rank saw it (`SyncResult`), built in one place for every kind
of sync (blocking, landed, voted down), with its bytes per network tier and its metrics."""

import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..costs import ring_volume, wire_volume
from .ada import Choice
from .averaging import SyncStats
from .consensus import Consensus
from .ledger import CommLedger
from .membership import Membership


@dataclass
class SyncResult:
    """One sync as seen by this rank (variance and rms are over all ranks)."""

    step: int
    seconds: float
    inter_group_bytes: int
    intra_group_bytes: int
    # mean over parameter elements of the variance across groups before the sync, and the rms of the
    # groups' parameters; None where the next sync's vote carries them (`carried` there; one world)
    variance: Optional[float]
    param_rms: Optional[float]
    sick_groups: tuple = ()  # groups left out of this average and reset to it
    graph: str = "complete"  # the communication graph of this sync (--fl-topology)
    consensus: Optional[Consensus] = None  # DBench metrics, measured before anything moved
    fragments: tuple = ()  # the fragments this sync moved (--fl-fragments; empty: every shard)
    membership: Optional[Membership] = None  # the groups that met (elastic mode: the live ones)
    joined: tuple = ()     # groups that healed at this sync: they received the average, sent nothing
    committed: bool = True  # False: the sync failed somewhere and every shard was restored (elastic mode)
    exchange_seconds: float = 0.0  # the exchange itself (blocking: `seconds`; overlapped: its time in the thread)
    wire_bytes_by_tier: dict = field(default_factory=dict)  # this rank's bytes on the wire per network tier
    landed: Optional["SyncResult"] = None  # an overlapped sync that landed first, at this step
    carried: Optional["Carried"] = None  # the previous sync's variance and rms, which this sync's vote carried


@dataclass(frozen=True)
class Carried:
    """A sync's variance and rms, agreed over the job in the next sync's vote."""

    step: int
    variance: float
    param_rms: float


class CarriedMetrics:
    """One world: the last sync's metric sums on this rank, until the next vote adds them up over
    the job (vote.take_vote's `carried`): a sync then makes no round of its own for its metrics."""

    def __init__(self) -> None:
        self.step: Optional[int] = None
        self.sums: Optional[list] = None

    def keep(self, step: int, sums: Optional[list]) -> None:
        """After sync `step`: its sums to carry, or None (its metrics were agreed at once)."""
        self.step, self.sums = (step, sums) if sums is not None else (None, None)

    def reported(self, vote) -> Optional[Carried]:
        """What `vote` carried of the kept sync's metrics (None: nothing)."""
        if vote is None or vote.carried_sums is None or self.step is None:
            return None
        return Carried(self.step, *variance_and_rms(vote.carried_sums))


def metric_sums(stats: SyncStats, shards: Optional[list] = None) -> list[float]:
    """This rank's (squared deviations, squares, sample count) of the sync's sample. With `shards`
    (an outer optimizer: the averaged values were pseudo-gradients, whose variance across groups is
    the parameters' since the anchors are equal) the squares are the new shards' mean square, weighted
    like the sample."""
    sq_mean = stats.sq_mean_sum
    if shards:
        elements = sum(s.numel() for s in shards)
        norms = torch.stack([torch.linalg.vector_norm(s, dtype=torch.float64) for s in shards])
        sq_mean = float(norms.pow(2).sum()) * stats.samples / max(1, elements)
    return [stats.sq_dev_sum, sq_mean, float(stats.samples)]


def variance_and_rms(totals: list) -> tuple[float, float]:
    """Variance across groups and parameter rms from summed (squared deviations, squares, count)."""
    sq_dev, sq_mean, count = totals
    if count == 0:
        return 0.0, 0.0
    return sq_dev / count, (sq_mean / count) ** 0.5


class ResultBuilder:
    """Builds every SyncResult of a rank: its bytes on the wire per tier, its metrics."""

    def __init__(self, groups, ledger: CommLedger, peer_tier: str, replica_tier: str) -> None:
        self.groups, self.ledger = groups, ledger
        self.peer_tier, self.replica_tier = peer_tier, replica_tier

    def build(self, step: int, start: float, stats: SyncStats, choice: Choice, sick: tuple,
              consensus: Optional[Consensus], fragments: tuple, totals: Optional[list],
              membership: Optional[Membership] = None, joined: tuple = (),
              carried: Optional[Carried] = None) -> SyncResult:
        """The result of a sync that stands. With DBench metrics (`consensus`) the bytes each group
        sent (an all-reduce at its ring size on the wire, the metric's sample too) go into the
        consensus record, collective over the job; without them `totals` (the agreed metric sums)
        give the variance, or (None) the next sync's vote will. `carried`: the previous sync's."""
        groups = self.groups.layout.num_groups
        wire = wire_volume(choice.graph, groups, stats.inter_group_bytes - stats.gathered_bytes) + \
            ring_volume("all_gather", stats.gathered_bytes * groups, groups)
        if consensus is None:
            variance, rms = variance_and_rms(totals) if totals is not None else (None, None)
        else:
            self.ledger.add("inter-group", self.peer_tier, consensus.sample_bytes)
            wire += wire_volume("complete", groups, consensus.sample_bytes)
            per_group = torch.zeros(groups, dtype=torch.float64, device=self.groups.device_type)
            per_group[self.groups.coords[0]] = wire
            self.groups.all_reduce_job(per_group)
            consensus.group_bytes = [int(b) for b in per_group.tolist()]
            variance = consensus.variance
            rms = (sum(n * n for n in consensus.group_norms) / groups / max(1.0, consensus.elements)) ** 0.5
        seconds = time.perf_counter() - start
        by_tier = {self.peer_tier: wire}
        replicas = self.groups.layout.replicas
        gathered = ring_volume("all_gather", stats.intra_group_bytes * replicas, replicas) if replicas > 1 else 0.0
        by_tier[self.replica_tier] = by_tier.get(self.replica_tier, 0.0) + gathered
        return SyncResult(step, seconds, stats.inter_group_bytes, stats.intra_group_bytes, variance, rms, sick,
                          choice.graph, consensus, fragments, membership, joined,
                          exchange_seconds=stats.exchange_seconds or seconds, wire_bytes_by_tier=by_tier,
                          carried=carried)

    @staticmethod
    def voted_down(step: int, start: float, membership: Membership) -> SyncResult:
        """A sync the groups voted down: nothing moved, every shard as before it."""
        return SyncResult(step, time.perf_counter() - start, 0, 0, 0.0, 0.0, membership=membership, committed=False)
