"""No code runs from a checkpoint: every pickle we read is unpickled with an allowlist.

A pickle can name any importable callable and call it while loading, so a crafted checkpoint
could run code under the user's account. DeepSpeed's files are torch.save zips, read here first
with torch's weights-only unpickler (plus the few DeepSpeed classes it saves), before DeepSpeed
reads them itself. DCP's `.metadata` is a plain pickle, read with a restricted Unpickler; its
non-tensor entries go through `torch.load(weights_only=True)` before DCP's own load. A file
that names anything else is refused with a ValueError naming the file and the global.
"""

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta

from ..error_text import error_lines
from .deepspeed_layout import CHECKPOINT_TAG

# Globals DCP's metadata pickle may name (torch 2.13): its dataclasses, sizes, dtypes, containers.
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint.planner")
_DCP_GLOBALS = {("torch", "Size"), ("collections", "OrderedDict"), ("builtins", "set"),
                ("builtins", "frozenset"), ("torch.serialization", "_get_layout"),
                ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}


def _deepspeed_classes() -> list:
    """The non-tensor objects DeepSpeed 0.19 saves in ZeRO-3 checkpoints (loss scalers, enums)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return [LossScaler, DynamicLossScaler, ZeroStageEnum]


def _refusal(path, err: Exception) -> ValueError:
    return ValueError(f"{path}: refusing to load it: it is a pickle that names code outside the allowlist "
                      f"of tensors and checkpoint records, which could run when unpickled ({_reason(err)}). "
                      "Only load checkpoints written by fl-megatron (or DeepSpeed/DCP) from a source you trust")


def _names_a_global(err: Exception) -> bool:
    """Whether torch's weights-only unpickler refused a global (not just a damaged stream)."""
    return "GLOBAL" in str(err)


def _reason(err: Exception) -> str:
    """The line of an unpickler's error that names the refused global (torch's message also
    suggests weights_only=False, which is exactly what must not be done with such a file)."""
    lines = error_lines(err)
    return next((line for line in lines if "GLOBAL" in line or "is not allowed" in line), lines[-1] if lines else "")


def _first_line(err: Exception) -> str:
    lines = error_lines(err)
    return lines[0][:300] if lines else type(err).__name__


def check_torch_file(path: Path, extra_classes=()) -> None:
    """Open a torch.save file with the weights-only unpickler (tensor data memory-mapped, not read)."""
    try:
        with torch.serialization.safe_globals(list(extra_classes)):
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        if _names_a_global(e):
            raise _refusal(path, e) from None
        raise ValueError(f"{path}: not a readable torch checkpoint file ({_first_line(e)})") from None
    except Exception as e:  # a damaged zip or pickle fails in many ways
        raise ValueError(f"{path}: not a readable torch checkpoint file ({type(e).__name__}: {_first_line(e)})") from None


def check_deepspeed_dir(directory: Path) -> None:
    """Every torch.save file a DeepSpeed checkpoint directory holds passes `check_torch_file`."""
    classes = _deepspeed_classes()
    for path in sorted(Path(directory).rglob("*.pt")):
        check_torch_file(path, classes)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module in _DCP_MODULES or (module, name) in _DCP_GLOBALS or (module == "torch" and
                                                                         isinstance(getattr(torch, name, None),
                                                                                    torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")


def read_dcp_metadata(path: Path):
    """DCP's `.metadata` pickle, unpickled with the allowlist above. Read from memory: a damaged
    frame length then cannot make the reader allocate what the length says."""
    data = Path(path).read_bytes()
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        if "is not allowed" in str(e):
            raise _refusal(path, e) from None
        raise ValueError(f"{path}: not a readable DCP metadata file ({e})") from None
    except Exception as e:  # a damaged pickle fails in many ways (EOF, overflow, memory, lookups)
        raise ValueError(f"{path}: not a readable DCP metadata file ({type(e).__name__}: {e})") from None


class GuardedReader(FileSystemReader):
    """FileSystemReader whose metadata is read by `read_metadata` above."""

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        metadata = read_dcp_metadata(Path(self._get_metadata_path(rank)))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class GuardedPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that opens non-tensor entries with the weights-only unpickler first."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            if _names_a_global(e):
                raise _refusal(f"checkpoint entry {read_item.dest_index.fqn}", e) from None
            raise
        value.seek(0)
        super().load_bytes(read_item, value)


def check_group_pickles(backend: str, directory: Path) -> None:
    """The pickles of one saved group's directory, opened as the backend's load will open them
    (megatron shard files are safetensors: nothing to check)."""
    if backend == "deepspeed":
        check_deepspeed_dir(Path(directory) / CHECKPOINT_TAG)
    elif backend == "fsdp2":
        read_dcp_metadata(Path(directory) / ".metadata")
