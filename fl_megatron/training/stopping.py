"""When a run stops before its last step: --exit-interval, --exit-duration-in-mins and SIGTERM
(--exit-signal-handler). Every rank must agree, so time and signals are combined across ranks."""

import signal
import time

import torch
import torch.distributed as dist

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
    """Decides after each step whether to save and exit, identically on every rank."""

    def __init__(self, options: CheckpointConfig, device: torch.device) -> None:
        self.options, self.device = options, device
        self.started = time.monotonic()
        self.flag = SignalFlag() if options.exit_signal_handler else None

    def reason(self, step: int) -> str | None:
        """Why to stop after optimizer step `step` (1-based), or None. Collective when a signal
        or a duration is watched (one tiny all-reduce per step)."""
        o = self.options
        if o.exit_interval and step % o.exit_interval == 0:
            return f"--exit-interval {o.exit_interval}"
        if self.flag is None and o.exit_duration_in_mins is None:
            return None
        minutes = (time.monotonic() - self.started) / 60
        local = [float(self.flag is not None and self.flag.received),
                 float(o.exit_duration_in_mins is not None and minutes >= o.exit_duration_in_mins)]
        agreed = torch.tensor(local, device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        signalled, timed_out = agreed.tolist()
        if signalled:
            return "SIGTERM"
        if timed_out:
            return f"--exit-duration-in-mins {o.exit_duration_in_mins:g}"
        return None

    def close(self) -> None:
        if self.flag is not None:
            self.flag.restore()
