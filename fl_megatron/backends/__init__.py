"""Sharding backends: each wraps a model for sharded training inside its federation group.

Only modules here import framework-specific sharding code. A backend exposes the engine's
contract (`local_shards`, `refresh_after_sync`) plus what the trainer needs.
"""

from .fsdp2 import FSDP2Backend

BACKEND_CLASSES = {"fsdp2": FSDP2Backend}


def make_backend(name: str, *args, **kwargs):
    """Build the backend called `name` (see BACKEND_CLASSES)."""
    if name not in BACKEND_CLASSES:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(BACKEND_CLASSES)}")
    return BACKEND_CLASSES[name](*args, **kwargs)


__all__ = ["BACKEND_CLASSES", "FSDP2Backend", "make_backend"]
