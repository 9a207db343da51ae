"""What a run records and prints: each group's step records, the federation's at each sync (from
its vote) or every logged step with a single group, landings, evaluations and the summary
(docs/metrics.md). Everything goes through one Reporter per rank; only the writing ranks write."""

import math
import time
from typing import Optional

import torch
import torch.distributed as dist

from ..config import ResolvedRun
from ..federation import CommLedger, SyncResult
from ..group_layout import group_sizes_of, layout_record
from .console import format_duration, progress_line, say
from .dashboards import RunRecords
from .memory import peak_memory_bytes, peak_memory_kind
from .run_files import RunFiles
from .step_records import Interval, step_record, vote_figures


class Reporter:
    """One rank's records. `is_writer`: the job's first rank (metrics.jsonl, the console, the
    summary); `group_writer`: its group's first rank in a federated run (groups/group_GGGGG.jsonl)."""

    def __init__(self, run: ResolvedRun, files: RunFiles, records: RunRecords, ledger: CommLedger, engine, session,
                 group: int, is_writer: bool, group_writer: bool, device, job_world_size: int) -> None:
        self.run, self.files, self.records, self.ledger = run, files, records, ledger
        self.engine, self.session, self.group = engine, session, group
        self.is_writer, self.group_writer, self.device = is_writer, group_writer, device
        self.job_world_size = job_world_size
        self.federated = run.layout.is_federated
        self.started = time.perf_counter()  # when training started: elapsed_s counts from it
        self.intervals = (Interval(self.started), Interval(self.started))  # since the last group, federation record
        self.start_step = 0

    def start(self, start_step: int) -> None:
        """Training starts now, at `start_step`; a sync this group healed at is recorded first."""
        self.started = time.perf_counter()
        self.intervals = (Interval(self.started), Interval(self.started))
        self.start_step = start_step
        joined = self.session.joined_sync
        if joined is not None:  # the sync this group healed at, before its first step
            self.session.after_sync(joined)
            self.log({"step": joined.step, "elapsed_s": 0.0, "sync_seconds": joined.seconds,
                      **self.session.record_fields(joined)})

    def log(self, record: dict) -> None:
        """A record of the federation's (metrics.jsonl and the dashboards), on the writing rank."""
        if self.is_writer:
            self.records.log(record)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    # --- steps ------------------------------------------------------------------------------
    def step(self, done: int, outcome, at: Optional[int] = None) -> None:
        """Optimizer step `done` (a StepOutcome) finished: count it, and record and print it where
        it has figures or a sync. `at`: the step the federation's record names, where it is not
        `done` (per-group step counts: the round's federation step)."""
        for interval in self.intervals:
            interval.steps += 1
        if outcome.figures is None and outcome.sync is None:
            return
        train_iters = self.run.cfg.training.train_iters
        eta = max(0.0, self.elapsed() / (done - self.start_step) * (train_iters - done))  # (a group's own steps)
        if outcome.sync is not None and outcome.sync.landed is not None:
            self.landing(done, outcome.sync.landed, outcome.lr, "landed_before_sync")
        self._log_step(done, outcome, eta, done if at is None else at)

    def _log_step(self, done: int, outcome, eta: float, at: int) -> None:
        """The group's record (each group's first rank) and, at a vote or with a single group, the
        federation's (rank 0). See docs/metrics.md."""
        now, t, sync, figures = time.perf_counter(), self.run.cfg.training, outcome.sync, outcome.figures
        elapsed, per_step = now - self.started, self.run.tokens_per_step
        vote = self.engine.vote if self.engine.vote is not None and self.engine.vote.step == at else None
        if figures is not None and (self.group_writer or not self.federated):
            steps, seconds = self.intervals[0].take(now)
            group_tokens = per_step // self.run.world_size * group_sizes_of(self.run.layout)[0][self.group]
            record = step_record(done, per_step, elapsed, figures.loss, figures.grad_norm, outcome.lr,
                                 steps * group_tokens / max(seconds, 1e-9), sync, self.ledger.snapshot(), seconds)
            if self.federated:
                self.files.log_group({"group": self.group, **record})
                if self.is_writer and vote is None:
                    say(f"  group {self.group} " + progress_line(record, t.train_iters, eta))
            else:
                self._log_federation(record, sync, eta)
        if self.is_writer and self.federated and (vote is not None or sync is not None):
            steps, seconds = self.intervals[1].take(now)
            if vote is not None:
                loss, norm, groups = vote_figures(vote)
            else:  # an overlapped sync landing: its figures were recorded at its launch
                loss, norm, groups = None, None, {}
            # per-group step counts: the round's tokens, as the vote gave them (a record per sync)
            trained = sum(groups["group_tokens"]) if groups.get("group_tokens") and None not in groups["group_tokens"] \
                else steps * per_step
            record = step_record(at, per_step, elapsed, loss, norm, outcome.lr,
                                 trained / max(seconds, 1e-9), sync, self.ledger.snapshot(), seconds)
            groups = {**groups, **self.session.record_fields(sync)}
            self._log_federation({k: v for k, v in {**record, **groups}.items() if v is not None}, sync, eta)

    def landing(self, done: int, sync: SyncResult, lr: float, why: str) -> None:
        """An overlapped sync that landed at step `done` before something else (`why`: a checkpoint,
        `landed_for_checkpoint`; a blocking sync at the same step, `landed_before_sync`): a
        federation record of its own."""
        record = step_record(done, self.run.tokens_per_step, self.elapsed(), None, None, lr, None, sync,
                             self.ledger.snapshot())
        record = {**record, **self.session.record_fields(sync)}
        self.log({**{k: v for k, v in record.items() if v is not None}, why: True})

    def _log_federation(self, record: dict, sync: Optional[SyncResult], eta: float) -> None:
        """A federation record: metrics.jsonl, the dashboards, the console (rank 0)."""
        if not self.is_writer:
            return
        self.records.log(record)
        if sync is not None and sync.consensus is not None:
            self.files.log_detail({"step": record["step"], "graph": sync.graph, "tensors": sync.consensus.tensors})
        if "loss" in record:
            line = progress_line(record, self.run.cfg.training.train_iters, eta)
            losses = [v for v in record.get("group_losses", []) if v is not None]
            if losses:
                line += f" | groups {min(losses):.4f}-{max(losses):.4f}"
            say(line)

    def evaluation(self, step: int, loss: float) -> dict:
        """An evaluation's record and line."""
        record = {"step": step, "elapsed_s": self.elapsed(), "eval_loss": loss,
                  "eval_perplexity": math.exp(min(loss, 50.0))}
        self.records.log(record)
        say(f"  eval at step {step}: loss {loss:.4f}, perplexity {record['eval_perplexity']:.2f}", self.is_writer)
        return record

    # --- the end ----------------------------------------------------------------------------
    def summary(self, final_loss: Optional[float], final_eval: Optional[dict], evals: list, wall: float,
                done: int, stopped: Optional[str], rounds=None) -> dict:
        """summary.json (rank 0) from one all-reduce and one all-gather over the job: the end of
        the run may use the whole world. `final_loss`: the last step's train loss as recorded;
        `rounds`: the RoundClock of per-group step counts (the tokens are the rounds')."""
        snapshot = self.ledger.snapshot()
        keys = sorted(snapshot)
        totals = torch.tensor([float(snapshot[k]) for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)  # over the job: in elastic mode, this group
        # every rank's peak memory, its group and its time in votes (waiting for the other groups)
        peak = torch.tensor([float(peak_memory_bytes(self.device)), float(self.group), self.engine.vote_seconds],
                            dtype=torch.float64, device=self.device)
        peaks = [torch.zeros_like(peak) for _ in range(self.job_world_size)]
        dist.all_gather(peaks, peak)
        waits = {int(p[1]): float(p[2]) for p in reversed(peaks)}  # each group's first rank's
        layout, start_step = self.run.layout, self.start_step
        tokens = (done - start_step) * self.run.tokens_per_step if rounds is None else rounds.round.start_tokens
        summary = {
            "first_step": start_step + 1, "last_step": done, "stopped_early": stopped,
            "final_train_loss": final_loss,
            "eval_loss": final_eval["eval_loss"] if final_eval else None,
            "eval_perplexity": final_eval["eval_perplexity"] if final_eval else None,
            "evals": evals + ([final_eval] if final_eval else []),
            "tokens": tokens,
            "wall_seconds": wall,
            "tokens_per_s": tokens / max(wall, 1e-9),
            "bytes_per_rank_rank0": snapshot,
            "bytes_all_ranks": {k: int(v) for k, v in zip(keys, totals.tolist())},
            "peak_memory_bytes_per_rank": [int(p[0].item()) for p in peaks],
            "vote_wait_seconds_per_group": [waits[g] for g in sorted(waits)],
            "peak_memory_kind": peak_memory_kind(self.device),
            "last_sync_step": self.engine.last_synced_step,
            "layout": {**(record := layout_record(layout)), "replicas": record["group_size"] // record["hsdp_shard_size"],
                       "sync_interval": self.engine.config.sync_interval if self.engine.active else 0},
            **self.session.summary(),
            **({"group_steps": rounds.group_steps, "rounds": rounds.round.index} if rounds is not None else {}),
        }
        self.files.write_summary(summary)
        say(f"done: {done - start_step} steps in {format_duration(wall)}, {summary['tokens_per_s']:,.0f} tok/s, "
            f"final train loss {math.nan if final_loss is None else final_loss:.4f}"
            + (f", eval loss {summary['eval_loss']:.4f} (perplexity {summary['eval_perplexity']:.2f})"
               if final_eval else "")
            + self._wait_line(waits, wall)
            + f"\n  bytes per rank: intra-group {snapshot['intra_group_bytes'] / 2**20:,.1f} MiB, "
              f"inter-group {snapshot['inter_group_bytes'] / 2**20:,.1f} MiB; summary in {self.files.dir / 'summary.json'}"
            + self._export_hint(), self.is_writer)
        return summary

    def _wait_line(self, waits: dict, wall: float) -> str:
        """How long each group waited at the votes for the others (federated runs that synced)."""
        if not self.federated or not self.engine.active:
            return ""
        shown = ", ".join(f"group {g} {s:.1f} s ({100 * s / max(wall, 1e-9):.0f} %)" for g, s in sorted(waits.items()))
        return f"\n  time in votes, mostly waiting for the slower groups: {shown}"

    def _export_hint(self) -> str:
        """The command that turns the last checkpoint into a Hugging Face directory (with --save)."""
        save = self.run.cfg.checkpoint.save
        if not save or not self.session.exports():
            return ""
        out = str(save).rstrip("/") + "-hf"
        return (f"\n  Hugging Face export of the groups' average: python tools/convert_checkpoint_to_hf.py "
                f"--checkpoint {save} --output {out}")
