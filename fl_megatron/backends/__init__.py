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


def backend_class(name: str) -> type:
    """The class of backend `name` (imports DeepSpeed only when it is asked for)."""
    if name == "fsdp2":
        return FSDP2Backend
    if name == "deepspeed":
        from .deepspeed_zero3 import DeepSpeedBackend

        return DeepSpeedBackend
    raise ValueError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")


def make_backend(run: ResolvedRun, groups: ProcessGroups, device: torch.device,
                 initial: InitialValues | None = None) -> TrainingBackend:
    """The backend `run.cfg.parallel.backend`, with its optimizer, its shards starting from
    `initial` (default: the seeded initialisation)."""
    if initial is None:
        initial = SeededValues(run.cfg.model, run.cfg.training.seed)
    return backend_class(run.cfg.parallel.backend)(run, groups, device, initial)


__all__ = ["BACKENDS", "FSDP2Backend", "InitialValues", "SeededValues", "backend_class", "make_backend"]
