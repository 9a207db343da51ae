"""What every backend does alike: where initial values come from, and activation recomputation."""

import math
from concurrent.futures import Future
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from ..config.model import ModelConfig
from ..federation.contract import InitialValues  # noqa: F401 (the backends' constructors take one)
from ..models import initial_rows


class SavesInTheForeground:
    """`save_state_async` for a backend without a background writer: saves, then returns None."""

    def save_state_async(self, directory: Path, write: bool) -> Optional[Future]:
        self.save_state(directory, write)
        return None


class SeededValues:
    """The sharding-independent seeded initialisation of `fl_megatron.models.init`."""

    def __init__(self, model_cfg: ModelConfig, seed: int) -> None:
        self.model_cfg, self.seed = model_cfg, seed

    def rows(self, name: str, shape: tuple, start: int, stop: int) -> torch.Tensor:
        return initial_rows(self.model_cfg, name, shape, self.seed, start, stop)


def flat_elements(values: InitialValues, name: str, shape: tuple, start: int, count: int) -> torch.Tensor:
    """Elements [start, start + count) of the flattened parameter (ZeRO-3's layout): the rows
    that cover them are produced, and only those."""
    shape = tuple(shape)
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    first, last = start // row, -(-(start + count) // row)
    rows = values.rows(name, shape, first, last).reshape(-1)
    offset = start - first * row
    return rows[offset:offset + count]


def wrap_blocks_for_recompute(model: nn.Module) -> None:
    """Wrap every transformer block in an activation-checkpoint wrapper (in place). The wrapper's
    name segment is dropped by `canonical_name`, so initial values and checkpoint keys stay the same."""
    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block)


def own_singleton_group(timeout=None):
    """A process group of this rank alone (the model-parallel groups of size 1 that DeepSpeed and
    megatron-core ask for). Made with local synchronisation: only this rank takes part, so the
    start-up cost does not grow with the job (creating every rank's singleton on every rank
    meant world-size group creations per rank)."""
    import torch.distributed as dist

    return dist.new_group([dist.get_rank()], timeout=timeout, use_local_synchronization=True)

