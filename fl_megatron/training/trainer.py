"""The training loop: build everything from the config, train, sync, evaluate, report."""

import math
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from ..backends import make_backend
from ..checkpoint import Checkpointer
from .initial_values import initial_values_for
from ..config import ResolvedRun
from ..config.flags import config_to_json
from ..config.sync_mode import SyncMode
from ..cost_model.calibrate import cluster_from_probe, dry_run_flags
from ..cost_model.network import Cluster
from ..cost_model.tune import PRECISIONS
from ..data import eval_batches
from ..faults import delay_seconds, lockstep, nan_requested
from ..federation import CollectiveCounter, CommLedger, FederationEngine, SyncResult, build_process_groups
from ..federation.failed_collective import is_failed_collective
from ..federation.vote import GroupFigures
from ..federation.link_probe import probe_links
from ..federation.membership import TooFewGroups
from .console import batch_line, federation_line, format_duration, progress_line, say
from .dashboards import Dashboards, RunRecords
from .failures import PhaseTracker
from .healing import HealingState, MembershipLog, shard_digests
from .determinism import make_deterministic
from .launch import LaunchEnv, init_distributed
from .lr_schedule import learning_rate
from .memory import peak_memory_bytes, peak_memory_kind
from .run_data import next_token_loss, open_run_data
from .run_files import RunFiles
from .step_records import Interval, step_record, vote_figures
from .tuning import SyncTuner, probe_line, resumed_choice, trial_step
from .stopping import StopPolicy


@dataclass
class _Calibrated:
    """Payload bytes of a repeated piece of work (a training step, an evaluation), measured once."""

    by_tier: Optional[dict] = None


class StepOutcome(NamedTuple):
    """One optimizer step as this rank saw it."""

    loss: torch.Tensor              # this rank's loss
    grad_norm: torch.Tensor
    lr: float
    sync: Optional[SyncResult]      # the sync that ran or landed after it
    figures: Optional[GroupFigures]  # the group's figures (reduced inside the group), when logged or voted
    too_few: Optional[TooFewGroups] = None  # elastic mode: the sync's quorum timed out with too few groups


