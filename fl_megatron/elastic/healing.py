"""Elastic mode: what one rank hands a healing group, what it takes when it heals, and the
record of who met at each sync (metrics.jsonl, the console, summary.json)."""

import hashlib
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from ..config.sync_mode import SyncMode
from ..federation import SyncResult


COMMITTED_SYNC_BITS = 24  # torchft's step: the training step, then the syncs kept (up to 16.7 M)


def torchft_step(step: int, committed_syncs: int) -> int:
    """The position torchft compares between groups (the highest are the quorum's sources, any
    lower one heals from them): the training step first, then the syncs this group kept. Groups
    at one step that kept different syncs (a split commit: one voted a sync down while the others
    committed it) differ in their outer state, and the one behind heals at the next meeting."""
    if not 0 <= committed_syncs < 1 << COMMITTED_SYNC_BITS:
        raise ValueError(f"{committed_syncs} committed syncs do not fit torchft's step")
    return (step << COMMITTED_SYNC_BITS) | committed_syncs


@dataclass
class HealingState:
    """The training position that travels with the shards to a healing group: the step of the
    sync the live groups are at, the samples skipped so far, the last synced step. Each group
    keeps its own copy; they agree after every committed sync."""

    step: int = 0             # the last finished optimizer step (the sync's step while meeting)
    last_sync: int = 0        # the step of the last committed sync
    skipped_samples: int = 0  # samples of absent or healing groups since the start (never trained on)
    healed_at: Optional[int] = None  # this process joined by healing at this sync step
    at_start: bool = False         # meeting the others at start-up (not at a sync)
    source_at_start: bool = False  # the state this process healed from was sent by a group at start-up
    backend: object = None
    engine: object = None
    tuner: object = None  # --fl-tune's SyncTuner, or None
    rounds: object = None  # per-group step counts: this group's GroupRounds, or None

    def position(self) -> dict:
        """Where the sender stands: what every rank of a healing group takes (`take_position`)."""
        return {"step": self.step, "last_sync": self.last_sync, "skipped_samples": self.skipped_samples,
                "at_start": self.at_start, "committed_syncs": self.engine.committed_syncs,
                "rounds": self.rounds.clock.state() if self.rounds is not None else None}

    def take_position(self, state: dict) -> None:
        """A sender's `position`. With per-group step counts the rounds travel and this group's own
        step is its share of them: at a sync, its steps up to the end of the round the sync ends
        (the next `advance` starts the next one); at start-up, up to the round's start."""
        self.engine.committed_syncs = state["committed_syncs"]
        self.step, self.last_sync = state["step"], state["last_sync"]
        if self.rounds is not None:
            if state["rounds"] is None:
                raise ValueError("the live groups plan no per-group step counts, this group does")
            self.rounds.clock.restore(state["rounds"])
            self.rounds.in_round = 0 if state["at_start"] else self.rounds.steps
            self.step = self.rounds.own_steps
        self.skipped_samples, self.healed_at = state["skipped_samples"], self.step
        self.source_at_start = state["at_start"]

    def source(self) -> dict:
        """This rank's state for rank k of a healing group. torchft calls it on its quorum thread
        while the main thread waits in the quorum: it reads tensors and issues no collective.
        Only what the healed group needs travels: at a sync it receives that sync's average as a
        full blocking sync of every fragment, which sets its shards from the anchors, so the shards
        travel only at start-up (no sync follows); error-feedback residuals never do (the healed
        group starts its own at zero)."""
        engine = {k: v for k, v in self.engine.state_tensors().items() if not is_residual(k)}
        return {**self.position(), "shards": self.backend.local_shards() if self.at_start else None,
                "optimizer": self.backend.optimizer_transfer_state(),
                "mode": self.engine.mode.fields(), "tune": self.tuner.state() if self.tuner is not None else None,
                "engine": engine}

    @torch.no_grad()
    def receive(self, state: dict) -> None:
        """Take a live rank's `source` (on the main thread, inside the quorum): shards, optimizer
        state, the sync mode the live groups are in (--fl-tune may have switched it), outer anchors
        and state, the tuner's state; error-feedback residuals start at zero."""
        if state["shards"] is not None:  # at start-up; at a sync the sync sets them
            shards = self.backend.local_shards()
            if [tuple(s.shape) for s in shards] != [tuple(s.shape) for s in state["shards"]]:
                raise ValueError("the shards received for healing do not match this rank's shard layout")
            for shard, value in zip(shards, state["shards"]):
                shard.copy_(value)
        self.backend.load_optimizer_transfer_state(state["optimizer"])
        mode = SyncMode.from_fields(state["mode"])
        if mode != self.engine.mode:  # before the engine's state, which is cut as that mode cuts it
            self.engine.switch_mode(mode)
        self.engine.load_state_tensors(state["engine"])
        if self.tuner is not None and state.get("tune") is not None:
            self.tuner.load_state(state["tune"])
        self.engine.forget_residuals()  # the sender keeps carrying its own compression error
        self.backend.refresh_after_sync()
        self.take_position(state)


