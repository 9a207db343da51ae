"""Sharding backends: each wraps a model for sharded training inside its federation group.

Only modules here import framework-specific sharding code. Every backend follows
`fl_megatron.federation.contract.TrainingBackend` and is built the same way:
`Backend(run, groups, device, initial)`. DeepSpeed and megatron-core are imported only when their
backend is used (they are optional dependencies).
"""

import importlib.util

import torch

from ..config.parallel import BACKENDS
from ..config.resolved import ResolvedRun
from ..federation.contract import TrainingBackend
from ..federation.groups import ProcessGroups
from .common import InitialValues, SeededValues
from .fsdp2 import FSDP2Backend


# backend -> (module it needs, pip extra that installs it)
_PACKAGES = {"deepspeed": ("deepspeed", "deepspeed"), "megatron": ("megatron.core", "megatron")}


def check_backend_package(backend: str) -> None:
    """ValueError naming the pip extra when the backend's framework is not installed, or naming
    an impostor 'apex' that megatron-core would mistake for NVIDIA Apex (cheap: no framework
    import), so the entry point can say it before any process group exists."""
    if backend not in _PACKAGES:
        return
    module, extra = _PACKAGES[backend]
    top = module.split(".")[0]
    if importlib.util.find_spec(top) is None or importlib.util.find_spec(module) is None:
        raise ValueError(f"--backend {backend} needs {module}, which is not installed: "
                         f"pip install -e \".[{extra}]\"")
    if backend == "megatron" and importlib.util.find_spec("apex") is not None \
            and importlib.util.find_spec("apex.normalization") is None:
        raise ValueError("the installed 'apex' package is not NVIDIA Apex (PyPI's 'apex' is an unrelated "
                         "project) and megatron-core would take it for NVIDIA's: pip uninstall apex. NVIDIA "
                         "Apex is optional (build it from github.com/NVIDIA/apex for fused kernels on GPUs)")


def make_backend(run: ResolvedRun, groups: ProcessGroups, device: torch.device,
                 initial: InitialValues | None = None) -> TrainingBackend:
    """The backend `run.cfg.parallel.backend`, with its optimizer, its shards starting from
    `initial` (default: the seeded initialisation)."""
    name = run.cfg.parallel.backend
    if name == "fsdp2":
        cls = FSDP2Backend
    elif name == "deepspeed":
        from .deepspeed_zero3 import DeepSpeedBackend as cls
    elif name == "megatron":
        from .megatron_core import MegatronBackend as cls
    else:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")
    if initial is None:
        initial = SeededValues(run.cfg.model, run.cfg.training.seed)
    return cls(run, groups, device, initial)


__all__ = ["BACKENDS", "FSDP2Backend", "InitialValues", "SeededValues", "check_backend_package", "make_backend"]
