"""How long a training step took, as the device ran it (--fl-tune's measured step time).

On CUDA the host clock sees only how fast the step was enqueued: a sync exchanging on a stream of
its own slows the step's kernels, not their launch. So there the step is timed by two events on
the training stream, and the end event is waited for (that stream only: an exchange running on its
own stream is not waited for). Elsewhere the host clock is the device's."""

import time
from typing import Optional

import torch


class StepClock:
    """`start()` before a step, `seconds()` after it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._began = 0.0
        self._start: Optional[torch.cuda.Event] = None

    def start(self) -> None:
        self._began = time.perf_counter()
        if self.device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record(torch.cuda.current_stream(self.device))

    def seconds(self) -> float:
        """The step's time since `start()`: on CUDA the training stream's, between its two events."""
        if self._start is None:
            return time.perf_counter() - self._began
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(self.device))
        end.synchronize()
        return self._start.elapsed_time(end) / 1e3
