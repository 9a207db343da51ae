"""The federation engine: after each optimizer step, decide whether to sync, and run the sync's
stages in order (docs/architecture.md, "A sync"): meet (membership), vote (vote.py), exchange
(exchange.py, with the outer step of outer.py), land an overlapped one (landing.py), commit or
roll back (transaction.py), report (result.py). What it keeps between syncs is the sync state of
the current mode (sync_state.py), replaced whole at a switch of mode."""

import time
from typing import Callable, Optional

import torch

from ..config.parallel import FederationConfig
from ..config.sync_mode import SyncMode
from ..faults import kill_point, sync_delay_seconds
from .ada import Choice, GraphSchedule
from .atom_average import TensorShards
from .averaging import Peers, ShardAverager
from .consensus import Consensus, measure
from .contract import ShardOwner
from .exchange import ExchangeContext, Exchanged, exchange
from .failed_collective import call_directly, has_failed
from .fragments import due_fragment
from .groups import ProcessGroups
from .inner_state import settle_inner_state
from .landing import OverlappedSyncs
from .ledger import CommLedger
from .membership import Membership
from .outer import OuterOptimizer
from .overlap import Overlapper
from .riding_vote import exchange_with_the_vote, vote_can_ride
from .result import CarriedMetrics, ResultBuilder, SyncResult, metric_sums
from .schedule import sync_due
from .sync_state import AveragerSettings, SyncState
from .unequal_groups import UnequalGroups, atom_averaging
from .vote import Ballot, GroupFigures, Senders, Vote, take_vote


