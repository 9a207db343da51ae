"""Sharding backends: each wraps a model for sharded training inside its federation group.

Only modules here import framework-specific sharding code. Every backend follows
`fl_megatron.federation.contract.TrainingBackend` and is built the same way:
`Backend(run, groups, device, initial)`. DeepSpeed is imported only when its backend is used
(it is an optional dependency).
"""

import torch

from ..config.parallel import BACKENDS
from ..config.resolved import ResolvedRun
from ..federation.contract import TrainingBackend
from ..federation.groups import ProcessGroups
from .common import InitialValues, SeededValues
from .fsdp2 import FSDP2Backend


def make_backend(run: ResolvedRun, groups: ProcessGroups, device: torch.device,
                 initial: InitialValues | None = None) -> TrainingBackend:
    """The backend `run.cfg.parallel.backend`, with its optimizer, its shards starting from
    `initial` (default: the seeded initialisation)."""
    name = run.cfg.parallel.backend
    if name == "fsdp2":
        cls = FSDP2Backend
    elif name == "deepspeed":
        from .deepspeed_zero3 import DeepSpeedBackend as cls
    else:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")
    if initial is None:
        initial = SeededValues(run.cfg.model, run.cfg.training.seed)
    return cls(run, groups, device, initial)


__all__ = ["BACKENDS", "FSDP2Backend", "InitialValues", "SeededValues", "make_backend"]
