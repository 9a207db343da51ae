"""Elastic mode as the training loop sees it: this job is one federation group. At start-up it
meets the live groups through torchft (healing from them when it is behind), after every sync it
records who met, and it evaluates, reports and exports on its own group only (each group's job
writes its own run directory). The one-world counterpart is training/session.py."""

from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..config import ResolvedRun
from ..federation import SyncResult
from ..federation.failed_collective import PeerLatch
from ..federation.fingerprint import group_fingerprint
from ..federation.vote import GroupFigures
from ..models import count_parameters
from ..group_layout import GroupLayout
from .group_quorum import GroupQuorum
from .groups import build_elastic_process_groups, join_tier
from .heal_across_sizes import HealAcrossSizes
from .healing import HealingState, MembershipLog, shard_digests, torchft_step
from .signature import federation_signature
from .start_wait import wait_for_every_slot
from .unequal_groups import ElasticUnequalGroups, build_elastic_unequal_groups


class ElasticSession:
    """One group's view of an elastic federation, for the training loop."""

    def __init__(self, run: ResolvedRun, env, say: Callable[[str], None]) -> None:
        """`env`: the launch's ranks (federation rank, and this job's rank and size); `say`: the console."""
        self.run, self.env, self.say = run, env, say
        self.healing = HealingState()
        self.members: Optional[MembershipLog] = None
        self.joined_sync: Optional[SyncResult] = None  # the sync this group healed at, before its first step
        self.sync_fields: dict = {}  # who met at the step's syncs, by sync step: the fields their records carry
        self.groups = self.engine = self.backend = None

    # --- set-up ---------------------------------------------------------------------------
    def process_groups(self, device_type: str, timeout: timedelta):
        """This job's own groups; torchft's tier to the other groups is joined later, in `join`,
        once the group can take part (its data, backend and checkpoint ready): a manager that
        heartbeats earlier would make the live groups' syncs wait for a group that cannot come yet."""
        cfg = self.run.cfg
        self._timeout = timeout
        if isinstance(self.run.layout, GroupLayout):  # groups of unequal size: atoms, and the leaders' quorum
            self.groups = build_elastic_unequal_groups(self.run.layout, self.env.rank, device_type, timeout,
                                                       async_checkpoint=cfg.checkpoint.async_save)
            return self.groups
        self.groups = build_elastic_process_groups(self.run.layout, self.env.rank, device_type, None, timeout,
                                                   async_checkpoint=cfg.checkpoint.async_save,
                                                   exchange=cfg.federation.overlap_steps > 0 or cfg.federation.tune)
        return self.groups

    def _join_tier(self) -> None:
        """torchft's manager for this rank (collective over the job): from here on the lighthouse
        hears this group."""
        cfg = self.run.cfg
        signature = federation_signature(self.run, count_parameters(cfg.model))
        if isinstance(self.groups, ElasticUnequalGroups):
            self._join_group_quorum(signature)
            return
        self.groups.elastic_tier = join_tier(cfg.federation, self.env.job_rank, self.env.job_world_size,
                                             self.groups.device_type, self._timeout, self.healing.source,
                                             self.healing.receive, lambda: self.healing.step, signature, self.say,
                                             cfg.training.run_dir, self._position)

    def _join_group_quorum(self, signature) -> None:
        """Groups of unequal size: one torchft manager for the group, on its first rank, and the
        quorum every rank of the group meets through it (group_quorum.py)."""
        cfg, groups = self.run.cfg, self.groups
        atoms = groups.quorum_atoms
        heal = HealAcrossSizes(self.healing, atoms.plan, groups.rank, atoms,
                               int(cfg.federation.bucket_mb * (1 << 20)), groups.replica)
        tier, watch = join_tier(cfg.federation, self.env.job_rank, self.env.job_world_size, groups.device_type,
                                self._timeout, heal.source, heal.receive, lambda: self.healing.step, signature,
                                self.say, cfg.training.run_dir, self._position, leader_only=True)
        shards = self.backend.local_shards()
        device = shards[0].device if shards else torch.device(groups.device_type)
        wait = timedelta(minutes=cfg.federation.quorum_timeout_minutes) + self._timeout
        groups.quorum = GroupQuorum(groups.federation, tier, atoms, heal, device,
                                    dist.distributed_c10d._get_default_store(), wait, watch)

    def _position(self) -> int:
        """torchft's step for this group: its training step, then the syncs it kept. With per-group
        step counts the federation step of its round (its own steps differ from the others')."""
        rounds = self.healing.rounds
        step = rounds.clock.sync_step() if rounds is not None else self.healing.step
        return torchft_step(step, self.engine.committed_syncs)

    def link_probe_scope(self) -> Optional[str]:
        """With --fl-tune, the group's own links ("group"): the groups meet only at syncs, so the
        links between them are measured there (training/tuning.py); without it no probe (None)."""
        fed = self.run.cfg.federation
        return "group" if fed.tune and fed.link_probe else None

    def join(self, backend, engine, loaded: int, start_step: int, tuner=None, rounds=None) -> int:
        """Meet the live groups; returns the step to start from. At a fresh start every group is at
        step 0 and nothing moves; a restarted or new group waits for the live groups' next sync,
        heals there from them (shards, inner optimizer state, the engine's state, the step) and
        takes part in that sync as a receiver (kept in `joined_sync`). `loaded`: the step of the
        checkpoint this group read (0: none); `tuner`: --fl-tune's, whose state a heal carries;
        `rounds`: per-group step counts (GroupRounds), which a heal carries too."""
        self.backend, self.engine = backend, engine
        self.healing.backend, self.healing.engine, self.healing.tuner = backend, engine, tuner
        self.healing.rounds = rounds
        self.healing.step = start_step
        self.healing.last_sync = rounds.federation_step if rounds is not None else start_step
        layout, group = self.run.layout, self.groups.coords[0]
        t = self.run.cfg.training
        sizes = layout.group_sizes if isinstance(layout, GroupLayout) else (layout.group_size,) * layout.num_groups
        self.members = MembershipLog(group, layout.num_groups, t.micro_batch_size * self.run.accumulation, sizes,
                                     federation_steps=rounds is not None)
        fed = self.run.cfg.federation
        self._join_tier()
        self._wait_for_every_slot(backend, group)
        self.say(f"  group {group}: meeting the live groups (lighthouse {fed.lighthouse})")
        self.healing.at_start = True
        membership = self.groups.meet()
        self.healing.at_start = False
        read = f"checkpoint of step {loaded}" if loaded else "no checkpoint"
        if not membership.healed or self.healing.source_at_start:
            # every group at the start (a fresh or resumed federation): a group behind the others
            # took their state in the quorum; nobody syncs now
            self._start_barrier(backend)
            if not self.groups.commit():
                raise RuntimeError(f"group {group}: the start-up quorum was voted down (a peer lost); restarting")
            self.members.live = membership.groups
            if membership.healed:
                start_step = self.healing.step
                self.say(f"  group {group}: behind the others' checkpoints ({read}): took their state of step "
                         f"{start_step} in {membership.seconds:.2f} s")
            self.say(f"  group {group}: joined groups {', '.join(map(str, membership.groups))} at step {start_step}")
            return start_step
        start_step = self.healing.step
        self.say(f"  group {group}: healed from the live groups at step {start_step} in "
                 f"{membership.seconds:.2f} s ({read} read)"
                 + (f"; syncing in their mode: {engine.mode.label()}" if fed.tune else ""))
        at = rounds.clock.sync_step() if rounds is not None else start_step  # the sync's federation step
        sync = engine.sync(at, GroupFigures(healing=True), full=True, membership=membership)
        if not sync.committed:
            raise RuntimeError(f"group {group}: the sync it healed at (step {at}) was voted down; restarting")
        if rounds is not None:  # the next round, planned as the live groups plan it from this vote
            rounds.advance(engine.vote.step_seconds)
        self.joined_sync = sync
        return start_step

    def _wait_for_every_slot(self, backend, group: int) -> None:
        """A fresh federation: the first rank waits (bounded) for every group slot to heartbeat
        (start_wait.py), the group's other ranks for it."""
        fed = self.run.cfg.federation
        if fed.start_wait_seconds <= 0:
            return
        if self.env.job_rank == 0:
            self.say(f"  group {group}: " + wait_for_every_slot(fed.lighthouse, fed.group_slots, group,
                                                                fed.start_wait_seconds, self.say))
        shards = backend.local_shards()
        device = shards[0].device if shards else torch.device(self.groups.device_type)
        dist.all_reduce(torch.zeros(1, device=device), group=self.groups.federation)

    def _start_barrier(self, backend) -> None:
        """One all-reduce over this rank's peers of the start-up quorum. A group behind fetches a
        source's state inside the quorum, and torchft stops serving it at the source's commit: the
        source waits here until every rank of the groups behind has it. A lost peer votes the
        quorum down."""
        shards = backend.local_shards()
        device = shards[0].device if shards else torch.device(self.groups.device_type)
        latch = PeerLatch()
        self.groups.reduce_across_groups(torch.zeros(1, device=device), call=latch)
        if latch.error is not None:
            self.groups.report_error(latch.error)

    # --- during training --------------------------------------------------------------------
    def at_step(self, done: int) -> None:
        """Optimizer step `done` finished: the position a healing group would receive (the
        records of the previous step's syncs are written by now)."""
        self.healing.step = done
        self.sync_fields = {}

    def after_sync(self, sync: SyncResult) -> None:
        """Who met at `sync` (a blocking sync, or an overlapped one at its landing): console lines and
        the fields its records carry (kept until the next step's syncs)."""
        fields, lines = self.members.after_sync(sync, self.healing)
        if self.run.cfg.federation.sync_digest:
            fields.update(self._digests())
        self.sync_fields[sync.step] = fields
        for line in lines:
            self.say(line)

    def _digests(self) -> dict:
        """--fl-sync-digest: each rank's shards, inner optimizer state (what a healing group receives)
        and sync state (outer anchors and state, residuals: what a voted-down sync restores), hashed."""
        shards, group = self.backend.local_shards(), self.groups.federation
        device = shards[0].device if shards else torch.device(self.groups.device_type)
        out = {"shard_digests": shard_digests(shards, group, device),
               "optimizer_digests": shard_digests(self.backend.optimizer_transfer_state(), group, device),
               "sync_state_digests": shard_digests(list(self.engine.state_tensors().values()), group, device)}
        if isinstance(self.groups, ElasticUnequalGroups):  # shards cut differently: compare the models instead
            plan, rank = self.groups.quorum_atoms.plan, self.groups.rank
            ranges = [plan.shard_range(rank, t) for t in range(len(plan.numels))]
            first = self.groups.coords[1] == 0  # HSDP: one replica of each shard counts
            out["model_fingerprint"] = group_fingerprint(self.backend.atom_shards(), ranges, group, first)
            moments = self.backend.atom_optimizer_state()[0]  # (a healed group's are its source's)
            out["optimizer_fingerprint"] = group_fingerprint([t for stream in moments for t in stream],
                                                             ranges * len(moments), group, first)
        return out

    def healed_step(self, sync: Optional[SyncResult]) -> Optional[int]:
        """Where to go on after a sync at which this group, behind the others since it missed a
        quorum, healed: the live groups' step (None: this group was not behind)."""
        if sync is None or sync.membership is None or not sync.membership.healed:
            return None
        self.say(f"  group {self.groups.coords[0]}: behind the live groups, healed at their step "
                 f"{self.healing.step} in {sync.membership.seconds:.2f} s")
        return self.healing.step

    def record_fields(self, sync: Optional[SyncResult]) -> dict:
        """The membership fields of a federation record (of a sync step)."""
        return self.sync_fields.get(sync.step, {}) if sync is not None else {}

    # --- what this group's job reports alone ------------------------------------------------
    def evaluation_share(self) -> tuple[int, int]:
        """(rank, ranks) the held-out set is split over: this group evaluates it whole on its own
        (groups meet only at syncs)."""
        return self.env.job_rank, self.env.job_world_size

    def reduce_evaluation(self, loss: torch.Tensor) -> None:
        dist.all_reduce(loss, group=self.groups.federation)

    def losses_cross_groups(self) -> bool:
        """Whether a final train loss is averaged over the groups: each group reports its own."""
        return False

    def summary(self) -> dict:
        return {"elastic": {"group": self.groups.coords[0], **self.members.summary(self.healing)}}

    def exports(self) -> bool:
        """Whether the summary names the Hugging Face export of --save: each group saves only its own."""
        return False
