"""A rank that dies never hangs the others: they leave within the collective timeout, saying what
they were doing and, where they can tell, which rank is gone.

A collective with a dead peer fails at once when the peer's sockets close, or after
--distributed-timeout-minutes when they do not; either way torch raises a RuntimeError (a
DistBackendError for timeouts). The trainer turns it into `PeerLost` with the phase and step
it was in; pretrain prints it and exits with PEER_LOST_EXIT_CODE without touching the process
group again. Ranks on the same node are checked by process id, which names the dead one: a rank
that noticed and left first writes a note in the run directory (`peer-lost/rankN.txt`), so it is
not taken for the dead one.
"""

import os
import socket
import time
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from ..error_text import one_line
from ..faults import kill_point
from ..federation.failed_collective import is_failed_collective
from ..processes import process_alive

PEER_LOST_EXIT_CODE = 4
TOO_FEW_GROUPS_EXIT_CODE = 5  # elastic mode: fewer live groups than --fl-min-groups within the quorum timeout
NOTES_DIR = "peer-lost"  # in the run directory: one note per rank that noticed a failure and left
# a killed process closes its sockets before it turns into a zombie: how long a rank that saw the
# connection drop looks for the dead process on its node before saying it cannot tell
EXIT_GRACE_S = 2.0
PHASES = ("start-up", "forward-backward", "optimizer-step", "sync", "logging", "checkpoint-write",
          "evaluation", "summary")


def _note_says(note: Path, pid: int) -> bool:
    """Whether `note` was left by process `pid` (a note from an earlier run does not count)."""
    try:
        return note.read_text().split("\n", 1)[0] == f"pid {pid}"
    except OSError:
        return False


class PeerLost(RuntimeError):
    """A collective failed: another rank died or stopped answering."""


class PhaseTracker:
    """What this rank is doing (phase, step) and where its peers run, to explain a failure."""

    def __init__(self, rank: int, world_size: int, run_dir: Path, fault_rank: Optional[int] = None) -> None:
        """`rank` of `world_size` in this job; `fault_rank`: the rank a test's kill fault names
        (elastic mode: the federation rank; default `rank`)."""
        self.rank, self.phase, self.step = rank, "start-up", 0
        self.fault_rank = rank if fault_rank is None else fault_rank
        self.notes = Path(run_dir) / NOTES_DIR
        self.peers: list = [None] * world_size
        dist.all_gather_object(self.peers, (socket.gethostname(), os.getpid()))

    def enter(self, phase: str, step: int) -> None:
        """Now in `phase` of optimizer step `step` (1-based); a test may kill this rank here."""
        self.phase, self.step = phase, step
        kill_point(phase, step, self.fault_rank)

    def _note(self, rank: int) -> Path:
        return self.notes / f"rank{rank}.txt"

    def gone_on_this_node(self) -> list[int]:
        """Ranks on this node whose process is gone without leaving a note that they noticed a
        failure and left (as this rank does): the ranks that died."""
        host = socket.gethostname()
        gone = [r for r, (h, pid) in enumerate(self.peers) if h == host and r != self.rank and not process_alive(pid)]
        return [r for r in gone if not _note_says(self._note(r), self.peers[r][1])]

    def leave_note(self, message: str) -> None:
        """Say in the run directory that this process noticed the failure and left (with why)."""
        try:
            self.notes.mkdir(exist_ok=True)
            self._note(self.rank).write_text(f"pid {os.getpid()}\n{message}\n")
        except OSError:
            pass

    def explain(self, err: BaseException) -> Optional[PeerLost]:
        """`err` as a PeerLost naming the phase, or None when it is not a failed collective."""
        if not isinstance(err, RuntimeError) or isinstance(err, PeerLost):
            return None
        failed = is_failed_collective(err)
        gone = self.gone_on_this_node()
        deadline = time.monotonic() + EXIT_GRACE_S
        while failed and not gone and time.monotonic() < deadline:  # the dead one may still be exiting
            time.sleep(0.05)
            gone = self.gone_on_this_node()
        text = one_line(err)
        if not failed and not gone:
            return None
        if len(gone) == 1:
            who = f"rank {gone[0]} (this node) is gone"
        elif gone:
            who = f"ranks {', '.join(map(str, gone))} (this node) are gone"
        else:
            who = "the failed rank is on another node or did not exit"
        lost = PeerLost(f"rank {self.rank}: a collective failed during {self.phase} of step {self.step}: {who} "
                        f"({text[:240]}). Restart the job; with --load it resumes from the last published "
                        "checkpoint")
        self.leave_note(str(lost))
        return lost
