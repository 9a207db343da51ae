"""Each backend's own on-disk format, read back one parameter at a time on the CPU without any
process group: what tools (the Hugging Face export, checkpoint inspection) need of a saved group.

`saved_group_reader(backend, directory, model_cfg, shapes)` returns `read(name) -> fp32 tensor`
(our parameter naming) for the group saved in `directory` by `backend`'s `save_state`.
"""

import contextlib
import io
import warnings
from pathlib import Path
from typing import Callable

import torch

from ..config.model import ModelConfig
from ..models.init import canonical_name
from .deepspeed_layout import CHECKPOINT_TAG
from .pickle_guard import GuardedPlanner, GuardedReader, check_deepspeed_dir

Read = Callable[[str], torch.Tensor]


def _fsdp2(directory: Path, model_cfg: ModelConfig, shapes: dict) -> Read:
    """torch.distributed.checkpoint's files (FSDP2's save_state), read in one process."""
    import torch.distributed.checkpoint as dcp

    def read(name: str) -> torch.Tensor:
        target = torch.empty(shapes[name], dtype=torch.float32)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": {name: target}}, storage_reader=GuardedReader(str(directory)),
                     planner=GuardedPlanner(), no_dist=True)
        return target
    return read


def _deepspeed(directory: Path, model_cfg: ModelConfig, shapes: dict) -> Read:
    """DeepSpeed's fp32 reconstruction of ZeRO-3 partitions (optimizer files memory-mapped)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    check_deepspeed_dir(directory / CHECKPOINT_TAG)
    quiet = io.StringIO()
    with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):  # per-file progress
        state = get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=CHECKPOINT_TAG, lazy_mode=True)
    state = {canonical_name(k): v for k, v in state.items()}
    return lambda name: state[name].contiguous().float()


def _megatron(directory: Path, model_cfg: ModelConfig, shapes: dict) -> Read:
    """Our parameters from a megatron group's shard files (fused tensors split)."""
    from .megatron_names import megatron_layout, our_sources, our_tensor
    from .megatron_state import ShardFileReader

    layout = megatron_layout(model_cfg)
    theirs = {name: (sum(p.rows for p in pieces), *shapes[pieces[0].name][1:]) for name, pieces in layout.items()}
    reader, sources = ShardFileReader(directory, theirs), our_sources(layout)

    def read(name: str) -> torch.Tensor:
        if name not in sources:
            raise ValueError(f"{name} is not a parameter of this model")
        return our_tensor(sources[name], reader)
    return read


_READERS = {"fsdp2": _fsdp2, "deepspeed": _deepspeed, "megatron": _megatron}


def saved_group_reader(backend: str, directory: Path, model_cfg: ModelConfig, shapes: dict) -> Read:
    """`read(name)` over the group `backend` saved in `directory`; `shapes`: our parameters' shapes."""
    if backend not in _READERS:
        raise ValueError(f"a checkpoint of backend {backend!r}: this version reads {', '.join(_READERS)}")
    return _READERS[backend](Path(directory), model_cfg, shapes)
