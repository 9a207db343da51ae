"""The inter-group tier of elastic mode: torchft's Manager and its reconfigurable process group
over the live federation groups, rank k of each group meeting rank k of the others."""

import time
from contextlib import nullcontext
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..federation.membership import Membership, TooFewGroups
from .lighthouse_status import missing_groups_text
from .peer_deadline import PeerDeadline, torchft_deadline
from .quorum_group import registered_quorum_group, unregister_quorum_group
from .torchft_groups import quorum_process_group, torchft_manager_class
from .waiting import WaitWatch


class ElasticPeerTier:
    """The peer group of one rank in elastic mode. `meet` forms the sync's quorum (a group that
    is behind heals there, through torchft's checkpoint transport, from `state_dict` of a live
    group into `load_state_dict`), `commit` is torchft's all-or-nothing vote after it."""

    def __init__(self, group_id: int, group_rank: int, group_size: int, lighthouse: str, store_addr: str,
                 store_port: int, min_groups: int, state_dict: Callable[[], dict],
                 load_state_dict: Callable[[dict], None], device_type: str = "cpu",
                 timeout: timedelta = timedelta(seconds=60), quorum_timeout: timedelta = timedelta(minutes=60),
                 training_step: Callable[[], int] = lambda: 0, num_groups: int = 0,
                 position: Optional[Callable[[], int]] = None,
                 watch: Optional[WaitWatch] = None, replica_id: Optional[str] = None,
                 peer_timeout: timedelta = timedelta(seconds=120)) -> None:
        if group_id < 0 or min_groups < 1:
            raise ValueError(f"group id {group_id} and minimum groups {min_groups}: need >= 0 and >= 1")
        Manager = torchft_manager_class()
        self.group_id, self.group_size = group_id, group_size
        self.lighthouse, self.min_groups, self.num_groups = lighthouse, min_groups, num_groups
        self.quorum_timeout = quorum_timeout
        self.backend = "nccl" if device_type == "cuda" else "gloo"
        # the quorum's communicator: each cross-group collective bounded by the peer timeout (gloo
        # times out by itself; on NCCL torchft's timers abort it, see peer_deadline.py)
        self.peer_timeout = peer_timeout
        self._pg = quorum_process_group(self.backend, peer_timeout)
        # use_async_quorum=False: the quorum (and any healing) completes inside `meet`, before
        # the sync's collectives; init_sync=False: every group starts from the same seeded values
        self._watch = watch
        with self._waiting(lambda: "this group's torchft manager to reach the lighthouse"):
            self.manager = Manager(pg=self._pg, load_state_dict=load_state_dict, state_dict=state_dict,
                                   min_replica_size=min_groups, use_async_quorum=False, init_sync=False,
                                   timeout=timeout, quorum_timeout=quorum_timeout, connect_timeout=timeout,
                                   rank=group_rank, world_size=group_size, store_addr=store_addr,
                                   store_port=store_port, lighthouse_addr=lighthouse,
                                   replica_id=replica_id or f"group_{group_id}")
        self._registered = None
        self._training_step = training_step
        self._position = position or training_step

    def _waiting(self, what: Callable[[], str]):
        return self._watch.waiting(what) if self._watch is not None else nullcontext()

    def _quorum_text(self, first: bool) -> str:
        if self.manager._healing:  # torchft's flag, set on its quorum thread while the state travels
            return "this group's heal from the live groups (their state on its way here)"
        need = f"at least --fl-min-groups {self.min_groups} of {self.num_groups} groups"
        if first:
            return f"the groups' first meeting ({need})"
        return f"the quorum of the sync after step {self._training_step()} ({need})"

    @property
    def has_quorum(self) -> bool:
        return self._registered is not None

    @property
    def group(self) -> dist.ProcessGroup:
        """The current quorum's process group (valid after `meet`)."""
        if self._registered is None:
            raise RuntimeError("no quorum yet: call meet() first")
        return self._registered

    def meet(self) -> Membership:
        """Form this sync's quorum with the live groups (blocking: up to the quorum timeout;
        TooFewGroups, naming the missing groups, if fewer than the minimum came)."""
        start = time.perf_counter()
        # torchft's step is the training step here, then the syncs kept (healing.torchft_step): the
        # groups furthest on are the quorum's source, any group behind them (restarted, slow, resumed
        # from an older checkpoint, or one that voted down a sync the others committed) heals
        before = self._position()
        self.manager.load_state_dict({"step": before, "batches_committed": self.manager.batches_committed()})
        first = not self.has_quorum
        if self.backend == "nccl":  # a source's shards are read on torchft's quorum thread and its own
            torch.cuda.current_stream().synchronize()  # stream: the training stream's writes finish first
        try:
            with self._waiting(lambda: self._quorum_text(first)):
                if first and self._watch is not None:  # a group that differs leaves before it meets or heals
                    self._watch.check_now()
                self.manager.start_quorum()
        except TimeoutError as e:  # the lighthouse never had --fl-min-groups groups asking
            waited = time.perf_counter() - start
            _, text = missing_groups_text(self.lighthouse, self.num_groups)
            raise TooFewGroups(f"fewer than --fl-min-groups {self.min_groups} groups met within the quorum timeout "
                               f"({waited:.0f} s, --fl-quorum-timeout-minutes {self.quorum_timeout.total_seconds() / 60:g}): "
                               f"{text}") from e
        # torchft rebuilt it (on its quorum thread) if the membership changed; from here on only
        # the thread that called meet() issues collectives on it
        raw = self._pg._pg
        if raw is None:  # aborted at the last sync, and torchft kept the quorum (same members): no communicator
            raise RuntimeError(f"elastic: the communicator of quorum {self.manager._quorum_id} was aborted after a "
                               f"peer timed out (--fl-peer-timeout-seconds) and the same groups met again; "
                               f"restarting this group, which then heals from the live ones")
        if raw is not self._registered:
            unregister_quorum_group(self._registered)
            self._registered = registered_quorum_group(raw, self.backend, self.manager._quorum_id, self._pg._rank)
        if first and self._watch is not None:  # and one that raced it into this quorum leaves now
            self._watch.check_now()
            self._watch.met()
        groups = tuple(r // self.group_size for r in self._pg._global_ranks)
        healed = self.manager.current_step() != before
        if self.manager.errored() is not None:  # the quorum's communicator or the healing failed
            raise RuntimeError(f"elastic: quorum {self.manager._quorum_id} failed on this rank: "
                               f"{self.manager.errored().original_exception}")
        return Membership(self.manager._quorum_id, groups, self._pg._rank, healed, time.perf_counter() - start)

    @property
    def quorum_store(self) -> str:
        """The current quorum's store ("host:port", valid after `meet`): where the atom
        communicators of groups of unequal size meet (group_quorum.py)."""
        return self._pg.store_address

    def deadline(self) -> Optional[PeerDeadline]:
        """The time bound of one sync's cross-group collectives (NCCL; None on gloo)."""
        return torchft_deadline(self._pg, self.peer_timeout, self.backend)

    def report_error(self, error: Exception) -> None:
        """A collective of this sync failed: the sync will not commit anywhere in this group."""
        self.manager.report_error(error)

    def commit(self) -> bool:
        """torchft's vote after a sync's collectives: True where every rank of this group
        succeeded (and enough groups took part); the sync's result may then be kept."""
        return self.manager.should_commit()

    def close(self) -> None:
        unregister_quorum_group(self._registered)
        self._registered = None
        if self._watch is not None:
            self._watch.close()
        self.manager.shutdown(wait=False)
