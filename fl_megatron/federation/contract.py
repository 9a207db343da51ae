"""What the engine and the trainer need from a sharding backend: the whole contract.

Devices and dtypes: "the shards' device" is the rank's device (its GPU on a GPU run). Every tensor
a method returns lives there and is fp32, unless its docstring says otherwise; the engine and the
trainer never move a returned tensor to another device to use it. `tests/test_backend_contract.py`
checks each backend against this file: signatures, and behaviour on a tiny model.
"""

from concurrent.futures import Future
from pathlib import Path
from typing import Optional, Protocol

import torch
from torch import nn


class InitialValues(Protocol):
    """The value a parameter starts from, row range by row range (fp32 on CPU)."""

    def rows(self, name: str, shape: tuple, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of dim 0 of parameter `name` (our naming) of full shape `shape`."""
        ...


class ShardOwner(Protocol):
    """What the federation engine uses: a model's fp32 shards, trained in one federation group.
    Served by every backend, and by the Megatron-LM integration (`MegatronMainShards`)."""

    def local_shards(self) -> list[torch.Tensor]:
        """This rank's shards of every parameter, as the fp32 values the optimizer updates, on
        the shards' device.

        The list has the same order, shapes and dtypes on every rank of a peer group (they hold
        the same shard positions). Tensors must be contiguous; the engine writes them in place.
        """
        ...

    def named_shards(self) -> list[tuple[str, torch.Tensor]]:
        """(name, flat fp32 tensor) pairs covering the same elements as `local_shards`, views of
        them (possibly empty: a rank may hold none of a tensor), in the same order on every rank of
        a peer group: per-tensor consensus metrics."""
        ...

    def inner_state_shards(self) -> list[torch.Tensor]:
        """This rank's inner optimizer state tensors (moments, momentum buffers; not step
        counts), fp32 on the shards' device, in the same order and shapes on every rank of a
        peer group; empty before the first step. Views: the engine may average them in place."""
        ...

    def reset_optimizer_state(self) -> None:
        """Forget the inner optimizer's state (moments): a group left out of a sync as sick
        restarts from the average with fresh moments (`inner_state_shards` is then empty)."""
        ...

    def refresh_after_sync(self) -> None:
        """Re-derive whatever is computed from the shards (low-precision copies, gathered
        persistent parameters) after the engine changed them in place."""
        ...


class TrainingBackend(ShardOwner, Protocol):
    """What the trainer uses besides: every backend is built as `Backend(run, groups, device,
    initial)` (a `ResolvedRun`, the rank's `ProcessGroups`, the device, and the `InitialValues` its
    shards start from) and builds its inner optimizer itself."""

    model: nn.Module

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [b, s, vocab] for token ids [b, s], on the shards' device (fp32, or bf16 with
        --bf16)."""
        ...

    def backward(self, loss: torch.Tensor, accumulation: int, last: bool) -> None:
        """Backward of one micro-batch's mean loss; gradients are reduced on the `last` one."""
        ...

    def optimizer_step(self, lr: float) -> tuple[torch.Tensor, float]:
        """Clip, step at `lr`, clear gradients. Returns (gradient norm: a 0-d tensor on the
        shards' device, the learning rate used)."""
        ...

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded fp32 parameters on every rank, on the CPU, in our naming (small models and
        tests only)."""
        ...

    def optimizer_transfer_state(self) -> list[torch.Tensor]:
        """This rank's whole inner optimizer state, step counts included (on the shards'
        device; step counts keep the optimizer's dtype): what a healing peer receives."""
        ...

    def load_optimizer_transfer_state(self, tensors: list[torch.Tensor]) -> None:
        """Take a peer rank's `optimizer_transfer_state` (any device), making the state first if
        this rank has none yet."""
        ...

    def save_state(self, directory: Path, write: bool) -> None:
        """Save this group's model and optimizer state into `directory` (collective: every rank
        of the job calls it; ranks with `write=False` take part without writing)."""
        ...

    def save_state_async(self, directory: Path, write: bool) -> Optional[Future]:
        """`save_state` whose writing may go on in the background (--async-save): the state is
        copied before this returns. None when nothing is left to wait for (a backend without a
        background writer has saved already)."""
        ...

    def load_state(self, directory: Path, load_optimizer: bool) -> None:
        """Restore model (and optimizer) state saved by `save_state` (collective over the job)."""
        ...