class Trainer:
    """One rank's training run. Construct after the config was validated for this world."""

    def __init__(self, run: ResolvedRun, env: LaunchEnv, samples=None) -> None:
        """`samples`: (train, valid) samples already opened by the caller, or None to open them."""
        cfg = run.cfg
        self.run, self.cfg, self.env, self.layout = run, cfg, env, run.layout
        self.is_writer = env.job_rank == 0  # elastic mode: each group's job writes its own run directory
        self.federated = run.layout.is_federated
        self.elastic = cfg.federation.elastic
        t = cfg.training
        self.accum = run.accumulation
        if t.deterministic_mode:
            make_deterministic()  # before NCCL or any matrix product touches the GPU
        init_distributed(env, cfg.parallel.distributed_timeout_minutes)
        self.phases = PhaseTracker(env.job_rank, env.job_world_size, t.run_dir, fault_rank=env.rank)
        self.device = env.device
        self.files = RunFiles(t.run_dir, self.is_writer)
        self.files.write_config(config_to_json(cfg))
        self._banner()
        torch.manual_seed(t.seed)
        self.train_source, self.valid_samples = self._load_data(samples)
        self.healing = HealingState()
        self.groups = self._process_groups(timedelta(minutes=cfg.parallel.distributed_timeout_minutes))
        self.group = self.groups.coords[0]
        # each group's first rank writes the group's records (federated runs: groups/group_GGGGG.jsonl)
        self.group_writer = self.federated and self.groups.coords[1:] == (0, 0)
        self.tuner, tune_state, mode = self._probe_and_tune()
        initial = initial_values_for(run, say if self.is_writer else None)
        self.backend = make_backend(run, self.groups, self.device, initial)
        self.ledger = CommLedger()
        self.engine = FederationEngine(self.backend, self.groups, cfg.federation, self.ledger, mode)
        self.checkpointer = Checkpointer(run, env.rank, self.backend, self.engine)
        if self.tuner is not None:
            self.checkpointer.tune_state = self.tuner.state
            self.tuner.load_state(tune_state)
        self.start_step = self.checkpointer.resume(lambda text: say(text, self.is_writer))
        self.healing.backend, self.healing.engine = self.backend, self.engine
        self.healing.step = self.healing.last_sync = self.start_step
        self.members = MembershipLog(self.group, self.layout.num_groups,
                                     t.micro_batch_size * self.accum * self.layout.group_size)
        self._membership_fields: dict = {}  # elastic mode: who met at the last sync (its records carry them)
        self._joining_sync: Optional[SyncResult] = self._join() if self.elastic else None
        self.files.open_metrics(self.start_step)
        if self.group_writer:
            self.files.open_group_metrics(self.group)
        self._stop: Optional[StopPolicy] = None  # while train() runs
        self.records = RunRecords(self.files, Dashboards(t, cfg.to_dict(), self.is_writer))
        self._started = time.perf_counter()  # reset when training starts; elapsed_s counts from it
        self._step_traffic = _Calibrated()
        self._eval_traffic = _Calibrated()

    # --- set-up ---------------------------------------------------------------------------
    def _process_groups(self, timeout: timedelta):
        """The rank's groups; in elastic mode this job's own, and torchft's tier to the others."""
        cfg = self.cfg
        if not self.elastic:
            fed = cfg.federation
            return build_process_groups(self.layout, self.device.type, timeout,
                                        exchange=bool(fed.overlap_steps) or (fed.tune and fed.tune_overlap),
                                        async_checkpoint=cfg.checkpoint.async_save)
        from ..elastic import build_elastic_process_groups, federation_signature, join_tier
        from ..models import count_parameters

        signature = federation_signature(self.run, count_parameters(cfg.model))
        tier = join_tier(cfg.federation, self.env.job_rank, self.env.job_world_size, self.device.type, timeout,
                         self.healing.source, self.healing.receive, lambda: self.healing.step, signature,
                         lambda text: say(text, self.is_writer), cfg.training.run_dir)
        return build_elastic_process_groups(self.layout, self.env.rank, self.device.type, tier, timeout,
                                            async_checkpoint=cfg.checkpoint.async_save)

    def _probe_and_tune(self) -> tuple[Optional[SyncTuner], dict, Optional[SyncMode]]:
        """The start-up link probe (federated, syncing runs), its line in the banner and config.json,
        and with --fl-tune the tuner, its state and the mode a resumed checkpoint chose."""
        fed = self.cfg.federation
        if not (self.federated and fed.syncing and fed.link_probe) or self.elastic:
            return None, {}, None
        codecs = PRECISIONS[1:PRECISIONS.index(fed.tune_lowest_precision) + 1] if fed.tune else ()
        # what an overlap costs: at the probe only where no step can be timed beside a trial exchange
        overlap = self.groups.exchange_peer if fed.tune and fed.tune_overlap and trial_step(fed) is None else None
        probe = probe_links(self.groups, self.device, codecs, overlap)
        cluster = cluster_from_probe(self.layout, probe, Cluster.from_config(self.cfg.cluster))
        say(probe_line(probe, cluster), self.is_writer)
        self.files.write_config(config_to_json(self.cfg, {"link_probe": {**probe.to_dict(),
                                                                         "dry_run_flags": dry_run_flags(cluster)}}))
        if not fed.tune:
            return None, {}, None
        mode, state = resumed_choice(self.cfg.checkpoint)
        if mode is not None:
            say(f"  fl-tune: resuming in the mode the checkpoint's run chose: {mode.label()}", self.is_writer)
        tuner = SyncTuner(self.run, self.groups, probe, lambda text: say(text, self.is_writer), self.device)
        return tuner, state, mode

    def _join(self) -> Optional[SyncResult]:
        """Elastic mode, at start-up: meet the live groups. At a fresh start every group is at step
        0 and nothing moves; a restarted or new group waits for the live groups' next sync, heals
        there from them (shards, inner optimizer state, the engine's state, the step) and takes
        part in that sync as a receiver. Returns that sync, or None."""
        say(f"  group {self.group}: meeting the live groups (lighthouse {self.cfg.federation.lighthouse})",
            self.is_writer)
        self.healing.at_start = True
        membership = self.groups.meet()
        self.healing.at_start = False
        read = f"checkpoint of step {self.checkpointer.loaded}" if self.checkpointer.loaded else "no checkpoint"
        if not membership.healed or self.healing.source_at_start:
            # every group at the start (a fresh or resumed federation): a group behind the others
            # took their state in the quorum; nobody syncs now
            self._start_barrier()
            if not self.groups.commit():
                raise RuntimeError(f"group {self.group}: the start-up quorum was voted down (a peer lost); restarting")
            self.members.live = membership.groups
            if membership.healed:
                self.start_step = self.healing.step
                say(f"  group {self.group}: behind the others' checkpoints ({read}): took their state of step "
                    f"{self.start_step} in {membership.seconds:.2f} s", self.is_writer)
            say(f"  group {self.group}: joined groups {', '.join(map(str, membership.groups))} at step "
                f"{self.start_step}", self.is_writer)
            return None
        self.start_step = self.healing.step
        say(f"  group {self.group}: healed from the live groups at step {self.start_step} in "
            f"{membership.seconds:.2f} s ({read} read)", self.is_writer)
        sync = self.engine.sync(self.start_step, GroupFigures(healing=True), full=True, membership=membership)
        if not sync.committed:
            raise RuntimeError(f"group {self.group}: the sync it healed at (step {self.start_step}) was voted down; "
                               "restarting")
        return sync

    def _start_barrier(self) -> None:
        """One all-reduce over this rank's peers of the start-up quorum. A group behind fetches a
        source's state inside the quorum, and torchft stops serving it at the source's commit: the
        source waits here until every rank of the groups behind has it. A lost peer votes the
        quorum down."""
        try:
            dist.all_reduce(torch.zeros(1, device=self.device), group=self.groups.peer)
        except RuntimeError as e:
            if not is_failed_collective(e):
                raise
            self.groups.report_error(e)

    def _banner(self) -> None:
        if not self.is_writer:
            return
        from ..models import count_parameters
        c, t, lay = self.cfg, self.cfg.training, self.layout
        ds_scheduler = (c.deepspeed or {}).get("scheduler")
        lr_schedule = (f"DeepSpeed scheduler {ds_scheduler.get('type')} from its config" if ds_scheduler
                       else f"{t.lr_decay_style}, warm-up {t.lr_warmup_iters}")
        lines = [
            "fl-megatron pretrain",
            *("  " + line for line in lay.describe().splitlines()),
            f"  model: {c.preset or c.model.arch} ({count_parameters(c.model):,} parameters), "
            f"backend {c.parallel.backend} on {self.device.type}, {'bf16' if t.bf16 else 'fp32'}",
            batch_line(t, self.accum, lay),
            federation_line(lay, c.federation),
            f"  {t.train_iters} steps of {t.optimizer}, lr {t.lr:g} ({lr_schedule}), run dir {t.run_dir}",
        ]
        say("\n".join(lines))

    def _load_data(self, samples=None):
        """Train batches and valid samples; rank 0 prepares the caches (see open_run_data)."""
        return open_run_data(self.run, self.env.world_size, self.is_writer, samples)

    # --- one step -------------------------------------------------------------------------
    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        return next_token_loss(self.backend, batch, self.cfg.model.vocab_size, self.device)

    def _train_step(self, step: int, lr: float) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Forward/backward over the micro-batches, clip, optimizer step.

        Returns (loss, grad norm, learning rate used)."""
        self.phases.enter("forward-backward", step + 1)
        total = torch.zeros((), device=self.device)
        for micro in range(self.accum):
            loss = self._loss(self.train_source.micro_batch(self.env.rank, step, micro))
            self.backend.backward(loss, self.accum, last=micro == self.accum - 1)
            total += loss.detach()
        self.phases.enter("optimizer-step", step + 1)
        norm, lr = self.backend.optimizer_step(lr)
        return total / self.accum, norm, lr

    def step(self, step: int) -> StepOutcome:
        """Optimizer step `step` (0-based) and the sync after it when due. Between syncs every
        collective stays inside the federation group: the group's figures are reduced there (on
        logged steps, sync steps and, for a single group watching for a stop, every step), and
        the groups only meet in the sync's vote."""
        t = self.cfg.training
        done, last = step + 1, step + 1 == t.train_iters
        pause = delay_seconds(self.group, done)  # a straggler, for tests and benchmarks (FL_MEGATRON_FAULT)
        if pause:
            time.sleep(pause)
        lr = learning_rate(step, t)
        trial = self.tuner.start_trial(done, self.engine) if self.tuner is not None else None
        began = time.perf_counter()
        loss, norm, lr = self._measured(self._step_traffic, lambda: self._train_step(step, lr))
        if trial is not None:
            self.tuner.end_trial(trial, time.perf_counter() - began)
        elif self.tuner is not None:
            self.tuner.observe_step(time.perf_counter() - began)
        if nan_requested(self.group, done):  # a sick group, for tests (FL_MEGATRON_FAULT)
            with torch.no_grad():
                self.backend.local_shards()[0].view(-1)[0] = math.nan
        self.healing.step = done
        voting = self.engine.due(done, last)
        figures = None
        if voting or last or done % t.log_interval == 0 or self._agrees_in_group():
            figures = self._group_figures(done, loss, norm)
        self.phases.enter("sync", done)
        switch = self.tuner.decide(done, self.engine.mode) if self.tuner is not None and voting and not last else None
        try:
            sync = self.engine.after_step(done, last=last, loss=loss, figures=figures, full=switch is not None)
        except TooFewGroups as e:  # every rank of the group waited out the same quorum: the step stands
            return StepOutcome(loss, norm, lr, None, figures, e)
        if self.tuner is not None:
            self._after_tuning(done, sync, switch)
        if lockstep():  # the coupled loop, for the benchmark's "before" row
            dist.all_reduce(torch.zeros(2, device=self.device))
        if sync is not None and self.elastic:
            self._elastic_sync(sync)
        if sync is not None and sync.sick_groups:
            say(f"  step {done}: federation group(s) {', '.join(map(str, sync.sick_groups))} left out of the "
                "average (non-finite shards or a diverged loss) and reset to the others' average", self.is_writer)
        return StepOutcome(loss, norm, lr, sync, figures)

    def _after_tuning(self, done: int, sync: Optional[SyncResult], switch: Optional[SyncMode]) -> None:
        """Switch mode after the full sync a new choice asked for; record the decision; let the
        tuner see the scheduled syncs."""
        if switch is not None:
            self.engine.switch_mode(switch)
        elif sync is not None:
            self.tuner.observe_sync(sync.exchange_seconds)
        record, self.tuner.last_record = self.tuner.last_record, None
        if record is not None and self.is_writer:
            self.records.log(record)

    def _elastic_sync(self, sync: SyncResult) -> None:
        """Who met at `sync`: console lines and the fields its records carry (elastic mode)."""
        fields, lines = self.members.after_sync(sync, self.healing)
        if self.cfg.federation.sync_digest:
            fields["shard_digests"] = shard_digests(self.backend.local_shards(), self.groups.federation)
        self._membership_fields = fields
        for line in lines:
            say(line, self.is_writer)

    def _group_figures(self, done: int, loss: torch.Tensor, norm: torch.Tensor) -> GroupFigures:
        """The group's mean loss and gradient norm of this step, and whether any of its ranks
        asked to stop: one all-reduce of four numbers inside the federation group."""
        self.phases.enter("logging", done)
        requests = self._stop.requests() if self._stop is not None and self._stop.watching else (False, False)
        figures = torch.stack([loss.detach().float().reshape(()),
                               torch.as_tensor(norm, dtype=torch.float32, device=self.device).reshape(())])
        stats = torch.cat([figures, torch.tensor(requests, dtype=torch.float32, device=self.device)])
        dist.all_reduce(stats, group=self.groups.federation)
        total_loss, total_norm, signalled, timed_out = stats.tolist()
        size = self.layout.group_size
        return GroupFigures(total_loss / size, total_norm / size, signalled > 0, timed_out > 0)

    def _agrees_in_group(self) -> bool:
        """Whether stop requests are agreed inside the group after every step: a single group
        (it is the job) watching for a signal or a time limit."""
        return not self.federated and self._stop is not None and self._stop.watching

    def _agreed_stop(self, done: int, figures: Optional[GroupFigures]) -> Optional[tuple[bool, bool]]:
        """Every rank's stop requests combined after step `done`, where this step agreed them."""
        stop = self._stop
        if not stop.watching:
            return None
        if not self.federated:
            return (figures.signalled, figures.timed_out)
        if self.engine.active:  # at the vote of a sync, if this step had one
            vote = self.engine.vote
            return (vote.signalled, vote.timed_out) if vote is not None and vote.step == done else None
        # independent groups (averaging disabled) never meet: a small all-reduce over the job
        flags = torch.tensor(stop.requests(), dtype=torch.float32, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signalled, timed_out = flags.tolist()
        return (signalled > 0, timed_out > 0)

    def _measured(self, calibrated: _Calibrated, work):
        """Run `work`; the first time under a collective counter, to learn its payload bytes."""
        if calibrated.by_tier is not None:
            result = work()
        else:
            with CollectiveCounter() as counter:
                result = work()
            calibrated.by_tier = self._classify(counter)
        for tier, nbytes in calibrated.by_tier.items():
            self.ledger.add("intra-group", tier, nbytes)
        return result

    def _classify(self, counter: CollectiveCounter) -> dict:
        """Backend collectives stay inside the group: gathers and scatters on the shard group,
        all-reduces on the replica group under HSDP (tiny norm reductions are counted with them)."""
        shard_tier = self.groups.tier("shard")
        replica_tier = self.groups.tier("replica") if self.layout.is_hsdp else shard_tier
        out: dict = {}
        for op, nbytes in counter.payload.items():
            tier = replica_tier if op.startswith(("allreduce", "all_reduce")) else shard_tier
            out[tier] = out.get(tier, 0) + nbytes
        return out

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean held-out loss over all ranks: each group evaluates its own model on its ranks'
        share of a fixed held-out set, so after a sync this is the averaged model's loss."""
        t = self.cfg.training
        # elastic mode: each group evaluates the whole held-out set on its own (groups meet only at syncs)
        rank, world = (self.env.job_rank, self.env.job_world_size) if self.elastic else \
            (self.env.rank, self.env.world_size)
        batches = eval_batches(self.valid_samples, rank, world, t.micro_batch_size, t.eval_iters)

        def work():
            return torch.stack([self._loss(b) for b in batches]).mean()

        loss = self._measured(self._eval_traffic, work).reshape(1)
        if self.elastic:
            dist.all_reduce(loss, group=self.groups.federation)
            return float(loss) / world
        self.groups.all_reduce_job(loss)  # an evaluation is a meeting of the groups
        return float(loss) / world

    # --- the loop -------------------------------------------------------------------------
    def train(self) -> dict:
        """Train from `start_step` (0, or the resumed checkpoint's step) to --train-iters, or until
        a stop condition; save on --save-interval, at the end and before stopping early. A failed
        collective (a peer died or hung) becomes a PeerLost naming this rank's phase."""
        self._stop = StopPolicy(self.cfg.checkpoint)
        try:
            return self._train(self._stop)
        except TooFewGroups:  # the groups' quorum timed out; this group's own collectives are fine
            raise
        except RuntimeError as e:
            lost = self.phases.explain(e)
            if lost is None:
                raise
            raise lost from e
        finally:
            self._stop.close()
            self._stop = None

    def _train(self, stop: StopPolicy) -> dict:
        t, options = self.cfg.training, self.cfg.checkpoint
        start = self._started = time.perf_counter()
        intervals = (Interval(start), Interval(start))  # since the last group record, federation record
        stopped, done, last = None, self.start_step, None
        evals: list[dict] = []
        if self._joining_sync is not None:  # the sync this group healed at, before its first step
            self._elastic_sync(self._joining_sync)
            if self.is_writer:
                self.records.log({"step": self.start_step, "elapsed_s": 0.0, "sync_seconds": self._joining_sync.seconds,
                                  **self._membership_fields})
        step, too_few = self.start_step, None
        while step < t.train_iters:
            done = step + 1
            outcome = self.step(step)
            step = done
            if outcome.sync is not None and outcome.sync.membership is not None and outcome.sync.membership.healed:
                # a live group that missed a quorum healed at this one: it goes on from the live groups' step
                say(f"  group {self.group}: behind the live groups, healed at their step {self.healing.step} in "
                    f"{outcome.sync.membership.seconds:.2f} s", self.is_writer)
                step = done = self.healing.step
            last = outcome
            for interval in intervals:
                interval.steps += 1
            if outcome.too_few is not None:  # log, save (--save) this step's state, before the sync, and stop
                too_few = outcome.too_few
                stopped = f"too few groups at the sync of step {done}: {too_few}"
            else:
                stopped = stop.reason(done, self._agreed_stop(done, outcome.figures)) if done < t.train_iters else None
            if outcome.figures is not None or outcome.sync is not None:
                eta = (time.perf_counter() - start) / (done - self.start_step) * (t.train_iters - done)
                self._log_step(done, outcome, intervals, eta)
            if self.checkpointer.pending is not None and self._publish_due(done):
                self._publish_pending(done)
            if options.saving and (done == t.train_iters or stopped or
                                   (options.save_interval and done % options.save_interval == 0)):
                self.phases.enter("checkpoint-write", done)
                if self.engine.flight is not None:  # a sync in flight lands before the save; it is recorded
                    self._record_landing(done, self.engine.land(), outcome.lr)
                path = self.checkpointer.save(done)
                if self.checkpointer.pending is None:
                    say(f"  saved checkpoint {path}", self.is_writer)
                else:
                    say(f"  checkpoint of step {done} staged, being written in the background", self.is_writer)
            if t.eval_iters and t.eval_interval and done % t.eval_interval == 0 and done != t.train_iters:
                evals.append(self._eval_record(done))  # a stop at an evaluation step evaluates first
            if stopped:
                say(f"  stopping after step {done} ({stopped})", self.is_writer)
                break
        if self.checkpointer.pending is not None:  # the last one (or a stop's) is published before leaving
            self._publish_pending(done)
        wall = time.perf_counter() - start
        final_eval = self._eval_record(done) if t.eval_iters and not stopped else None
        self.phases.enter("summary", done)
        summary = self._summary(self._final_loss(done, last), final_eval, evals, wall, done, stopped)
        # Leave together: a rank tearing down gloo while a peer is still in its last
        # collectives can abort the peer at exit.
        dist.barrier()
        if too_few is not None:
            raise too_few
        return summary

    def _publish_due(self, done: int) -> bool:
        """Whether a checkpoint written in the background is published after step `done`: at
        the first sync after it (the groups meet then anyway), or H steps after it for a single
        group or groups that never sync."""
        vote = self.engine.vote
        if self.federated and self.engine.active:
            return vote is not None and vote.step == done and done > self.checkpointer.pending.iteration
        return done >= self.checkpointer.pending.iteration + self.engine.config.sync_interval

    def _publish_pending(self, done: int) -> None:
        self.phases.enter("checkpoint-write", done)
        path = self.checkpointer.finish_pending()
        say(f"  saved checkpoint {path} (written in the background)", self.is_writer)

    def _log_step(self, done: int, outcome: StepOutcome, intervals: tuple, eta: float) -> None:
        """Record and print one step: the group's record (each group's first rank) and, at a
        vote or with a single group, the federation's (rank 0). See docs/metrics.md."""
        self.phases.enter("logging", done)
        now, t, sync, figures = time.perf_counter(), self.cfg.training, outcome.sync, outcome.figures
        elapsed, per_step = now - self._started, self.run.tokens_per_step
        vote = self.engine.vote if self.engine.vote is not None and self.engine.vote.step == done else None
        if figures is not None and (self.group_writer or not self.federated):
            steps, seconds = intervals[0].take(now)
            group_tokens = per_step // self.layout.num_groups
            record = step_record(done, per_step, elapsed, figures.loss, figures.grad_norm, outcome.lr,
                                 steps * group_tokens / max(seconds, 1e-9), sync, self.ledger.snapshot(), seconds)
            if self.federated:
                self.files.log_group({"group": self.group, **record})
                if self.is_writer and vote is None:
                    say(f"  group {self.group} " + progress_line(record, t.train_iters, eta))
            else:
                self._log_federation(record, sync, eta)
        if self.is_writer and self.federated and (vote is not None or sync is not None):
            steps, seconds = intervals[1].take(now)
            if vote is not None:
                loss, norm, groups = vote_figures(vote)
            else:  # an overlapped sync landing: its figures were recorded at its launch
                loss, norm, groups = None, None, {}
            record = step_record(done, per_step, elapsed, loss, norm, outcome.lr,
                                 steps * per_step / max(seconds, 1e-9), sync, self.ledger.snapshot(), seconds)
            if self.elastic and sync is not None:
                groups = {**groups, **self._membership_fields}
            self._log_federation({k: v for k, v in {**record, **groups}.items() if v is not None}, sync, eta)

    def _record_landing(self, done: int, sync: SyncResult, lr: float) -> None:
        """An overlapped sync landed early, for a checkpoint of step `done`: a federation record of
        its own (`landed_for_checkpoint`), and the tuner sees it like any other landing."""
        if self.tuner is not None:
            self.tuner.observe_sync(sync.exchange_seconds)
        if self.is_writer:
            record = step_record(done, self.run.tokens_per_step, time.perf_counter() - self._started, None, None, lr,
                                 None, sync, self.ledger.snapshot())
            self.records.log({**{k: v for k, v in record.items() if v is not None}, "landed_for_checkpoint": True})

    def _log_federation(self, record: dict, sync: Optional[SyncResult], eta: float) -> None:
        """A federation record: metrics.jsonl, the dashboards, the console (rank 0)."""
        if not self.is_writer:
            return
        self.records.log(record)
        if sync is not None and sync.consensus is not None:
            self.files.log_detail({"step": record["step"], "graph": sync.graph, "tensors": sync.consensus.tensors})
        if "loss" in record:
            line = progress_line(record, self.cfg.training.train_iters, eta)
            losses = [v for v in record.get("group_losses", []) if v is not None]
            if losses:
                line += f" | groups {min(losses):.4f}-{max(losses):.4f}"
            say(line)

    def _eval_record(self, step: int) -> dict:
        self.phases.enter("evaluation", step)
        loss = self.evaluate()
        record = {"step": step, "elapsed_s": time.perf_counter() - self._started, "eval_loss": loss,
                  "eval_perplexity": math.exp(min(loss, 50.0))}
        self.records.log(record)
        say(f"  eval at step {step}: loss {loss:.4f}, perplexity {record['eval_perplexity']:.2f}", self.is_writer)
        return record

    def _final_loss(self, done: int, last: Optional[StepOutcome]) -> Optional[float]:
        """The last step's train loss as its records give it, computed once: the vote's mean over
        the groups where that step voted (the federation record), else the group's own figure (the
        group record; a single group and an elastic group are their job). Only a federation stopped
        between syncs, or whose groups never sync, has no record over all groups: there the groups'
        figures are averaged over the job here."""
        if last is None:
            return None
        vote = self.engine.vote
        if vote is not None and vote.step == done:
            return vote_figures(vote)[0]
        figures = last.figures or self._group_figures(done, last.loss, last.grad_norm)
        if not self.federated or self.elastic:
            return figures.loss
        total = torch.tensor([figures.loss], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)  # every rank holds its group's figure: the sum over ranks is G x the sum over groups
        return float(total) / self.env.world_size

    def _summary(self, final_loss: Optional[float], final_eval: Optional[dict], evals: list, wall: float,
                 done: int, stopped: Optional[str]) -> dict:
        """summary.json (rank 0) from one all-reduce and one all-gather over the job: the end of
        the run may use the whole world. `final_loss`: see `_final_loss`."""
        snapshot = self.ledger.snapshot()
        keys = sorted(snapshot)
        totals = torch.tensor([float(snapshot[k]) for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)  # over the job: in elastic mode, this group
        peak = torch.tensor([float(peak_memory_bytes(self.device))], dtype=torch.float64, device=self.device)
        peaks = [torch.zeros_like(peak) for _ in range(self.env.job_world_size)]
        dist.all_gather(peaks, peak)
        tokens = (done - self.start_step) * self.run.tokens_per_step
        summary = {
            "first_step": self.start_step + 1, "last_step": done, "stopped_early": stopped,
            "final_train_loss": final_loss,
            "eval_loss": final_eval["eval_loss"] if final_eval else None,
            "eval_perplexity": final_eval["eval_perplexity"] if final_eval else None,
            "evals": evals + ([final_eval] if final_eval else []),
            "tokens": tokens,
            "wall_seconds": wall,
            "tokens_per_s": tokens / max(wall, 1e-9),
            "bytes_per_rank_rank0": snapshot,
            "bytes_all_ranks": {k: int(v) for k, v in zip(keys, totals.tolist())},
            "peak_memory_bytes_per_rank": [int(p.item()) for p in peaks],
            "peak_memory_kind": peak_memory_kind(self.device),
            "last_sync_step": self.engine.last_synced_step,
            "layout": {"world_size": self.layout.world_size, "ranks_per_node": self.layout.ranks_per_node,
                       "group_size": self.layout.group_size, "num_groups": self.layout.num_groups,
                       "hsdp_shard_size": self.layout.shard_size, "replicas": self.layout.replicas,
                       "sync_interval": self.engine.config.sync_interval if self.engine.active else 0},
        }
        if self.elastic:
            summary["elastic"] = {"group": self.group, **self.members.summary(self.healing)}
        self.files.write_summary(summary)
        say(f"done: {done - self.start_step} steps in {format_duration(wall)}, {summary['tokens_per_s']:,.0f} tok/s, "
            f"final train loss {math.nan if final_loss is None else final_loss:.4f}"
            + (f", eval loss {summary['eval_loss']:.4f} (perplexity {summary['eval_perplexity']:.2f})"
               if final_eval else "")
            + f"\n  bytes per rank: intra-group {snapshot['intra_group_bytes'] / 2**20:,.1f} MiB, "
              f"inter-group {snapshot['inter_group_bytes'] / 2**20:,.1f} MiB; summary in {self.files.dir / 'summary.json'}"
            + self._export_hint(), self.is_writer)
        return summary

    def _export_hint(self) -> str:
        """The command that turns the last checkpoint into a Hugging Face directory (with --save)."""
        save = self.cfg.checkpoint.save
        if not save or self.elastic:
            return ""
        out = str(save).rstrip("/") + "-hf"
        return (f"\n  Hugging Face export of the groups' average: python tools/convert_checkpoint_to_hf.py "
                f"--checkpoint {save} --output {out}")

    def close(self) -> None:
        self.engine.close()
        self.checkpointer.finish_pruning()
        self.records.close()

    def abandon(self) -> None:
        """Close the run's files only: after a PeerLost nothing may wait on a peer again."""
        self.records.close()
