"""When a run stops before its last step: --exit-interval, --exit-duration-in-mins and SIGTERM
(--exit-signal-handler). Every rank must stop after the same step without a collective of its
own between syncs: --exit-interval is a step count; a signal and the time limit are each rank's
local requests, agreed where the ranks meet anyway (see docs/failures.md, "Stopping"):
- federated runs: in the vote of the next sync (the stop follows that sync, at most one sync
  interval after the signal);
- a single group: in the step's reduction of loss and gradient norm inside the group (the
  group is the job), after every step;
- independent groups (averaging disabled): they never meet, so a small all-reduce over the job
  after every step, only while a signal or a time limit is watched.
"""

import signal
import time
from typing import Optional

from ..config.checkpoint import CheckpointConfig


class SignalFlag:
    """Remembers that SIGTERM arrived (the handler only sets a flag; the loop acts on it)."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        self.received = False
        self._previous = signal.signal(signum, self._handle)
        self._signum = signum

    def _handle(self, signum, frame) -> None:
        self.received = True

    def restore(self) -> None:
        signal.signal(self._signum, self._previous)


class StopPolicy:
    """Decides after each step whether to save and exit, from requests agreed by the caller."""

    def __init__(self, options: CheckpointConfig) -> None:
        self.options = options
        self.started = time.monotonic()
        self.flag = SignalFlag() if options.exit_signal_handler else None

    @property
    def watching(self) -> bool:
        """Whether a signal or a time limit is watched (requests that need agreeing)."""
        return self.flag is not None or self.options.exit_duration_in_mins is not None

    def requests(self) -> tuple[bool, bool]:
        """This rank's own (SIGTERM received, past --exit-duration-in-mins)."""
        limit = self.options.exit_duration_in_mins
        minutes = (time.monotonic() - self.started) / 60
        return (self.flag is not None and self.flag.received, limit is not None and minutes >= limit)

    def reason(self, step: int, agreed: Optional[tuple[bool, bool]] = None,
               exit_due: Optional[bool] = None) -> Optional[str]:
        """Why to stop after optimizer step `step` (1-based), or None. `agreed`: the requests
        of every rank combined (any rank), or None where no agreement was made after this step;
        `exit_due`: whether --exit-interval falls here, where the caller decides (per-group step
        counts: at the first sync at or past each multiple)."""
        o = self.options
        if o.exit_interval and (step % o.exit_interval == 0 if exit_due is None else exit_due):
            return f"--exit-interval {o.exit_interval}"
        signalled, timed_out = agreed or (False, False)
        if signalled:
            return "SIGTERM"
        if timed_out:
            return f"--exit-duration-in-mins {o.exit_duration_in_mins:g}"
        return None

    def close(self) -> None:
        if self.flag is not None:
            self.flag.restore()
