"""The federation engine: after each optimizer step, decide whether to sync and do it."""

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from ..config.parallel import FederationConfig
from ..costs import ring_volume, wire_volume
from ..faults import kill_point, sync_delay_seconds
from .ada import Choice, GraphSchedule
from .averaging import ShardAverager, SyncStats
from .consensus import Consensus, measure
from .contract import ShardOwner
from .failed_collective import PeerLatch, call_directly
from .fragments import due_fragment, fragment_views
from .graphs import gossip_round
from .groups import ProcessGroups
from .health import AllGroupsSick, GroupFigures, Vote, take_vote
from .ledger import CommLedger
from .rollback import HostBackup, host_backup
from .membership import Membership
from .outer import OuterOptimizer
from .mode_switch import recut_outer_state
from .overlap import InFlight, Overlapper
from .schedule import sync_due


@dataclass
class SyncResult:
    """One sync as seen by this rank (variance and rms are over all ranks)."""

    step: int
    seconds: float
    inter_group_bytes: int
    intra_group_bytes: int
    variance: float     # mean over parameter elements of the variance across groups, before the sync
    param_rms: float    # root mean square of the groups' parameters before the sync
    sick_groups: tuple = ()  # groups left out of this average and reset to it
    graph: str = "complete"  # the communication graph of this sync (--fl-topology)
    consensus: Optional[Consensus] = None  # DBench metrics, measured before anything moved
    fragments: tuple = ()  # the fragments this sync moved (--fl-fragments; empty: every shard)
    membership: Optional[Membership] = None  # the groups that met (elastic mode: the live ones)
    joined: tuple = ()     # groups that healed at this sync: they received the average, sent nothing
    committed: bool = True  # False: the sync failed somewhere and every shard was restored (elastic mode)
    exchange_seconds: float = 0.0  # the exchange itself (blocking: `seconds`; overlapped: its time in the thread)
    wire_bytes_by_tier: dict = field(default_factory=dict)  # this rank's bytes on the wire per network tier


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
        # with a sync in flight the exchange runs in a thread: on communicators of its own
        peer = getattr(groups, "exchange_peer", None) or groups.peer
        replica = (getattr(groups, "exchange_replica", None) or groups.replica) if layout.is_hsdp else None
        if self.active and config.overlap_steps and peer is groups.peer:
            raise ValueError("--fl-overlap-steps needs the exchange's own process groups: "
                             "build_process_groups(..., exchange=True)")
        self._peer, self._replica, self._replica_index = peer, replica, replica_index
        # one averager (and error-feedback residuals) and one outer optimizer per fragment
        self.fragments = config.fragments if self.active else 1
        self.averagers = self._new_averagers()
        self.averager = self.averagers[0]
        # --fl-inner-state average: the inner optimizer's moments, averaged exactly (fp32)
        self.state_averager = self._averager()
        self.last_synced_step = 0  # the last sync that averaged every fragment
        # outer optimizer (anchor + state shards) unless a sync is today's exact fp32 FedAvg
        self.outers: list[OuterOptimizer] = []
        if self.active and not config.plain_average:
            self.outers = self._new_outers()
        self.overlapper = Overlapper() if self.active and config.overlap_steps else None
        self.flight: Optional[InFlight] = None
        self.schedule = GraphSchedule(config)
        self.vote: Optional[Vote] = None  # the last sync's vote (sick groups, group figures, stop requests)
        self._peer_call = call_directly  # how the vote calls the peer group (elastic: the sync's PeerLatch)

    def _averager(self, **compression) -> ShardAverager:
        config, groups, layout = self.config, self.groups, self.groups.layout
        return ShardAverager(
            self._peer, layout.num_groups, replica_group=self._replica,
            replicas=layout.replicas, replica_index=self._replica_index, replica_split=config.replica_split,
            bucket_bytes=int(config.bucket_mb * (1 << 20)), ledger=self.ledger,
            peer_tier=groups.tier("peer"), replica_tier=groups.tier("replica"), **compression)

    def _new_averagers(self) -> list[ShardAverager]:
        return [self._averager(sync_dtype=self.config.sync_dtype, error_feedback=self.config.error_feedback)
                for _ in range(self.fragments)]

    def switch_mode(self, **fields) -> None:
        """Sync differently from now on (--fl-tune): new `FederationConfig` fields (sync_dtype,
        error_feedback, overlap_steps, fragments, sync_interval). Call right after a full sync,
        with nothing in flight: the anchors equal the shards then, and the outer optimizer's state
        is carried over, re-cut for the new fragments. Error-feedback residuals carry over while
        the precision and the fragments stay; otherwise they restart (at most one quantisation step
        of each element is not sent again)."""
        if self.flight is not None:
            raise RuntimeError("switch_mode: a sync is in flight; land it with a full sync first")
        config = self.config
        before = (config.sync_dtype, config.error_feedback, config.fragments)
        if fields.get("overlap_steps") and self.overlapper is None and self._peer is self.groups.peer:
            raise ValueError("an overlapped sync needs the exchange's own process groups: "
                             "build_process_groups(..., exchange=True)")
        for name, value in fields.items():
            if not hasattr(config, name):
                raise ValueError(f"switch_mode: FederationConfig has no field {name!r}")
            setattr(config, name, value)
        shards = self.backend.local_shards()
        old_outers, old_fragments = self.outers, self.fragments
        self.fragments = config.fragments
        if (config.sync_dtype, config.error_feedback, config.fragments) != before:
            self.averagers = self._new_averagers()
            self.averager = self.averagers[0]
        self.outers = [] if config.plain_average else self._new_outers()
        if old_outers and self.outers:
            recut_outer_state(old_outers, old_fragments, self.outers, self.fragments, shards)
        if config.overlap_steps and self.overlapper is None:
            self.overlapper = Overlapper()
        self.schedule = GraphSchedule(config)

    def trial_exchange(self, elements: int, sync_dtype: str = "fp32") -> Future:
        """Start a throwaway average of `elements` random values in `sync_dtype` in the background,
        the way an overlapped sync runs (its own communicators, a thread, the averager's buckets,
        the codec): --fl-tune times a training step beside it to learn what an overlap costs.
        Returns the future of its seconds; every rank of the job must call it at the same step."""
        if self.overlapper is None:
            self.overlapper = Overlapper()
        if self._peer is self.groups.peer:
            raise ValueError("a trial exchange needs the exchange's own process groups: "
                             "build_process_groups(..., exchange=True)")
        averager = self._averager(sync_dtype=sync_dtype, error_feedback=False)
        buffer = torch.randn(elements, device=self.backend.local_shards()[0].device)

        def run(buffers: list) -> float:  # on CUDA: on the exchange's stream, as an overlapped sync
            began = time.perf_counter()
            averager.average(buffers)
            if buffers[0].is_cuda:
                torch.cuda.current_stream(buffers[0].device).synchronize()
            return time.perf_counter() - began

        return self.overlapper.submit(run, [buffer])

    @property
    def outer(self) -> Optional[OuterOptimizer]:
        """The outer optimizer of the shards (of fragment 0 with --fl-fragments), or None."""
        return self.outers[0] if self.outers else None

    def _new_outers(self) -> list[OuterOptimizer]:
        c = self.config
        return [OuterOptimizer(views, c.outer_optimizer, c.resolved_outer_lr, c.outer_momentum)
                for views in self._fragments()]

    def _fragments(self, shards: Optional[list] = None) -> list[list[torch.Tensor]]:
        """`shards` (default: the backend's) cut into this run's fragments (one: the shards themselves)."""
        try:
            return fragment_views(self.backend.local_shards() if shards is None else shards, self.fragments)
        except ValueError as e:
            raise ValueError(f"--fl-fragments {self.fragments}: {e} (this rank's shards are too small)") from None

    @property
    def active(self) -> bool:
        """Whether this run averages at all (several groups, syncing enabled)."""
        return self.groups.layout.is_federated and self.config.syncing

    def due(self, step: int, last: bool = False) -> bool:
        """Whether a sync (or an overlapped sync's launch) follows optimizer step `step`: the
        only steps at which the groups meet, and vote."""
        interval = self.config.fragment_interval if self.config.syncing else 0
        return sync_due(step, interval, last, self.groups.layout.is_federated)

    def after_step(self, step: int, last: bool = False, loss: Optional[torch.Tensor] = None,
                   figures: Optional[GroupFigures] = None, full: bool = False) -> Optional[SyncResult]:
        """Call after optimizer step `step` (1-based) with the group's figures of that step (or
        just a `loss`); syncs when due and returns what it did. The vote lands in `self.vote`.
        `full`: a due sync averages every fragment and blocks, as the last one does (before a
        switch of sync mode)."""
        landed = None
        if self.flight is not None and (step >= self.flight.due or last or full):
            landed = self.land()
        if not self.due(step, last):
            return landed
        if figures is None:
            figures = GroupFigures(loss=None if loss is None else float(loss))
        if self.overlapper is not None and self.config.overlap_steps and not (last or full):
            return self._launch(step, figures) or landed
        return self.sync(step, figures, full=last or full)

    def _meet(self, membership: Optional[Membership] = None) -> Membership:
        """The groups of this sync (in elastic mode the live ones, after any healing; given: met
        already): the averagers work over their peer group."""
        membership = membership or self.groups.meet()
        peer = self.groups.exchange_peer or self.groups.peer
        for averager in (*self.averagers, self.state_averager):
            averager.peer_group, averager.num_groups = peer, membership.size
        return membership

    def _health(self, step: int, shards: list, figures: Optional[GroupFigures],
                membership: Membership) -> tuple[list, bool, Optional[int]]:
        """The vote (kept in `self.vote`): (sick groups, whether this rank's group contributes,
        contributors or None if all). Sick and healing groups send nothing and receive the average."""
        layout, group = self.groups.layout, self.groups.coords[0]
        self.vote = take_vote(step, shards, figures or GroupFigures(), group, layout.num_groups,
                              self.config.sick_loss_ratio, self.groups.federation, self.groups.peer,
                              self.groups.device_type, self._peer_call)
        sick = self.vote.sick
        left_out = set(sick) | set(self.vote.joining)
        contributors = sum(g not in left_out for g in membership.groups)
        if contributors == 0 and getattr(self._peer_call, "error", None) is None:  # (a failed vote knows nothing)
            raise AllGroupsSick(f"every federation group is sick at step {step} (non-finite shards or a diverged "
                                "loss): nothing is left to average; stopping without saving")
        return sick, group not in left_out, (contributors if contributors != membership.size else None)

    def _launch(self, step: int, figures: GroupFigures) -> Optional[SyncResult]:
        """Start a sync in the background (--fl-overlap-steps): it lands K steps later. With
        fragments, a sick group is reset at once instead, by a blocking sync of every fragment."""
        shards = self.backend.local_shards()
        sick, include, contributors = self._health(step, shards, figures, self._meet())
        if sick and self.fragments > 1:
            return self.sync(step, figures, full=True, voted=True)
        consensus = self._measure() if self.config.measures_consensus else None
        fragment = self._due(step)
        averager = self.averagers[fragment]

        def average(buffers):
            began = time.perf_counter()
            _slowed_link(step)
            stats = averager.average(buffers, include, contributors)
            stats.exchange_seconds = time.perf_counter() - began
            return stats

        self.flight = self.overlapper.launch(average, self.outers[fragment], self._fragments(shards)[fragment],
                                             step=step, due=step + self.config.overlap_steps, include=include,
                                             contributors=contributors, sick=tuple(sick), consensus=consensus,
                                             fragment=fragment)
        return None

    def _due(self, step: int) -> int:
        """The fragment a scheduled sync after `step` moves (0 without fragments)."""
        fragment = due_fragment(step, self.config.sync_interval, self.fragments) if self.config.syncing else None
        return fragment or 0

    def land(self) -> SyncResult:
        """Wait for the sync in flight and merge it (a checkpoint calls this before saving)."""
        flight, self.flight = self.flight, None
        start = time.perf_counter()
        stats = self.overlapper.wait(flight)
        shards = self.backend.local_shards()
        Overlapper.land(flight, self.outers[flight.fragment], self._fragments(shards)[flight.fragment])
        self._inner_state(stats, flight.include, flight.contributors, self.groups.coords[0] in flight.sick,
                          flight.fragment)
        self.backend.refresh_after_sync()
        return self._result(flight.step, start, stats, flight.consensus, Choice("complete"), flight.sick, shards,
                            self._moved((flight.fragment,)))

    def sync(self, step: int, figures: Optional[GroupFigures] = None, full: bool = True,
             voted: bool = False, membership: Optional[Membership] = None) -> SyncResult:
        """Sync now (collective over all ranks, but only ever inside a federation group or a
        peer group): vote, measure the consensus, then average over all groups or, unless
        `full`, mix along this sync's graph (--fl-topology). Groups whose shards hold NaN/Inf
        (or whose loss is past --fl-sick-loss-ratio times the best group's) are left out of a
        full average and reset to the others'; AllGroupsSick if no group is left. `voted`: the
        vote of this step was taken already (a launch that turned into a blocking sync).
        `membership`: the quorum met already (a group healing at start-up).

        Where the groups may vote a sync down (elastic mode), see `_sync_or_roll_back`."""
        if self.flight is not None:
            self.land()
        start = time.perf_counter()
        membership = self._meet(membership)
        if self.groups.may_roll_back:
            return self._sync_or_roll_back(step, figures, full, membership, start)
        done = self._exchange(step, figures, full, voted, membership)
        if done.choice.graph != "none":
            self.backend.refresh_after_sync()
        result = self._result(step, start, done.stats, done.consensus, done.choice, done.sick,
                              done.shards if self.outers else None, self._moved(done.moved))
        result.membership, result.joined = membership, tuple(self.vote.joining)
        return result

    def _sync_or_roll_back(self, step: int, figures: Optional[GroupFigures], full: bool, membership: Membership,
                           start: float) -> SyncResult:
        """A sync torchft's commit may vote down (elastic mode). Every peer collective goes through
        the sync's PeerLatch: the first that fails (a peer lost midway) is remembered and the
        later ones are skipped, while the in-group ones (HSDP's replica gathers) go on, so every
        rank of the group makes the same in-group calls. Then one more, the error flags and the
        metrics' sums, tells the group whether any of its ranks failed; then the commit. Not
        committed: the shards and the engine's state are restored from a host copy taken before
        the sync. The metrics are this group's: its distance from the average."""
        backup = host_backup(self.backend.local_shards(), self.state_tensors())
        latch = self._route_peer_calls(PeerLatch())
        try:
            done = self._exchange(step, figures, full, False, membership)
        finally:
            self._route_peer_calls(call_directly)
        failed = latch.error  # a peer lost during the sync's collectives: the later ones were skipped
        sums = self._metric_sums(done.stats, done.shards if self.outers else None)
        agreed = torch.tensor([float(failed is not None), *sums], dtype=torch.float64,
                              device=self.groups.device_type)
        dist.all_reduce(agreed, group=self.groups.federation)
        if agreed[0] > 0:  # this rank's peers or a group mate's: the group votes the sync down
            self.groups.report_error(failed or RuntimeError(f"a rank of this group lost a peer in the sync of "
                                                            f"step {step}"))
        if not self.groups.commit():
            self._restore(backup)
            return SyncResult(step, time.perf_counter() - start, 0, 0, 0.0, 0.0, membership=membership,
                              committed=False)
        if failed is not None:
            raise RuntimeError(f"the sync of step {step} failed on this rank but was committed") from failed
        if done.choice.graph != "none":
            self.backend.refresh_after_sync()
        variance, rms = _variance_and_rms(agreed[1:])
        return SyncResult(step, time.perf_counter() - start, done.stats.inter_group_bytes,
                          done.stats.intra_group_bytes, variance, rms, done.sick, done.choice.graph,
                          membership=membership, joined=tuple(self.vote.joining))

    def _route_peer_calls(self, call):
        """Send every peer collective of the vote and the averagers through `call`; returns it."""
        self._peer_call = call
        for averager in (*self.averagers, self.state_averager):
            averager.peer_call = call
        return call

    def _exchange(self, step: int, figures: Optional[GroupFigures], full: bool, voted: bool,
                  membership: Membership) -> "_Exchanged":
        """The vote and the exchange of a sync (every cross-group collective of it), in place."""
        shards = self.backend.local_shards()
        if voted:
            sick = self.vote.sick
            include = self.groups.coords[0] not in sick
            contributors = self.groups.layout.num_groups - len(sick) if sick else None
        else:
            if membership.healed:  # this group took a live group's state in the quorum: it receives only
                figures = GroupFigures(healing=True)
            sick, include, contributors = self._health(step, shards, figures, membership)
        kill_point("exchange", step, self.groups.rank)  # a test's peer lost after the vote, before data moves
        _slowed_link(step)
        consensus = self._measure() if self.config.measures_consensus else None
        choice = self.schedule.choose(consensus.relative if consensus else 0.0, full=full or bool(sick))
        moved: tuple = ()
        if choice.graph == "complete":
            moved = tuple(range(self.fragments)) if full or sick else (self._due(step),)
            stats = SyncStats()
            views = self._fragments(shards)
            for fragment in moved:
                outer = self.outers[fragment] if self.outers else None
                if outer is not None:
                    outer.to_pseudo_gradients(views[fragment])
                stats.merge(self.averagers[fragment].average(views[fragment], include, contributors))
                if outer is not None:
                    outer.step(views[fragment])
            if len(moved) == self.fragments:
                self.last_synced_step = step
        elif choice.graph == "none":
            stats = SyncStats()
        else:
            layout, group = self.groups.layout, self.groups.coords[0]
            stats = self.averager.average(shards, mixing=gossip_round(choice.graph, layout.num_groups, group,
                                                                      choice.round_index))
        self._inner_state(stats, include, contributors, self.groups.coords[0] in sick,
                          moved[0] if len(moved) == 1 else None)
        return _Exchanged(stats, tuple(sick), consensus, choice, moved, shards)

    def _restore(self, backup: HostBackup) -> None:
        backup.restore(self.backend.local_shards(), self.load_state_tensors)
        self.backend.refresh_after_sync()

    def _moved(self, fragments: tuple) -> tuple:
        """The fragments a sync moved, as reported (empty without --fl-fragments)."""
        return fragments if self.fragments > 1 else ()

    def _measure(self) -> Consensus:
        """DBench metrics of the shards as they are (before the sync moves anything)."""
        views = self.backend.named_shards()
        group, replica, _ = self.groups.coords
        return measure(views, self.groups, group, counts=replica == 0, max_samples=self.config.consensus_samples)

    def _result(self, step: int, start: float, stats: SyncStats, consensus: Optional[Consensus], choice: Choice,
                sick: tuple, shards=None, fragments: tuple = ()) -> SyncResult:
        """The sync's result. With DBench metrics: the bytes each group sent (an all-reduce at its
        ring size on the wire, the metric's sample too) go into the consensus record; without
        them the variance comes from the average itself (free)."""
        groups = self.groups.layout.num_groups
        wire = wire_volume(choice.graph, groups, stats.inter_group_bytes)
        if consensus is None:
            variance, rms = self._global_metrics(stats, shards)
        else:
            self.ledger.add("inter-group", self.averager.peer_tier, consensus.sample_bytes)
            wire += wire_volume("complete", groups, consensus.sample_bytes)
            per_group = torch.zeros(groups, dtype=torch.float64, device=self.groups.device_type)
            per_group[self.groups.coords[0]] = wire
            self.groups.all_reduce_job(per_group)
            consensus.group_bytes = [int(b) for b in per_group.tolist()]
            variance = consensus.variance
            rms = (sum(n * n for n in consensus.group_norms) / groups / max(1.0, consensus.elements)) ** 0.5
        seconds = time.perf_counter() - start
        by_tier = {self.averager.peer_tier: wire}
        replicas = self.groups.layout.replicas
        gathered = ring_volume("all_gather", stats.intra_group_bytes * replicas, replicas) if replicas > 1 else 0.0
        by_tier[self.averager.replica_tier] = by_tier.get(self.averager.replica_tier, 0.0) + gathered
        return SyncResult(step, seconds, stats.inter_group_bytes, stats.intra_group_bytes, variance, rms, sick,
                          choice.graph, consensus, fragments, exchange_seconds=stats.exchange_seconds or seconds,
                          wire_bytes_by_tier=by_tier)

    def _inner_state(self, stats: SyncStats, include: bool, contributors: Optional[int], sick: bool,
                     fragment: Optional[int] = None) -> None:
        """--fl-inner-state: keep, average (left-out groups take the others' mean) or reset; a
        sick group always restarts its moments unless they are averaged (a healing group keeps
        the moments it received). A sync of one fragment averages the same fraction of the
        moments (cut the same way), in turn."""
        policy = self.config.inner_state
        if policy == "average":
            state = self.backend.inner_state_shards()
            if state and fragment is not None and self.fragments > 1:
                state = fragment_views(state, self.fragments)[fragment]
            if state:
                moved = self.state_averager.average(state, include, contributors)
                stats.inter_group_bytes += moved.inter_group_bytes
                stats.intra_group_bytes += moved.intra_group_bytes
        elif policy == "reset" or sick:
            self.backend.reset_optimizer_state()

    def close(self) -> None:
        if self.overlapper is not None:
            if self.flight is not None:
                self.overlapper.wait(self.flight)
                self.flight = None
            self.overlapper.close()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's outer-optimizer anchors and state, and error-feedback residuals (empty for
        the plain average): what an exact resume needs beyond the backend's state."""
        out = {}
        for fragment in range(self.fragments):
            prefix = self._state_prefix(fragment)
            if self.outers:
                out.update({prefix + k: v for k, v in self.outers[fragment].state_tensors().items()})
            out.update({f"{prefix}residual.{i}": r for i, r in self.averagers[fragment].residuals.items()})
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore `state_tensors` (from a checkpoint, a healing transfer or a backup: moved to the
        shards' device)."""
        shards = self.backend.local_shards()
        if shards:
            tensors = {k: v.to(shards[0].device) for k, v in tensors.items()}
        for fragment in range(self.fragments):
            prefix = self._state_prefix(fragment)
            mine = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            if self.outers:
                self.outers[fragment].load_state_tensors(mine)
            self.averagers[fragment].residuals = {int(k.split(".")[1]): v.clone() for k, v in mine.items()
                                                  if k.startswith("residual.")}

    def _state_prefix(self, fragment: int) -> str:
        return f"fragment{fragment}." if self.fragments > 1 else ""

    def restart_outer_state(self) -> None:
        """Anchors from the current (loaded) shards, fresh outer state and residuals."""
        if self.outers:
            self.outers = self._new_outers()
        self.forget_residuals()

    def forget_residuals(self) -> None:
        """Error-feedback residuals back to zero (a restart, or a group that healed: the residual
        it received is its source's own compression error, which the source still carries)."""
        for averager in self.averagers:
            averager.residuals = {}

    def _global_metrics(self, stats: SyncStats, shards=None) -> tuple[float, float]:
        """Variance across groups and parameter rms, pooled over every rank's sample. With an
        outer optimizer the averaged values were pseudo-gradients (same variance across
        groups: the anchors are equal); the rms is then taken over the new shards."""
        totals = torch.tensor(self._metric_sums(stats, shards), dtype=torch.float64,
                              device=self.groups.device_type)
        self.groups.all_reduce_job(totals)
        return _variance_and_rms(totals)

    @staticmethod
    def _metric_sums(stats: SyncStats, shards=None) -> list[float]:
        """This rank's (squared deviations, squares, sample count) of the sync's sample."""
        sq_mean = stats.sq_mean_sum
        if shards is not None and shards:  # the mean square over every element, weighted like the sample
            elements = sum(s.numel() for s in shards)
            norms = torch.stack([torch.linalg.vector_norm(s, dtype=torch.float64) for s in shards])
            sq_mean = float(norms.pow(2).sum()) * stats.samples / max(1, elements)
        return [stats.sq_dev_sum, sq_mean, float(stats.samples)]


@dataclass
class _Exchanged:
    """What a sync's exchange did on this rank, before the refresh and the metrics."""

    stats: SyncStats
    sick: tuple
    consensus: Optional[Consensus]
    choice: Choice
    moved: tuple
    shards: list


def _variance_and_rms(totals: torch.Tensor) -> tuple[float, float]:
    """Variance across groups and parameter rms from summed (squared deviations, squares, count)."""
    sq_dev, sq_mean, count = totals.tolist()
    if count == 0:
        return 0.0, 0.0
    return sq_dev / count, (sq_mean / count) ** 0.5


def _slowed_link(step: int) -> None:
    """A test's or benchmark's slowed link (FL_MEGATRON_FAULT=slow-sync); nothing otherwise."""
    delay = sync_delay_seconds(step)
    if delay > 0:
        time.sleep(delay)
