"""Saving and resuming a whole run (collective: every rank calls the same methods in order)."""

import json
import sys
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint.api import CheckpointException

from ..config.resolved import ResolvedRun
from ..error_text import error_lines, last_line
from ..faults import fault_point
from ..file_modes import save_safetensors
from ..federation.contract import TrainingBackend
from ..federation.engine import FederationEngine
from ..federation.failed_collective import is_failed_collective
from ..federation.rounds import resume_problem
from .resume import resume_source
from .metadata import build_metadata, find_checkpoint, manifest, saved_mode, source_groups
from .paths import (METADATA, clear_staging, group_dir, iteration_dir, outer_file, prune, publish, read_tracker,
                    rng_file, staging_dir, write_text_durably)


def shard_device(backend) -> torch.device:
    """Where this rank's shards live, so the state kept beside them (outer anchors, residuals)
    loads there: "cuda" alone would mean cuda:0 on every rank of a node."""
    shards = backend.local_shards()
    return shards[0].device if shards else torch.device("cpu")


BYTE_COUNTERS = "byte_counters"  # this rank's CommLedger totals, kept beside its random states


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, read-only, no permission); the previous one
    stays the published one."""


class CheckpointReadError(ValueError):
    """A checkpoint whose files passed the checks but could not be read into the model."""


def _write_failure(err: BaseException, root: Path, iteration: int) -> CheckpointWriteError | None:
    """`err` (raised while writing, perhaps wrapped by DCP or DeepSpeed) as a CheckpointWriteError,
    or None when it is a failed collective, which stays what it is (see training.failures)."""
    if is_failed_collective(err):
        return None
    text = last_line(err)
    tracker = read_tracker(root) if root.is_dir() else None
    kept = f"the checkpoint of iteration {tracker} is untouched and stays the latest" if tracker else \
        "no earlier checkpoint exists there"
    return CheckpointWriteError(f"could not write the checkpoint of iteration {iteration} under {root} "
                                f"({text[-300:]}); {kept}")


@dataclass
class PendingSave:
    """A checkpoint staged and being written in the background, not yet published."""

    root: Path
    iteration: int
    staging: Path
    future: Optional[Future]  # this rank's background write (None: it writes no group state)
    meta: Optional[dict]      # rank 0's metadata as of the step saved (without the manifest)


class Checkpointer:
    """Writes checkpoints of one run under `--save` and restores one from `--load`."""

    def __init__(self, run: ResolvedRun, rank: int, backend: TrainingBackend, engine: FederationEngine) -> None:
        self.run, self.rank, self.backend, self.engine = run, rank, backend, engine
        self.options = run.cfg.checkpoint
        self.is_writer = dist.get_rank() == 0  # the job's first rank (in elastic mode each group is a job)
        # elastic mode: each group saves only its own state, in a directory of its own (--save DIR/group_GGGGG)
        self.own_group_only = run.cfg.federation.elastic
        self.tune_state = None  # --fl-tune: the tuner's state, saved in metadata.json beside the mode it chose
        self.rounds_state = None  # per-group step counts: where the rounds stand (RoundClock.state)
        self.resumed_rounds: Optional[dict] = None  # the rounds of the checkpoint resumed from
        self.group = engine.groups.coords[0]
        self.replica = engine.groups.coords[1]
        self._pruner: Optional[threading.Thread] = None  # rank 0 deleting old checkpoints
        self.pending: Optional[PendingSave] = None  # a checkpoint being written (--async-save)
        self._prune_error: Optional[BaseException] = None
        self.loaded = 0  # the step of the checkpoint resumed from (0: none)

    # --- saving ---------------------------------------------------------------------------
    def save(self, iteration: int) -> Path:
        """Save the state after optimizer step `iteration` and publish it, or with --async-save
        stage it and return its staging directory (`finish_pending` publishes it). Compact mode
        syncs first (unless the step just did): the groups are then identical and one copy is stored."""
        root = Path(self.options.save)
        return self._guarded(root, iteration, lambda: self._save(root, iteration))

    def finish_pending(self) -> Optional[Path]:
        """Publish the checkpoint being written in the background, once every rank has written
        its part (collective: at a sync, before the next save, at the end); None if there is none."""
        if self.pending is None:
            return None
        pending, self.pending = self.pending, None
        return self._guarded(pending.root, pending.iteration, lambda: self._publish(pending))

    @staticmethod
    def _guarded(root: Path, iteration: int, work) -> Path:
        try:
            return work()
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            failure = _write_failure(e, root, iteration)
            if failure is None:
                raise
            raise failure from e

    def _save(self, root: Path, iteration: int) -> Path:
        if self.engine.flight is not None:  # a sync in flight (--fl-overlap-steps) lands first
            self.engine.land()
        self.finish_pruning()
        self.finish_pending()
        compact = self.options.ckpt_mode == "compact"
        if compact and self.engine.active and self.engine.last_synced_step != iteration:
            self.engine.sync(iteration)
        synced_now = self.engine.active and self.engine.last_synced_step == iteration
        staging = staging_dir(root, iteration)
        if self.is_writer:
            root.mkdir(parents=True, exist_ok=True)
            clear_staging(root)
            staging.mkdir()
        dist.barrier()
        saved_groups = [0] if compact else [self.group] if self.own_group_only else \
            list(range(self.run.layout.num_groups))
        source = 0 if compact else self.group
        write = self.group in saved_groups and self._writes_group()
        future = None
        if self.options.async_save:
            future = self.backend.save_state_async(group_dir(staging, source), write=write)
        else:
            self.backend.save_state(group_dir(staging, source), write=write)
        rng = rng_file(staging, self.rank)
        rng.parent.mkdir(parents=True, exist_ok=True)
        save_safetensors({**_rng_state(), BYTE_COUNTERS: self.engine.ledger.state_tensor()}, rng)
        outer = self.engine.state_tensors()
        if outer:
            path = outer_file(staging, self.rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            save_safetensors({k: v.detach().cpu().contiguous() for k, v in outer.items()}, path)
        fault_point("checkpoint-write", iteration)
        meta = None
        if self.is_writer:  # the engine's state as of this step (it moves on while the files are written)
            meta = build_metadata(self.run, iteration, self.engine.last_synced_step, synced_now,
                                  self.options.ckpt_mode, saved_groups, self.engine.mode)
            meta["federation"]["schedule"] = self.engine.schedule.state()
            meta["federation"]["committed_syncs"] = self.engine.committed_syncs
            if self.tune_state is not None:
                meta["federation"]["tune"] = self.tune_state()
            if self.rounds_state is not None:
                meta["federation"]["rounds"] = self.rounds_state()
        pending = PendingSave(root, iteration, staging, future, meta)
        if self.options.async_save:
            self.pending = pending
            return staging
        return self._publish(pending)

    def _publish(self, pending: "PendingSave") -> Path:
        """Every rank's files are written (its own background write waited for, then a barrier):
        rank 0 adds the manifest and metadata and renames the checkpoint into place."""
        if pending.future is not None:
            pending.future.result()
        dist.barrier()
        if self.is_writer:
            pending.meta["manifest"] = manifest(pending.staging)
            write_text_durably(pending.staging / METADATA, json.dumps(pending.meta, indent=1) + "\n")
            publish(pending.root, pending.iteration)
        dist.barrier()
        if self.is_writer and self.options.keep_last:
            self._start_pruning(pending.root)
        return iteration_dir(pending.root, pending.iteration)

    def _start_pruning(self, root: Path) -> None:
        """Delete checkpoints past --keep-last in the background: the new one is published, and
        deleting a large old one (minutes on a parallel file system) must not hold up training."""
        def work() -> None:
            try:
                prune(root, self.options.keep_last)
            except OSError as e:
                self._prune_error = e

        self._pruner = threading.Thread(target=work, name="fl-megatron-prune", daemon=True)
        self._pruner.start()

    def finish_pruning(self) -> None:
        """Wait for the deletion of old checkpoints (before the next save and at the end); a
        failure to delete is reported, not fatal: the checkpoints kept are complete."""
        if self._pruner is None:
            return
        self._pruner.join()
        self._pruner = None
        if self._prune_error is not None:
            error, self._prune_error = self._prune_error, None
            print(f"fl_megatron.pretrain: warning: could not delete old checkpoints under {self.options.save}: "
                  f"{error}", file=sys.stderr, flush=True)

    def _writes_group(self) -> bool:
        """DeepSpeed and megatron: one replica per HSDP group writes (the others hold the same
        state); FSDP2's checkpointing removes the duplicates itself."""
        return self.run.cfg.parallel.backend == "fsdp2" or self.replica == 0

    # --- resuming -------------------------------------------------------------------------
    def resume(self, say) -> int:
        """Load the newest checkpoint under `--load` and return its iteration (0: none there)."""
        source = resume_source(self.options)
        if source is None:
            if self.options.load is not None:
                say(f"  no checkpoint in {self.options.load} yet: starting from step 0")
            return 0
        path, meta = find_checkpoint(*source)
        self.resumed_rounds = meta["federation"].get("rounds")
        if self.resumed_rounds is not None and not self.run.cfg.federation.per_group_steps:
            raise ValueError(f"the checkpoint {path} was trained with per-group step counts (each group at its own "
                             f"step: {self.resumed_rounds['group_steps']}); resume it with --fl-group-intervals or "
                             "--fl-balance-steps, or export it (tools/convert_checkpoint_to_hf.py)")
        if self.resumed_rounds is not None and self.rounds_state is not None:  # before any state is read
            problem = resume_problem(self.resumed_rounds, self.rounds_state()["tokens_per_step"])
            if problem:
                raise ValueError(f"{path}: {problem}")
        sources, notes = source_groups(meta, self.run)
        source = group_dir(path, sources[self.group])
        try:
            self.backend.load_state(source, self.options.load_optim)
        except (Exception, CheckpointException) as e:  # a file damaged inside (the manifest checks sizes only)
            if is_failed_collective(e):
                raise
            cause = last_line(e) if error_lines(e) else repr(e)
            raise CheckpointReadError(f"could not read the checkpoint {source}: {cause}; "
                                      "it is damaged or was written by another version") from e
        rng = rng_file(path, self.rank)
        if meta["layout"]["world_size"] == self.run.layout.world_size and rng.is_file():
            saved = load_file(str(rng))
            _set_rng_state(saved)
            if BYTE_COUNTERS in saved:
                self.engine.ledger.load_state_tensor(saved[BYTE_COUNTERS])
        else:
            notes.append("random states re-seeded and byte counters restarted (another world size)")
        self.engine.last_synced_step = meta["federation"]["last_synced_step"]
        self.engine.committed_syncs = meta["federation"].get("committed_syncs", 0)  # (older checkpoints: none)
        saved_fed, fed = meta["config"]["federation"], self.engine.config
        outer = outer_file(path, self.rank)
        same_cut = saved_mode(meta).fragments == fed.fragments
        if meta["layout"]["world_size"] == self.run.layout.world_size and same_cut and outer.is_file():
            self.engine.load_state_tensors(load_file(str(outer), device=str(shard_device(self.backend))))
        elif self.engine.outer is not None or fed.error_feedback:
            self.engine.restart_outer_state()
            notes.append("outer optimizer state and error-feedback residuals restarted from the loaded weights "
                         "(none saved for this " + ("layout)" if same_cut else "number of fragments)"))
        if "schedule" in meta["federation"] and (saved_fed.get("topology"), saved_fed.get("ada_graphs")) == (
                fed.topology, fed.ada_graphs):
            self.engine.schedule.load_state(meta["federation"]["schedule"])
        iteration = self.loaded = meta["iteration"]
        say(f"  resumed from {path} (step {iteration}"
            + ("" if self.options.load_optim else ", optimizer state not loaded") + ")"
            + "".join(f"\n  note: {n}" for n in notes))
        return iteration
