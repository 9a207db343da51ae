"""What the engine and the trainer need from a sharding backend: the whole contract.

Devices and dtypes: "the shards' device" is the rank's device (its GPU on a GPU run). Every tensor
a method returns lives there and is fp32, unless its docstring says otherwise; the engine and the
trainer never move a returned tensor to another device to use it.

Who calls together, and from where: `CALLS` below, one `CallRule` per method, whose `line()` ends
the method's docstring. Collectives stay inside the named group (the shard group is the federation
group, or with FL+HSDP the group's shard group); every rank of that group calls the method, in the
same order. The training thread calls every method, on its current CUDA stream. Only the calls
marked "any" may also run on another thread: torchft's quorum thread reads `local_shards` and
`optimizer_transfer_state` on its recovery stream while the training thread waits in the quorum
(a healing peer's source). They launch no device work (they return views, and CPU tensors for step
counts kept as Python numbers), so the caller orders its reads after the training stream's writes.
An overlapped sync's thread calls no method: it averages copies the training thread made.

Step counts: `STEP_COUNTS` says where each backend's inner optimizer keeps them. torch's Adam(W)
(every backend on CPU; FSDP2 always) keeps `state[p]["step"]`, a 0-d fp32 tensor on the CPU, per
parameter; DeepSpeed's FusedAdam (its GPU default) the same key as a Python int; Transformer
Engine's and Apex's FusedAdam (megatron-core's choice on a GPU when installed) one int per
parameter group, `param_groups[i]["step"]`; SGD none. `optimizer_transfer_state` carries all of
them, and `reset_optimizer_state` forgets all of them.

`tests/test_backend_contract.py` checks each backend against this file: signatures, `CALLS`
(collectives counted per call, the "any" calls made from a second thread) and `STEP_COUNTS`, on a
tiny model in groups of 1 and of 2 ranks.
"""

from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol

import torch
from torch import nn

NO_COLLECTIVE, SHARD_GROUP, FEDERATION_GROUP, JOB = "none", "shard group", "federation group", "job"
SCOPES = (NO_COLLECTIVE, SHARD_GROUP, FEDERATION_GROUP, JOB)  # narrowest first


@dataclass(frozen=True)
class CallRule:
    """How one contract method is called. `collective`: the widest group its collectives may span
    (`NO_COLLECTIVE`: it issues none, and one rank may call it alone). `any_thread`: it may also
    run on another thread and stream while the training thread waits."""

    collective: str
    any_thread: bool = False

    def line(self) -> str:
        """The line that ends the method's docstring."""
        thread = "any, the training thread waiting" if self.any_thread else "training"
        return f"Collective: {self.collective}. Thread: {thread}."


CALLS = {
    "local_shards": CallRule(NO_COLLECTIVE, any_thread=True),
    "named_shards": CallRule(NO_COLLECTIVE),
    "inner_state_shards": CallRule(NO_COLLECTIVE),
    "reset_optimizer_state": CallRule(NO_COLLECTIVE),
    "refresh_after_sync": CallRule(SHARD_GROUP),
    "forward": CallRule(SHARD_GROUP),
    "backward": CallRule(FEDERATION_GROUP),
    "optimizer_step": CallRule(FEDERATION_GROUP),
    "full_state_dict": CallRule(SHARD_GROUP),
    "optimizer_transfer_state": CallRule(NO_COLLECTIVE, any_thread=True),
    "load_optimizer_transfer_state": CallRule(NO_COLLECTIVE),
    "save_state": CallRule(JOB),
    "save_state_async": CallRule(JOB),
    "load_state": CallRule(JOB),
}

