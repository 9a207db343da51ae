"""The training loop: train, sync, evaluate, save, report. What it runs on is built by build.py;
what differs between one world and elastic mode is its session's (session.py, elastic/session.py)."""

import dataclasses
import math
import time
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from ..config import ResolvedRun
from ..data import eval_batches
from ..faults import delay_seconds, lockstep, nan_requested
from ..federation import SyncResult
from ..federation.membership import TooFewGroups
from ..federation.vote import GroupFigures
from .build import build_run
from .console import say
from .launch import LaunchEnv
from .lr_schedule import learning_rate
from .run_data import next_token_loss
from .step_records import vote_figures
from .stopping import StopPolicy


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
        parts = build_run(run, env, samples)
        self.run, self.cfg, self.env, self.layout = run, run.cfg, env, run.layout
        self.accum, self.device, self.federated = run.accumulation, env.device, run.layout.is_federated
        self.is_writer = env.job_rank == 0
        self.phases, self.files, self.session, self.groups = parts.phases, parts.files, parts.session, parts.groups
        self.train_source, self.valid_samples = parts.train_source, parts.valid_samples
        self.backend, self.ledger, self.engine, self.tuning = parts.backend, parts.ledger, parts.engine, parts.tuning
        self.checkpointer, self.checkpoints = parts.checkpointer, parts.checkpoints
        self.reporter, self.traffic, self.start_step = parts.reporter, parts.traffic, parts.start_step
        self.group = self.groups.coords[0]
        self.rounds = parts.rounds  # per-group step counts (--fl-group-intervals, --fl-balance-steps)
        self._stop: Optional[StopPolicy] = None  # while train() runs

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
        t, rounds = self.cfg.training, self.rounds
        done, last = step + 1, step + 1 == t.train_iters
        if rounds:
            rounds.begin_step()
        pause = delay_seconds(self.group, done)  # a straggler, for tests and benchmarks (FL_MEGATRON_FAULT)
        if pause:
            time.sleep(pause)
        lr = learning_rate(rounds.position() if rounds else step, t)  # per-group counts: the federation's tokens
        trial = self.tuning.before_step(done, self.engine)
        loss, norm, lr = self.traffic.measured(self.traffic.step, lambda: self._train_step(step, lr))
        self.tuning.after_step(trial)
        at, due = done, None  # the sync's step, and whether one follows (None: the engine's schedule)
        if rounds:
            rounds.stepped()
            due, last = rounds.due, rounds.last
            at = rounds.clock.sync_step() if due else done
        if nan_requested(self.group, done):  # a sick group, for tests (FL_MEGATRON_FAULT)
            with torch.no_grad():
                self.backend.local_shards()[0].view(-1)[0] = math.nan
        self.session.at_step(done)
        voting = self.engine.due(done, last) if due is None else due
        figures = None
        if voting or last or done % t.log_interval == 0 or self._agrees_in_group():
            figures = self._group_figures(done, loss, norm)
        if voting and rounds:
            figures = dataclasses.replace(figures, **rounds.vote_fields())
        self.phases.enter("sync", done)
        choice = self.tuning.decide(done, self.engine.mode, voting, last)
        before, choice = self.tuning.before_or_after(self.engine, choice, planned=bool(rounds))
        full = self.tuning.ask(choice, figures)
        try:
            sync = self.engine.after_step(at, last=last, loss=loss, figures=figures, full=full, due=due, switch=before)
        except TooFewGroups as e:  # every rank of the group waited out the same quorum: the step stands
            return StepOutcome(loss, norm, lr, None, figures, e)
        switch = self.tuning.agreed(self.engine, sync, choice, done, voting)
        decision = self.tuning.after_sync(self.engine, sync, switch)
        if decision is not None:
            self.reporter.log(decision)
        if lockstep():  # the coupled loop, for the benchmark's "before" row
            dist.all_reduce(torch.zeros(2, device=self.device))
        if rounds and voting:  # every rank plans the next round alike, from the vote's step times
            rounds.advance(self.engine.vote.step_seconds)
        if sync is not None:
            if sync.landed is not None:  # an overlapped sync that landed first, at this step
                self.session.after_sync(sync.landed)
            self.session.after_sync(sync)
            if sync.sick_groups:
                say(f"  step {done}: federation group(s) {', '.join(map(str, sync.sick_groups))} left out of the "
                    "average (non-finite shards or a diverged loss) and reset to the others' average", self.is_writer)
        return StepOutcome(loss, norm, lr, sync, figures)

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
        size = self.groups.layout.group_size  # this rank's group (groups may differ in size)
        return GroupFigures(total_loss / size, total_norm / size, signalled > 0, timed_out > 0)

    def _agrees_in_group(self) -> bool:
        """Whether stop requests are agreed inside the group after every step: a single group
        (it is the job) watching for a signal or a time limit."""
        return not self.federated and self._stop is not None and self._stop.watching

    def _agreed_stop(self, done: int, figures: Optional[GroupFigures],
                     sync: Optional[SyncResult] = None) -> Optional[tuple[bool, bool]]:
        """Every rank's stop requests combined after step `done`, where this step agreed them.
        `sync`: the sync this step made (its vote agreed them; in elastic mode a group that healed
        there voted at its own, older step and goes on at the live groups' step `done`)."""
        stop = self._stop
        if not stop.watching:
            return None
        if not self.federated:
            return (figures.signalled, figures.timed_out)
        if self.engine.active:  # at the vote of a sync (or of an overlapped launch), if this step had one
            vote = self.engine.vote
            voted_here = vote is not None and (vote.step == done or (sync is not None and vote.step == sync.step))
            return (vote.signalled, vote.timed_out) if voted_here else None
        # independent groups (averaging disabled) never meet: a small all-reduce over the job
        flags = torch.tensor(stop.requests(), dtype=torch.float32, device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signalled, timed_out = flags.tolist()
        return (signalled > 0, timed_out > 0)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean held-out loss over the ranks of the session's share: each group evaluates its own
        model on its ranks' share of a fixed held-out set, so after a sync this is the averaged
        model's loss (elastic mode: each group the whole set, on its own)."""
        t = self.cfg.training
        rank, world = self.session.evaluation_share()
        batches = eval_batches(self.valid_samples, rank, world, t.micro_batch_size, t.eval_iters)
        loss = self.traffic.measured(self.traffic.evaluation,
                                     lambda: torch.stack([self._loss(b) for b in batches]).mean()).reshape(1)
        self.session.reduce_evaluation(loss)
        return float(loss) / world

    def _evaluation(self, step: int) -> dict:
        self.phases.enter("evaluation", step)
        return self.reporter.evaluation(step, self.evaluate())

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
        t = self.cfg.training
        self.reporter.start(self.start_step)
        step = done = self.start_step
        stopped, last, too_few, evals = None, None, None, []
        running = (lambda: self.rounds.running) if self.rounds else (lambda: step < t.train_iters)  # noqa: E731
        joined = self.session.joined_sync  # elastic: the sync this group healed at, before its first step
        if joined is not None and self.rounds:  # per-group step counts: as at any sync, by its federation step
            healed_at = StepOutcome(None, None, learning_rate(self.rounds.position(), t), joined, None)
            stopped = self._stop_reason(stop, step, healed_at)
            if stopped:
                say(f"  stopping at step {step}, where it healed ({stopped})", self.is_writer)
                self._save_if_due(step, stopped, healed_at)
        elif joined is not None and step < t.train_iters:  # a stop agreed there holds for it too
            stopped = stop.reason(step, self._agreed_stop(step, None, joined))
            if stopped:
                say(f"  stopping at step {step}, where it healed ({stopped})", self.is_writer)
                self.checkpoints.after_step(step, stopped, learning_rate(step, t))
        while running() and not stopped:
            last = self.step(step)
            step = done = self.session.healed_step(last.sync) or step + 1  # a group behind jumps to the live step
            if last.too_few is not None:  # log, save (--save) this step's state, before the sync, and stop
                too_few = last.too_few
                stopped = f"too few groups at the sync of step {done}: {too_few}"
            else:
                stopped = self._stop_reason(stop, done, last)
            self.reporter.step(done, last, self._federation_step(done, last))
            self._save_if_due(done, stopped, last)
            if t.eval_iters and t.eval_interval and self._evaluation_due(done):
                evals.append(self._evaluation(self._federation_step(done, last)))  # a stop there evaluates first
            if stopped:
                say(f"  stopping after step {done} ({stopped})", self.is_writer)
                break
        self.checkpoints.finish(self._federation_step(done, last))
        wall = self.reporter.elapsed()
        final_eval = self._evaluation(self._federation_step(done, last)) if t.eval_iters and not stopped else None
        self.phases.enter("summary", done)
        summary = self.reporter.summary(self._final_loss(done, last), final_eval, evals, wall, done, stopped,
                                        self.rounds.clock if self.rounds else None)
        # Leave together: a rank tearing down gloo while a peer is still in its last
        # collectives can abort the peer at exit.
        dist.barrier()
        if too_few is not None:
            raise too_few
        return summary

    def _federation_step(self, done: int, last: Optional[StepOutcome]) -> int:
        """The step the federation's records and checkpoints name after step `done`: `done`, or
        with per-group step counts the federation step of the sync that step ended with."""
        if self.rounds and last is not None and last.sync is not None:
            return last.sync.step
        return done

    def _stop_reason(self, stop: StopPolicy, done: int, last: StepOutcome) -> Optional[str]:
        """Why to stop after step `done`, or None (not after the last). With per-group step counts
        only at a sync, at its federation step: the groups meet nowhere else, and --exit-interval
        falls at the first sync at or past each multiple of it."""
        if not self.rounds:
            return stop.reason(done, self._agreed_stop(done, last.figures, last.sync)) \
                if done < self.cfg.training.train_iters else None
        if last.sync is None or not self.rounds.running:
            return None
        at = last.sync.step
        return stop.reason(at, self._agreed_stop(at, last.figures, last.sync),
                           exit_due=self.rounds.crossed(self.cfg.checkpoint.exit_interval or 0))

    def _save_if_due(self, done: int, stopped: Optional[str], last: StepOutcome) -> None:
        """Save after step `done` where due. With per-group step counts only at a sync, named by
        its federation step: at the end, on a stop, and at the first sync at or past each
        multiple of --save-interval."""
        if not self.rounds:
            self.checkpoints.after_step(done, stopped, last.lr)
        elif last.sync is not None:
            due = not self.rounds.running or self.rounds.crossed(self.cfg.checkpoint.save_interval or 0)
            self.checkpoints.after_step(last.sync.step, stopped, last.lr, due=due)

    def _evaluation_due(self, done: int) -> bool:
        """Whether an evaluation follows step `done` (not the last: the final one follows it):
        every --eval-interval steps; with per-group step counts at the first sync at or past each
        multiple of it in federation steps (the groups meet only there)."""
        t = self.cfg.training
        if self.rounds:
            return self.rounds.crossed(t.eval_interval) and self.rounds.running
        return done % t.eval_interval == 0 and done != t.train_iters

    def _final_loss(self, done: int, last: Optional[StepOutcome]) -> Optional[float]:
        """The last step's train loss as its records give it, computed once: the vote's mean over
        the groups where that step voted (the federation record), else the group's own figure (the
        group record; a single group and an elastic group are their job). Only a federation stopped
        between syncs, or whose groups never sync, has no record over all groups: there the groups'
        figures are averaged over the job here."""
        if last is None:
            return None
        vote = self.engine.vote
        if vote is not None and vote.step == self._federation_step(done, last):
            return vote_figures(vote)[0]
        figures = last.figures or self._group_figures(done, last.loss, last.grad_norm)
        if not self.session.losses_cross_groups():
            return figures.loss
        total = torch.tensor([figures.loss], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)  # every rank holds its group's figure: the sum over ranks is G x the sum over groups
        return float(total) / self.env.world_size

    def close(self) -> None:
        self.engine.close()
        self.checkpointer.finish_pruning()
        self.reporter.records.close()

    def abandon(self) -> None:
        """Close the run's files only: after a PeerLost nothing may wait on a peer again."""
        self.reporter.records.close()
