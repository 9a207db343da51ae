"""--fl-tune's place in the training loop: the start-up link probe (its banner line and its part of
config.json), the tuner in the mode a resumed run chose, and its calls before and after each step
and sync. Without --fl-tune every call does nothing."""

from concurrent.futures import Future
from typing import Callable, Optional

from ..config import ResolvedRun
from ..config.flags import config_to_json
from ..config.sync_mode import PRECISIONS, SyncMode
from ..cost_model.calibrate import cluster_from_probe, dry_run_flags
from ..cost_model.network import Cluster
from ..federation import SyncResult
from ..federation.link_probe import probe_links
from .run_files import RunFiles
from .step_clock import StepClock
from .tuning import SyncTuner, probe_line, resumed_choice, trial_step


class TuningHook:
    """The tuner's calls from the loop (`tuner` None: --fl-tune is off, nothing happens)."""

    def __init__(self, tuner: Optional[SyncTuner], device=None) -> None:
        self.tuner = tuner
        self.clock = StepClock(device) if tuner is not None else None  # the step as the device ran it

    @property
    def by_vote(self) -> bool:
        """Whether the groups agree on a choice in the sync's vote (elastic mode)."""
        return self.tuner is not None and self.tuner.by_vote

    def attach(self, checkpointer, state: dict) -> None:
        """Save the tuner's state with every checkpoint, and continue from a resumed one's."""
        if self.tuner is not None:
            checkpointer.tune_state = self.tuner.state
            self.tuner.load_state(state)

    def before_step(self, done: int, engine) -> Optional[Future]:
        """Before optimizer step `done`: the trial exchange started beside it, if this is its step;
        the step's clock started."""
        if self.tuner is None:
            return None
        trial = self.tuner.start_trial(done, engine)
        self.clock.start()
        return trial

    def after_step(self, trial: Optional[Future]) -> None:
        """The step just taken (beside the trial exchange, if one ran), timed by the step's clock."""
        if self.tuner is None:
            return
        seconds = self.clock.seconds()
        if trial is not None:
            self.tuner.end_trial(trial, seconds)
        else:
            self.tuner.observe_step(seconds)

    def decide(self, done: int, mode: SyncMode, voting: bool, last: bool) -> Optional[SyncMode]:
        """At a due sync (not the last): a new mode to switch to after it, or None. In elastic
        mode: this group's choice (possibly the mode it is in), for the vote (`ask`)."""
        if self.tuner is None or not voting or last:
            return None
        return self.tuner.decide(done, mode)

    def before_or_after(self, engine, choice: Optional[SyncMode], planned: bool
                        ) -> tuple[Optional[SyncMode], Optional[SyncMode]]:
        """Where `choice` applies: (the mode to switch to before the due sync, the one to switch to
        after it). In one world every group chose the same, so where the current mode's anchors
        carry over (`engine.can_switch_between_syncs`) the due sync already runs in the new mode;
        otherwise, in elastic mode (the vote agrees it) and under planned rounds (per-group step
        counts: the rounds plan the current mode's syncs), after a full sync."""
        if choice is None or self.by_vote:
            return None, choice
        before = not planned and engine.can_switch_between_syncs(choice)
        if self.tuner.last_record is not None:
            self.tuner.last_record["tune"]["applied"] = "before this sync" if before else \
                "after this sync, which averages every fragment and blocks"
        return (choice, None) if before else (None, choice)

    def ask(self, choice: Optional[SyncMode], figures) -> bool:
        """Put `choice` to the groups: whether the due sync must average every fragment and block.
        In one world every group chose the same, so it must; in elastic mode the choice rides on
        the vote in `figures`, and the vote says whether it holds."""
        if not self.by_vote:
            return choice is not None
        if choice is not None:
            figures.tune_choice = choice
        return False

    def agreed(self, engine, sync: Optional[SyncResult], choice: Optional[SyncMode], done: int,
               voting: bool) -> Optional[SyncMode]:
        """The mode to switch to after the sync of step `done`: `choice` in one world; in elastic
        mode what its vote agreed, where the sync committed (a voted-down sync switches nothing)."""
        if not self.by_vote:
            return choice
        vote = engine.vote  # taken at this step's sync, or at its launch (a switch makes that block)
        voted_down = sync is not None and sync.step == done and not sync.committed
        held = voting and vote is not None and vote.step == done and not voted_down
        adopted = vote.tune_choice if held else None
        if choice is not None and adopted != choice and (adopted is not None or choice != engine.mode):
            self.tuner.outvoted(adopted, choice)
        elif choice is None and adopted is not None:
            self.tuner.decided = True  # another group's choice: this one's first choice is made
        return engine.switch_voted() if held else None

    def after_sync(self, engine, sync: Optional[SyncResult], switch: Optional[SyncMode]) -> Optional[dict]:
        """Switch mode after the full sync a new choice asked for; let the tuner see the syncs that
        ran in the current mode. Returns the record of a decision taken at this step, if any."""
        if self.tuner is None:
            return None
        if switch is not None:
            engine.switch_mode(switch)
        elif sync is not None:
            if sync.landed is not None:
                self.tuner.observe_sync(sync.landed.exchange_seconds)
            self.tuner.observe_sync(sync.exchange_seconds)
        record, self.tuner.last_record = self.tuner.last_record, None
        return record

    def saw_landing(self, sync: SyncResult) -> None:
        """An overlapped sync landed early (for a checkpoint): the tuner sees it like any other."""
        if self.tuner is not None:
            self.tuner.observe_sync(sync.exchange_seconds)


