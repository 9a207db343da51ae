"""Hugging Face checkpoint directories: lazy safetensors reads and a streaming, sharded writer."""

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..config.model import ModelConfig
from ..file_modes import save_safetensors
from .hf_config import model_config_from_hf
from .hf_keys import hf_tensor_specs

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Pickled weights run code when loaded; we never read them (see _pickled_only).
PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth")
# Some checkpoints (the original gpt2 one) store the base model's keys without this prefix.
_BASE_PREFIXES = ("transformer.", "model.")


def _read_json(path: Path, what: str) -> Any:
    if not path.is_file():
        raise ValueError(f"{what} {path} does not exist")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path} is not valid JSON: {e}") from None


class SafetensorsDir:
    """An HF model directory opened lazily: config.json, then tensors as they are asked for.

    Shapes are checked against the config on every read. Use as a context manager, or close().
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise ValueError(f"Hugging Face model directory {self.path} does not exist")
        self.config: dict[str, Any] = _read_json(self.path / "config.json", "config file")
        self.model_config: ModelConfig = model_config_from_hf(self.config)
        self.expected_shapes = dict(hf_tensor_specs(self.model_config))
        self._files = self._weight_map()
        self._handles: dict[str, Any] = {}

    def _weight_map(self) -> dict[str, str]:
        if (self.path / INDEX_FILE).exists():
            index = _read_json(self.path / INDEX_FILE, "index file")
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict):
                raise ValueError(f"index file {self.path / INDEX_FILE} has no 'weight_map' object")
            for file in sorted(set(weight_map.values())):
                if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
                    raise ValueError(f"index file {self.path / INDEX_FILE} names shard {file!r}: shards must be "
                                     "plain file names inside the directory")
                if not (self.path / file).is_file():
                    raise ValueError(f"shard {file} named in {self.path / INDEX_FILE} does not exist")
            return dict(weight_map)
        if (self.path / SINGLE_FILE).is_file():
            with safe_open(self.path / SINGLE_FILE, framework="pt") as f:
                return {name: SINGLE_FILE for name in f.keys()}
        raise ValueError(self._pickled_only() or f"{self.path} has neither {SINGLE_FILE} nor {INDEX_FILE}")

    def _pickled_only(self) -> str:
        """The refusal for a directory that only has pickled weights ('' if it has none)."""
        pickled = [name for name in PICKLED_WEIGHTS if (self.path / name).exists()]
        if not pickled:
            return ""
        return (f"{self.path} holds only pickled PyTorch weights ({', '.join(pickled)}), which can run arbitrary "
                f"code when loaded; fl-megatron reads safetensors only. Convert them where you trust the file, "
                f"e.g. `AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)` "
                f"with transformers, which writes {SINGLE_FILE}")

    @property
    def names(self) -> list[str]:
        """Tensor names stored in the directory."""
        return list(self._files)

    def _stored_name(self, name: str) -> str:
        if name in self._files:
            return name
        for prefix in _BASE_PREFIXES:
            if name.startswith(prefix) and name[len(prefix):] in self._files:
                return name[len(prefix):]
        raise ValueError(f"tensor {name!r} is missing from {self.path}")

    def _slice(self, name: str):
        stored = self._stored_name(name)
        file = self._files[stored]
        if file not in self._handles:
            self._handles[file] = safe_open(self.path / file, framework="pt")
        view = self._handles[file].get_slice(stored)
        found, expected = tuple(view.get_shape()), self.expected_shapes.get(name)
        if expected is not None and found != expected:
            raise ValueError(f"tensor {name!r} in {self.path / file} has shape {found}, "
                             f"expected {expected} from config.json")
        return view, found

    def shape(self, name: str) -> tuple[int, ...]:
        """Stored shape of tensor `name` (checked against the config)."""
        return self._slice(name)[1]

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor `name`."""
        return self._slice(name)[0][:]

    def read_slice(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of tensor `name` along `dim` (0 or 1); only they are read."""
        view, shape = self._slice(name)
        if dim not in (0, 1) or dim >= len(shape):
            raise ValueError(f"cannot slice tensor {name!r} of shape {shape} along dim {dim}")
        if not 0 <= start <= stop <= shape[dim]:
            raise ValueError(f"range [{start}, {stop}) is outside dim {dim} of tensor {name!r} "
                             f"of shape {shape}")
        return view[start:stop] if dim == 0 else view[:, start:stop]

    def check(self) -> None:
        """Raise ValueError unless every tensor the config needs is present with its shape."""
        for name in self.expected_shapes:
            self.shape(name)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "SafetensorsDir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _shard_name(k: int, n: int) -> str:
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def write_hf_dir(out_dir: str | os.PathLike, config: dict[str, Any],
                 generation_config: dict[str, Any] | None,
                 tensors: Iterable[tuple[str, torch.Tensor]],
                 max_shard_bytes: int = 5 * 1024 ** 3,
                 extra_files: dict[str, bytes] | None = None) -> dict[str, str]:
    """Write an HF model directory from streamed (name, tensor) pairs; return the weight map.

    A shard is flushed before the tensor that would take it past `max_shard_bytes`, so at most
    one shard's tensors are held at a time. One shard is written as model.safetensors, more as
    model-0000k-of-0000n.safetensors plus model.safetensors.index.json. Everything goes to a
    temporary sibling directory renamed to `out_dir` at the end; on failure nothing is left.
    """
    out = Path(out_dir)
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be positive")
    if out.exists() and not out.is_dir():
        raise ValueError(f"output directory {out} exists and is not a directory")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"output directory {out} exists and is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        shards: list[list[str]] = []
        total = _write_shards(tmp, tensors, max_shard_bytes, shards)
        n = len(shards)
        weight_map = {}
        for k, names in enumerate(shards, 1):
            file = SINGLE_FILE if n == 1 else _shard_name(k, n)
            os.replace(tmp / f"shard-{k}.partial", tmp / file)
            weight_map.update((name, file) for name in names)
        if n > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if generation_config is not None:
            (tmp / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
        for name, data in (extra_files or {}).items():  # the tokenizer's files
            (tmp / name).write_bytes(data)
        if out.exists() and any(out.iterdir()):
            raise ValueError(f"output directory {out} was filled while writing")
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return weight_map


def _write_shards(tmp: Path, tensors: Iterable[tuple[str, torch.Tensor]], max_shard_bytes: int,
                  shards: list[list[str]]) -> int:
    """Write shard-k.partial files into `tmp`, appending each shard's names; return total bytes."""
    seen: set[str] = set()
    buffer: dict[str, torch.Tensor] = {}
    buffered = total = 0

    def flush() -> None:
        nonlocal buffer, buffered
        shards.append(list(buffer))
        save_safetensors(buffer, tmp / f"shard-{len(shards)}.partial", metadata={"format": "pt"})
        buffer, buffered = {}, 0

    for name, tensor in tensors:
        if name in seen:
            raise ValueError(f"tensor {name!r} is given twice")
        seen.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if buffer and buffered + nbytes > max_shard_bytes:
            flush()
        buffer[name] = tensor.detach().to("cpu").contiguous()
        buffered += nbytes
        total += nbytes
    if not buffer:
        raise ValueError("no tensors to write")
    flush()
    return total