def is_residual(name: str) -> bool:
    """Whether a sync-state tensor's name (SyncState.state_tensors) is an error-feedback residual."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] == "residual"


@dataclass
class MembershipLog:
    """The live groups sync by sync, as one group sees them: console lines, record fields, counts."""

    group: int
    num_groups: int
    samples_per_rank_step: int
    group_sizes: tuple  # each group's ranks
    federation_steps: bool = False  # per-group step counts: skipped samples counted in federation steps
    live: Optional[tuple] = None
    counts: dict = field(default_factory=lambda: {"left": 0, "joined": 0, "healed": 0, "failed_syncs": 0})

    def after_sync(self, sync: SyncResult, state: HealingState) -> tuple[dict, list[str]]:
        """(fields for the sync's records, console lines) of one sync; updates `state`'s counts."""
        # a group that healed at this sync is at the live groups' step; with per-group step counts
        # the groups' own steps differ, and the sync's federation step is the one they share
        m, step = sync.membership, sync.step if self.federation_steps else state.step
        if not sync.committed:
            self.counts["failed_syncs"] += 1
            return {"sync_committed": False, "groups": list(m.groups)}, [
                f"  step {step}: the sync failed (a peer lost during it) and was voted down: every group "
                "kept its shards from before it"]
        lines = []
        if self.live is not None:
            left = sorted(set(self.live) - set(m.groups))
            joined = sorted(set(m.groups) - set(self.live))
            if left:
                self.counts["left"] += len(left)
                lines.append(f"  step {step}: group(s) {', '.join(map(str, left))} left the federation "
                             f"(live: {', '.join(map(str, m.groups))})")
            if joined:
                self.counts["joined"] += len(joined)
                lines.append(f"  step {step}: group(s) {', '.join(map(str, joined))} joined the federation")
        if sync.joined:
            self.counts["healed"] += len(sync.joined)
            lines.append(f"  step {step}: group(s) {', '.join(map(str, sync.joined))} healed from the live "
                         f"group(s) {', '.join(str(g) for g in m.groups if g not in sync.joined)}"
                         + (f" in {m.seconds:.2f} s" if m.healed else ""))
        self.live = m.groups
        absent = [g for g in range(self.num_groups) if g not in m.groups or g in sync.joined]
        state.skipped_samples += (sum(self.group_sizes[g] for g in absent) * (step - state.last_sync)
                                  * self.samples_per_rank_step)
        state.last_sync = step
        record = {"groups": list(m.groups), "quorum_id": m.quorum_id, "quorum_s": round(m.seconds, 4),
                  "healed_groups": list(sync.joined), "skipped_samples": state.skipped_samples}
        if m.healed:
            record["heal_s"] = round(m.seconds, 4)
        return record, lines

    def summary(self, state: HealingState) -> dict:
        return {**self.counts, "skipped_samples": state.skipped_samples, "healed_at_step": state.healed_at,
                "final_groups": list(self.live or ())}


def shard_digests(tensors: list, group, device) -> list[str]:
    """SHA-256 of each rank's `tensors` (its shards, or its optimizer or sync state), gathered over
    its federation group (rank order) on `device`, the rank's own: after an fp32 average rank k of
    every group holds the same shard bytes (--fl-sync-digest)."""
    h = hashlib.sha256()
    for tensor in tensors:
        h.update(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    mine = torch.tensor(list(h.digest()[:8]), dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return [bytes(int(b) for b in d.tolist()).hex() for d in every]
