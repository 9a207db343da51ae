"""Sharding backends: each wraps a model for sharded training inside its federation group.

Only modules here import framework-specific sharding code. A backend exposes the engine's
contract (`local_shards`, `refresh_after_sync`) plus what the trainer needs (`forward`,
`backward`, `optimizer_step`, `full_state_dict`). DeepSpeed is imported only when its
backend is used (it is an optional dependency).
"""

from .fsdp2 import FSDP2Backend

BACKEND_NAMES = ("fsdp2", "deepspeed")


def make_backend(cfg, groups, device):
    """The backend `cfg.parallel.backend`, with the group's optimizer, for a validated RunConfig."""
    name, t = cfg.parallel.backend, cfg.training
    if name == "fsdp2":
        backend = FSDP2Backend(cfg.model, groups, device, seed=t.seed, bf16=t.bf16,
                               recompute_activations=t.recompute_activations)
        backend.attach_optimizer(t)
        return backend
    if name == "deepspeed":
        from .deepspeed_zero3 import DeepSpeedBackend

        return DeepSpeedBackend(cfg, groups, device)
    raise ValueError(f"unknown backend {name!r}; available: {', '.join(BACKEND_NAMES)}")


__all__ = ["BACKEND_NAMES", "FSDP2Backend", "make_backend"]
