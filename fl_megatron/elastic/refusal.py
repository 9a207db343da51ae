"""How a group leaves a federation it does not match: within seconds, every rank with exit code 2,
one line naming what differs, and no retry by a launcher that restarts it.

The group's first rank finds the mismatch (while every rank may be blocked inside torchft, waiting
for a quorum or for the manager's address); it publishes the line in the job's own store, where
the other ranks' watch threads find it, and leaves once they have seen it. A marker in the
group's run directory tells a restarted attempt of the same job (torchrun --max-restarts) that a
restart cannot help; a fresh launch removes it.
"""

import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional

REFUSED_EXIT_CODE = 2
MARKER_NAME = "federation_refused.txt"
LINGER_S = 2.0  # the first rank stays (heartbeating) this long after a refusal
_KEY, _SEEN, _EXIT_AT = "line", "seen", "exit_at"


def restart_refusal(run_dir: str, environ=os.environ) -> Optional[str]:
    """At start-up: the line a previous attempt of this job left when it was refused, where this
    is a restarted attempt (TORCHELASTIC_RESTART_COUNT > 0); a fresh launch removes the marker."""
    marker = Path(run_dir) / MARKER_NAME
    if environ.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0"):
        marker.unlink(missing_ok=True)
        return None
    return marker.read_text().strip() if marker.is_file() else None


class Refusal:
    """The job's side of a refusal, on one rank. `store_addr`/`store_port`: the job's TCPStore
    (MASTER_ADDR/MASTER_PORT). Used from the watch thread only: a store client of its own."""

    def __init__(self, store_addr: str, store_port: int, job_rank: int, job_size: int, run_dir: Optional[str],
                 attempt: str = "0") -> None:
        import torch.distributed as dist

        store = dist.TCPStore(store_addr, store_port, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=30))
        self._store = dist.PrefixStore(f"fl_megatron/refusal/{attempt}", store)
        self.job_rank, self.job_size, self.run_dir = job_rank, job_size, run_dir
        self._leaving = threading.Lock()

    def published(self) -> Optional[str]:
        """The line the group's first rank published, if it did."""
        if not self._store.check([_KEY]):
            return None
        return self._store.get(_KEY).decode()

    def leave(self, line: str) -> None:
        """Rank 0: say `line`, mark the run directory, tell the other ranks, and once they have
        seen it (a few seconds at most) agree on a moment to exit. Every rank then exits at that
        moment, so that the launcher, which stops a job's other workers as soon as one has
        exited, sees exit code 2 from each. A second caller (the watch thread and the main
        thread both found it) waits for the first's exit."""
        if not self._leaving.acquire(blocking=False):
            while True:
                time.sleep(60)
        if self.job_rank == 0:
            print(f"fl_megatron.pretrain: error: {line}", file=sys.stderr, flush=True)
            if self.run_dir is not None:
                Path(self.run_dir).mkdir(parents=True, exist_ok=True)
                (Path(self.run_dir) / MARKER_NAME).write_text(line + "\n")
            self._store.set(_KEY, line)
            # meanwhile the manager goes on heartbeating: the other groups see these settings and refuse in turn
            linger_until, deadline = time.monotonic() + LINGER_S, time.monotonic() + 5.0
            while time.monotonic() < linger_until or (
                    self._store.add(_SEEN, 0) < self.job_size - 1 and time.monotonic() < deadline):
                time.sleep(0.05)
            exit_at = time.time() + 0.5
            self._store.set(_EXIT_AT, repr(exit_at))
        else:
            self._store.add(_SEEN, 1)
            exit_at = self._agreed_exit()
        sys.stdout.flush()
        sys.stderr.flush()
        time.sleep(max(0.0, exit_at - time.time()))
        os._exit(REFUSED_EXIT_CODE)  # the main thread may be blocked inside torchft: leave from here

    def _agreed_exit(self) -> float:
        """The moment rank 0 chose (now, if it does not say within 10 s)."""
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            if self._store.check([_EXIT_AT]):
                return float(self._store.get(_EXIT_AT).decode())
            time.sleep(0.05)
        return time.time()
