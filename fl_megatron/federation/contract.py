"""What the engine and the trainer need from a sharding backend."""

from pathlib import Path
from typing import Protocol

import torch
from torch import nn


class ShardOwner(Protocol):
    """A backend that trains a model sharded inside one federation group (the engine's view)."""

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


class TrainingBackend(ShardOwner, Protocol):
    """The whole contract: every backend is built as `Backend(run, groups, device, initial)`
    (a `ResolvedRun`, the rank's `ProcessGroups`, the device, and the `InitialValues` its shards
    start from) and builds its inner optimizer itself."""

    model: nn.Module

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits for token ids [b, s]."""
        ...

    def backward(self, loss: torch.Tensor, accumulation: int, last: bool) -> None:
        """Backward of one micro-batch's mean loss; gradients are reduced on the `last` one."""
        ...

    def optimizer_step(self, lr: float) -> tuple[torch.Tensor, float]:
        """Clip, step at `lr`, clear gradients. Returns (gradient norm, learning rate used)."""
        ...

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded fp32 parameters on every rank (small models and tests only)."""
        ...

    def inner_state_shards(self) -> list[torch.Tensor]:
        """This rank's inner optimizer state tensors (moments, momentum buffers; not step counts),
        in the same order and shapes on every rank of a peer group; empty before the first step."""
        ...

    def reset_optimizer_state(self) -> None:
        """Forget the inner optimizer's state (moments): a group left out of a sync as sick
        restarts from the average with fresh moments."""
        ...

    def save_state(self, directory: Path, write: bool) -> None:
        """Save this group's model and optimizer state into `directory` (collective: every rank
        of the job calls it; ranks with `write=False` take part without writing)."""
        ...

    def load_state(self, directory: Path, load_optimizer: bool) -> None:
        """Restore model (and optimizer) state saved by `save_state` (collective over the job)."""
        ...