def start_tuning(run: ResolvedRun, probe_scope: Optional[str], groups, files: RunFiles, device,
                 say: Callable[[str], None]) -> tuple[TuningHook, dict, Optional[SyncMode]]:
    """The start-up link probe (`probe_scope` "job": every tier; "group": the group's own links,
    in elastic mode; None: none), its line in the banner and config.json, and with --fl-tune the
    tuner: (the hook, the tuner's resumed state, the mode to start in: the one a resumed checkpoint
    chose, else in one world the tuner's first choice before step 1; None: the configured one)."""
    fed = run.cfg.federation
    if probe_scope is None:
        return TuningHook(None), {}, None
    across = probe_scope == "job"
    codecs = PRECISIONS[1:PRECISIONS.index(fed.tune_lowest_precision) + 1] if fed.tune else ()
    # what an overlap costs: at the probe only where no step can be timed beside a trial exchange
    # (its loop, about a second and a half on CPU ranks, would cost more start-up than it saves)
    overlap = groups.exchange_peer if fed.tune and fed.tune_overlap and trial_step(fed) is None else None
    sparse = (("int2", fed.tune_topk_density),) if fed.tune and fed.tune_topk_density else ()
    probe = probe_links(groups, device, codecs, overlap, across_groups=across, sparse_codecs=sparse)
    cluster = cluster_from_probe(run.layout, probe, Cluster.from_config(run.cfg.cluster))
    say(probe_line(probe, cluster))
    extras = {"link_probe": {**probe.to_dict(), "dry_run_flags": dry_run_flags(cluster)}}
    tuner, mode, state = None, None, {}
    if fed.tune:
        tuner = SyncTuner(run, groups, probe, say, device, by_vote=not across)
        mode, state = resumed_choice(run.cfg.checkpoint)
        if mode is not None:
            say(f"  fl-tune: resuming in the mode the checkpoint's run chose: {mode.label()}")
        elif across:  # one world: the groups agreed the probe, so each rank makes the same first choice now
            rate = tuner.measure_compute() if run.cfg.cluster.compute_seconds is None else None
            mode = tuner.choose_at_start(fed.mode, rate)
            extras["fl_tune_start"] = tuner.start_choice
    files.write_config(config_to_json(run.cfg, extras))
    return TuningHook(tuner, device), state, mode
