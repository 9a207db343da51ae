"""What the engine needs from a sharding backend."""

from typing import Protocol

import torch


class ShardOwner(Protocol):
    """A backend that trains a model sharded inside one federation group."""

    def local_shards(self) -> list[torch.Tensor]:
        """This rank's shards of every parameter, as the fp32 values the optimizer updates.

        The list has the same order, shapes and dtypes on every rank of a peer group (they hold
        the same shard positions). Tensors must be contiguous; the engine writes them in place.
        """
        ...

    def refresh_after_sync(self) -> None:
        """Re-derive whatever is computed from the shards (low-precision copies, gathered
        persistent parameters) after the engine changed them in place."""
        ...