class FederationEngine:
    """Averages the backend's local shards across federation groups every H steps and at the end.
    `mode`: the sync mode to start in (default: the one `config` gives; --fl-tune's resumed choice)."""

    def __init__(self, backend: ShardOwner, groups: ProcessGroups, config: FederationConfig,
                 ledger: Optional[CommLedger] = None, mode: Optional[SyncMode] = None) -> None:
        self.ledger = ledger if ledger is not None else CommLedger()
        settings = config.with_mode(mode) if mode is not None else config
        layout = groups.layout
        # the exchange runs on communicators of its own where there are some (an overlapped sync's thread)
        peer = groups.exchange_peer or groups.peer
        replica = (groups.exchange_replica or groups.replica) if layout.is_hsdp else None
        bucket_bytes, atoms = int(config.bucket_mb * (1 << 20)), None
        if isinstance(groups, UnequalGroups) and layout.is_federated:  # no peer group: average atom by atom
            backend = TensorShards(backend)
            atoms = atom_averaging(groups, backend, bucket_bytes, self.ledger)
        self.backend, self.groups = backend, groups
        self.averaging = AveragerSettings(peer, layout.num_groups, replica, layout.replicas, groups.coords[1],
                                          config.replica_split, bucket_bytes, self.ledger,
                                          groups.tier("peer"), groups.tier("replica"), atoms)
        active = layout.is_federated and config.syncing
        if active and settings.overlap_steps:
            self._check_exchange_groups("--fl-overlap-steps")
        self.state = SyncState(settings, self.averaging, backend.local_shards, active)
        self.overlapped = OverlappedSyncs(Overlapper() if active and settings.overlap_steps else None)
        self.schedule = GraphSchedule(config)
        self.results = ResultBuilder(groups, self.ledger, self.averaging.peer_tier, self.averaging.replica_tier)
        self.vote: Optional[Vote] = None  # the last sync's vote (sick groups, group figures, stop requests)
        self.last_synced_step = 0  # the last sync that averaged every fragment
        self.committed_syncs = 0   # syncs kept (committed or landed): elastic groups that differ in it differ in state
        self.vote_seconds = 0.0    # time in votes: mostly waiting there for the slowest group to arrive
        # one world: the last sync's metric sums on this rank, which the next vote adds up over the job
        self.metrics = CarriedMetrics()

    # --- what the engine is now ---------------------------------------------------------------
    @property
    def mode(self) -> SyncMode:
        """The current sync mode (one value; `switch_mode` replaces it)."""
        return self.state.mode

    @property
    def config(self) -> FederationConfig:
        """The federation settings in the current mode (the engine's own copy)."""
        return self.state.settings

    @property
    def active(self) -> bool:
        """Whether this run averages at all (several groups, syncing enabled)."""
        return self.state.active

    @property
    def flight(self):
        """The overlapped sync in flight, or None."""
        return self.overlapped.flight

    @property
    def averager(self) -> ShardAverager:
        """The averager of the shards (of fragment 0 with --fl-fragments)."""
        return self.state.averagers[0]

    @property
    def outer(self) -> Optional[OuterOptimizer]:
        """The outer optimizer of the shards (of fragment 0 with --fl-fragments), or None."""
        return self.state.outer(0)

    @property
    def device(self) -> torch.device:
        """The rank's own device (its shards'), where the sync's small tensors live."""
        return self._device_of(self.backend.local_shards())

    def _device_of(self, shards: list) -> torch.device:
        return shards[0].device if shards else torch.device(self.groups.device_type)

    def due(self, step: int, last: bool = False) -> bool:
        """Whether a sync (or an overlapped sync's launch) follows optimizer step `step`: the
        only steps at which the groups meet, and vote."""
        interval = self.config.fragment_interval if self.config.syncing else 0
        return sync_due(step, interval, last, self.groups.layout.is_federated)

    # --- after each step ----------------------------------------------------------------------
    def after_step(self, step: int, last: bool = False, loss: Optional[torch.Tensor] = None,
                   figures: Optional[GroupFigures] = None, full: bool = False,
                   due: Optional[bool] = None, switch: Optional[SyncMode] = None) -> Optional[SyncResult]:
        """Call after optimizer step `step` (1-based) with the group's figures of that step (or
        just a `loss`); syncs when due and returns what it did (a landing that came first, at this
        step, rides along as `landed`). The vote lands in `self.vote`. `full`: a due sync averages
        every fragment and blocks, as the last one does (before a switch of sync mode). `due`:
        whether a sync follows, where the caller plans the rounds (per-group step counts; `step`
        is then the round's federation step, the same on every group). In one world a sync's
        variance and rms are carried to the next sync's vote (its result's `carried`), but for
        the last sync's and a `full` one's, which take a round of their own. `switch`: a mode to
        sync in from this step on, switched to between syncs (`can_switch_between_syncs`) after
        landing a sync in flight and before this step's sync, if the new mode has one due here."""
        landed = None
        now = last or full
        if self.flight is not None and (step >= self.flight.due or now or switch is not None):
            landed = self.land(metrics_now=now)
        if switch is not None:
            self.switch_mode(switch, between_syncs=True)
        if not (self.due(step, last) if due is None else due):
            return landed
        if figures is None:
            figures = GroupFigures(loss=None if loss is None else float(loss))
        if self.config.overlap_steps and not now:
            return _after(landed, self._launch(step, figures))
        return _after(landed, self.sync(step, figures, full=now, metrics_now=now))

    def sync(self, step: int, figures: Optional[GroupFigures] = None, full: bool = True,
             voted: Optional[Senders] = None, membership: Optional[Membership] = None,
             transaction=None, metrics_now: bool = True) -> SyncResult:
        """Sync now (collective over all ranks, but only ever inside a federation group or a peer
        group): meet, vote, exchange (over all groups or, unless `full`, along this sync's graph),
        commit or roll back, report. Groups whose shards hold NaN/Inf (or whose loss is past
        --fl-sick-loss-ratio times the best group's) are left out of a full average and reset to the
        others'; AllGroupsSick if no group is left. A group healing at this sync makes it average
        every fragment on every group (the vote tells all of them). `voted`, `membership`,
        `transaction`: a launch that turned into a blocking sync (it met, began and voted already);
        `membership` alone: a group healing at start-up (it met already). `metrics_now`: agree this
        sync's variance and rms at once, in a round of their own over the job; otherwise (one
        world) the next sync's vote carries them (`SyncResult.carried` there)."""
        landed = self.land(metrics_now) if self.flight is not None else None
        start = time.perf_counter()
        membership = membership or self.groups.meet()
        if transaction is None:
            transaction = self.groups.transaction(self.backend, self.state)
            transaction.begin()
        transaction.keep_shards()
        peers, shards = self._peers(membership, transaction.peer_call), self.backend.local_shards()
        if voted is None and transaction.carries_metrics and vote_can_ride(
                self.config, self.state, self.averaging.atoms is None, figures, shards):
            done = self._ride(step, figures, full, membership, peers, shards, transaction.keep_inner_state)
        else:
            done = self._exchange(step, figures, full, voted, membership, peers, transaction.keep_inner_state, shards)
        sums = metric_sums(done.stats, done.shards if self.state.outers else None) if done.consensus is None else None
        carried = self.metrics.reported(self.vote)
        later = sums is not None and not metrics_now and transaction.carries_metrics
        verdict = transaction.conclude(step, None if later else sums, self._device_of(done.shards))
        if not verdict.committed:
            return _after(landed, self.results.voted_down(step, start, membership))
        self.metrics.keep(step, sums if later else None)
        self.committed_syncs += 1
        if len(done.moved) == self.state.fragments:
            self.last_synced_step = step
        if done.choice.graph != "none":
            self.backend.refresh_after_sync()
        return _after(landed, self.results.build(step, start, done.stats, done.choice, done.sick, done.consensus,
                                                 self._reported(done.moved), verdict.totals, membership,
                                                 tuple(self.vote.joining), carried))

    def land(self, metrics_now: bool = True) -> SyncResult:
        """Wait for the sync in flight and merge it (a checkpoint calls this before saving), then
        commit it or, in elastic mode, roll it back as a blocking sync would: the shards as they
        were just before the merge (the steps trained since the launch kept), the sync state as
        at the launch. Either way the groups that met at its launch decide, before the next meeting.
        `metrics_now`: as for `sync` (the launch's vote carried the previous sync's metrics)."""
        start = time.perf_counter()
        flight = self.flight
        fragment, transaction = flight.fragment, flight.transaction
        shards = self.backend.local_shards()
        flight, stats = self.overlapped.land(self.state.outers[fragment], self.state.views(shards)[fragment],
                                             before_merge=transaction.keep_shards)
        settle_inner_state(self.config.inner_state, self.backend, self.state, stats, flight.senders, flight.peers,
                           self.groups.coords[0] in flight.senders.sick, fragment, transaction.keep_inner_state)
        self.backend.refresh_after_sync()
        sums = metric_sums(stats, shards) if flight.consensus is None else None
        later = sums is not None and not metrics_now and transaction.carries_metrics
        verdict = transaction.conclude(flight.step, None if later else sums, self._device_of(shards))
        if not verdict.committed:
            return self.results.voted_down(flight.step, start, flight.membership)
        self.metrics.keep(flight.step, sums if later else None)
        self.committed_syncs += 1
        return self.results.build(flight.step, start, stats, Choice("complete"), flight.senders.sick, flight.consensus,
                                  self._reported((fragment,)), verdict.totals, flight.membership,
                                  carried=flight.carried)

    # --- the stages -----------------------------------------------------------------------------
    def _peers(self, membership: Membership, call=call_directly) -> Peers:
        """The peers of this sync: the groups that met, over the exchange's peer group (in elastic
        mode the quorum's), every collective through `call`."""
        return Peers(self.groups.exchange_peer or self.groups.peer, membership.size, call)

    def _vote(self, step: int, shards: list, figures: Optional[GroupFigures], membership: Membership,
              peers: Peers) -> Senders:
        """The vote (kept in `self.vote`) and who sends, from it."""
        layout, group = self.groups.layout, self.groups.coords[0]
        began = time.perf_counter()
        self.vote = take_vote(step, shards, figures or GroupFigures(), group, layout.num_groups,
                              self.config.sick_loss_ratio, self.groups.federation, self.groups.reduce_across_groups,
                              self._device_of(shards), peers.call, self.metrics.sums)
        self.vote_seconds += time.perf_counter() - began
        return Senders.of(self.vote, membership.groups, group, vote_failed=has_failed(peers.call))

    def _exchange(self, step: int, figures: Optional[GroupFigures], full: bool, voted: Optional[Senders],
                  membership: Membership, peers: Peers, keep_inner_state: Callable[[], None],
                  shards: list) -> Exchanged:
        """The vote and the exchange of a blocking sync (every cross-group collective of it), in place."""
        group, num_groups = self.groups.coords[0], self.groups.layout.num_groups
        if voted is not None:
            senders = voted
        else:
            if membership.healed:  # this group took a live group's state in the quorum: it receives only
                figures = GroupFigures(healing=True)
            senders = self._vote(step, shards, figures, membership, peers)
        kill_point("exchange", step, self.groups.rank)  # a test's peer lost after the vote, before data moves
        _slowed_link(step)
        consensus = self._measure() if self.config.measures_consensus else None
        switching = self.switch_voted() is not None  # a switch of mode agreed in the vote needs every fragment
        choice = self.schedule.choose(consensus.relative if consensus else 0.0,
                                      full=full or bool(senders.sick) or switching)
        every = full or senders.sick or self.vote.joining or switching  # a healing group takes every fragment
        fragments = self._moving(step, every)
        context = ExchangeContext(step, senders, peers, choice, fragments, group, num_groups, keep_inner_state)
        return exchange(self.state, self.backend, shards, context, consensus)

    def _ride(self, step: int, figures: Optional[GroupFigures], full: bool, membership: Membership,
              peers: Peers, shards: list, keep_inner_state: Callable[[], None]) -> Exchanged:
        """A blocking sync whose vote rides on its data (riding_vote.py): the vote's in-group round
        here, then the exchange with the ballot on its first bucket."""
        group, num_groups = self.groups.coords[0], self.groups.layout.num_groups
        began = time.perf_counter()
        ballot = Ballot.cast(step, shards, figures or GroupFigures(), group, num_groups, self.config.sick_loss_ratio,
                             self.groups.federation, self._device_of(shards), self.metrics.sums)
        cast = time.perf_counter() - began
        kill_point("exchange", step, self.groups.rank)  # a test's peer lost after the vote, before data moves
        _slowed_link(step)
        issued = time.perf_counter()
        done, self.vote, landed = exchange_with_the_vote(self.state, self.backend, shards, ballot,
                                                         self._moving(step, full), membership.groups, group, peers,
                                                         keep_inner_state)
        self.vote_seconds += cast + landed - issued  # the wait for the slower groups ends where the ballot lands
        return done

    def _launch(self, step: int, figures: GroupFigures) -> Optional[SyncResult]:
        """Start a sync in the background (--fl-overlap-steps): it lands K steps later, and is
        committed or voted down there (elastic mode). A sick group with fragments, a group healing
        at this meeting, or a switch of mode agreed in the vote turns it into a blocking sync of
        every fragment at once, on every group (the vote says so to all)."""
        shards = self.backend.local_shards()
        membership = self.groups.meet()
        if membership.healed:  # behind the others, this group took their state in the quorum: it receives only
            figures = GroupFigures(healing=True)
        transaction = self.groups.transaction(self.backend, self.state)
        transaction.begin()
        peers = self._peers(membership, transaction.peer_call)
        senders = self._vote(step, shards, figures, membership, peers)
        if self.vote.joining or self.switch_voted() or (senders.sick and self.state.fragments > 1):
            return self.sync(step, figures, full=True, voted=senders, membership=membership, transaction=transaction)
        kill_point("exchange", step, self.groups.rank)  # a test's peer lost after the vote, before data moves
        consensus = self._measure() if self.config.measures_consensus else None
        fragment = self._due_fragment(step)
        self.overlapped.launch(step, step + self.config.overlap_steps, self.state.averagers[fragment],
                               self.state.outers[fragment], self.state.views(shards)[fragment], senders, peers,
                               consensus, fragment, membership, transaction, before_exchange=lambda: _slowed_link(step),
                               carried=self.metrics.reported(self.vote))
        return None

    def switch_voted(self) -> Optional[SyncMode]:
        """The mode the last vote agreed to switch to after its sync (elastic --fl-tune), or None."""
        choice = self.vote.tune_choice if self.vote is not None else None
        return choice if choice is not None and choice != self.mode else None

    def _due_fragment(self, step: int) -> int:
        """The fragment a scheduled sync after `step` moves (0 without fragments)."""
        c = self.config
        return (due_fragment(step, c.sync_interval, self.state.fragments) if c.syncing else None) or 0

    def _moving(self, step: int, every: bool) -> tuple:
        """The fragments a blocking sync after `step` averages: all of them, or the one due."""
        return tuple(range(self.state.fragments)) if every else (self._due_fragment(step),)

    def _reported(self, fragments: tuple) -> tuple:
        """The fragments a sync moved, as reported (empty without --fl-fragments)."""
        return fragments if self.state.fragments > 1 else ()

    def _measure(self) -> Consensus:
        """DBench metrics of the shards as they are (before the sync moves anything)."""
        group, replica, _ = self.groups.coords
        return measure(self.backend.named_shards(), self.groups, group, counts=replica == 0,
                       max_samples=self.config.consensus_samples)

    # --- the mode, and the state a checkpoint or a heal carries ---------------------------------
    def switch_mode(self, mode: SyncMode, between_syncs: bool = False) -> None:
        """Sync in `mode` from now on (--fl-tune), with nothing in flight. Right after a full sync
        the anchors equal the shards; `between_syncs`, each element's anchor is carried over from
        this mode's (see `can_switch_between_syncs`). The sync state goes along (sync_state.py)."""
        if self.flight is not None:
            raise RuntimeError("switch_mode: a sync is in flight; land it first")
        if mode.overlap_steps:
            self._check_exchange_groups("an overlapped sync")
        self.state = self.state.switched(self.config.with_mode(mode), self.backend.local_shards(), between_syncs)

    def can_switch_between_syncs(self, mode: SyncMode) -> bool:
        """Whether `mode` can take over with no full sync first: it needs no anchors (the plain
        fp32 average) or the current mode's carry over (not from a plain average, not for groups of
        unequal size)."""
        return self.state.can_switch_between_syncs(self.config.with_mode(mode))

    def _check_exchange_groups(self, what: str) -> None:
        if not self.groups.has_exchange_groups():
            raise ValueError(f"{what} needs the exchange's own process groups: "
                             "build_process_groups(..., exchange=True)")

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's outer-optimizer anchors and state, and error-feedback residuals (empty for
        the plain average): what an exact resume needs beyond the backend's state."""
        return self.state.state_tensors()

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore `state_tensors` (from a checkpoint, a healing transfer or a backup: moved to the
        shards' device)."""
        device = self.device
        self.state.load_state_tensors({k: v.to(device) for k, v in tensors.items()})

    def restart_outer_state(self) -> None:
        """Anchors from the current (loaded) shards, fresh outer state and residuals."""
        self.state.restart(self.backend.local_shards())

    def forget_residuals(self) -> None:
        """Error-feedback residuals back to zero (see SyncState.forget_residuals)."""
        self.state.forget_residuals()

    def close(self) -> None:
        self.overlapped.close()


def _after(landed: Optional[SyncResult], result: Optional[SyncResult]) -> Optional[SyncResult]:
    """`result`, with the landing that came first at the same step riding along; or the landing."""
    if result is None:
        return landed
    if landed is not None:
        result.landed = landed
    return result


def _slowed_link(step: int) -> None:
    """A test's or benchmark's slowed link (FL_MEGATRON_FAULT=slow-sync); nothing otherwise."""
    delay = sync_delay_seconds(step)
    if delay > 0:
        time.sleep(delay)