# backend -> (where its step counts are with torch's Adam, as on CPU; with the fused Adam a GPU
# run picks). "state tensor": state[p]["step"] a 0-d tensor; "state int": that key a Python int;
# "group int": param_groups[i]["step"] an int.
STEP_COUNTS = {
    "fsdp2": ("state tensor", "state tensor"),
    "deepspeed": ("state tensor", "state int"),
    "megatron": ("state tensor", "group int"),
}


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
        Collective: none. Thread: any, the training thread waiting.
        """
        ...

    def named_shards(self) -> list[tuple[str, torch.Tensor]]:
        """(name, flat fp32 tensor) pairs covering the same elements as `local_shards`, views of
        them (possibly empty: a rank may hold none of a tensor), in the same order on every rank of
        a peer group: per-tensor consensus metrics.
        Collective: none. Thread: training."""
        ...

    def inner_state_shards(self) -> list[torch.Tensor]:
        """This rank's inner optimizer state tensors (moments, momentum buffers; not step
        counts), fp32 on the shards' device, in the same order and shapes on every rank of a
        peer group; empty before the first step. Views: the engine may average them in place.
        Collective: none. Thread: training."""
        ...

    def reset_optimizer_state(self) -> None:
        """Forget the inner optimizer's state, moments and step counts: a group left out of a
        sync as sick restarts from the average as at the first step (`inner_state_shards` is then
        empty).
        Collective: none. Thread: training."""
        ...

    def refresh_after_sync(self) -> None:
        """Re-derive whatever is computed from the shards (low-precision copies, gathered
        persistent parameters) after the engine changed them in place: after a sync, a rolled-back
        sync and a heal.
        Collective: shard group. Thread: training."""
        ...


class TrainingBackend(ShardOwner, Protocol):
    """What the trainer uses besides: every backend is built as `Backend(run, groups, device,
    initial)` (a `ResolvedRun`, the rank's `ProcessGroups`, the device, and the `InitialValues` its
    shards start from) and builds its inner optimizer itself."""

    model: nn.Module

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [b, s, vocab] for token ids [b, s], on the shards' device (fp32, or bf16 with
        --bf16).
        Collective: shard group. Thread: training."""
        ...

    def backward(self, loss: torch.Tensor, accumulation: int, last: bool) -> None:
        """Backward of one micro-batch's mean loss; gradients are reduced on the `last` one.
        Collective: federation group. Thread: training."""
        ...

    def optimizer_step(self, lr: float) -> tuple[torch.Tensor, float]:
        """Clip, step at `lr`, clear gradients. Returns (gradient norm: a 0-d tensor on the
        shards' device, the learning rate used).
        Collective: federation group. Thread: training."""
        ...

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded fp32 parameters on every rank, on the CPU, in our naming (small models and
        tests only).
        Collective: shard group. Thread: training."""
        ...

    def optimizer_transfer_state(self) -> list[torch.Tensor]:
        """This rank's whole inner optimizer state, what a healing peer receives: per parameter
        its state tensors (keys sorted; moments on the shards' device, step counts as the
        optimizer keeps them, a Python int as a 0-d int64 CPU tensor), then the step count of
        each parameter group that keeps one (see `STEP_COUNTS`).
        Collective: none. Thread: any, the training thread waiting."""
        ...

    def load_optimizer_transfer_state(self, tensors: list[torch.Tensor]) -> None:
        """Take a peer rank's `optimizer_transfer_state` (any device), step counts included,
        making the state first if this rank has none yet.
        Collective: none. Thread: training."""
        ...

    def save_state(self, directory: Path, write: bool) -> None:
        """Save this group's model and optimizer state into `directory` (every rank of the job
        calls it; ranks with `write=False` take part without writing).
        Collective: job. Thread: training."""
        ...

    def save_state_async(self, directory: Path, write: bool) -> Optional[Future]:
        """`save_state` whose writing may go on in the background (--async-save): the state is
        copied before this returns, and the writer's own collectives use the checkpoint group
        (`ProcessGroups.checkpoint`), never the training thread's. None when nothing is left to
        wait for (a backend without a background writer has saved already).
        Collective: job. Thread: training."""
        ...

    def load_state(self, directory: Path, load_optimizer: bool) -> None:
        """Restore model (and optimizer) state saved by `save_state`.
        Collective: job. Thread: training."""
        ...
