"""Deterministic, sharding-independent parameter initialisation keyed by (seed, name)."""

import math
import zlib

import torch
from torch import nn

from ..config.model import ModelConfig

_OUTPUT_PROJECTIONS = ("o_proj", "out_proj", "down_proj", "fc_out")
_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def canonical_name(name: str) -> str:
    """Drop wrapper segments (FSDP1, activation checkpointing, torch.compile) from a name."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


def parameter_kind(name: str) -> str:
    """One of "bias", "norm", "output_proj", "weight" (embeddings and other linears)."""
    parts = canonical_name(name).split(".")
    if parts[-1] == "bias":
        return "bias"
    if len(parts) >= 2 and parts[-2].endswith("norm"):
        return "norm"
    if len(parts) >= 2 and parts[-2] in _OUTPUT_PROJECTIONS:
        return "output_proj"
    return "weight"


# Random values are drawn in blocks of whole rows of about this many elements, each block from
# its own generator, so any row range can be produced without drawing the rows before it.
BLOCK_ELEMENTS = 1 << 20


def _generator(seed: int, name: str, block: int) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(f"{name}#{block}".encode())) % (2 ** 63))
    return gen


def rows_per_block(shape) -> int:
    """How many dim-0 rows one random block holds (depends only on the shape)."""
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, BLOCK_ELEMENTS // max(row, 1))


def initial_rows(cfg: ModelConfig, name: str, shape, seed: int, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of parameter `name`'s initial value, as fp32 on CPU.

    The result depends only on (cfg, name, shape, seed) and the row range, never on how a
    sharding backend splits the tensor: shards materialise only their own rows.
    """
    name = canonical_name(name)
    shape = tuple(shape)
    if not 0 <= start <= stop <= (shape[0] if shape else 1):
        raise ValueError(f"rows [{start}, {stop}) are outside parameter {name} of shape {shape}")
    rows_shape = (stop - start,) + shape[1:]
    kind = parameter_kind(name)
    if kind == "bias":
        return torch.zeros(rows_shape)
    if kind == "norm":
        return torch.ones(rows_shape)
    std = cfg.init_std
    if kind == "output_proj":
        std = std / math.sqrt(2.0 * cfg.num_layers)
    per_block = rows_per_block(shape)
    out = torch.empty(rows_shape)
    for block in range(start // per_block, (stop - 1) // per_block + 1 if stop > start else 0):
        lo, hi = block * per_block, min(shape[0], (block + 1) * per_block)
        values = torch.randn((hi - lo,) + shape[1:], generator=_generator(seed, name, block))
        a, b = max(lo, start), min(hi, stop)
        out[a - start:b - start] = values[a - lo:b - lo]
    return out.mul_(std)


def initial_value(cfg: ModelConfig, name: str, shape, seed: int) -> torch.Tensor:
    """Full fp32 CPU tensor for parameter `name`; depends only on (cfg, name, shape, seed)."""
    shape = tuple(shape)
    if not shape:
        raise ValueError(f"parameter {name} is a scalar; models here have none")
    return initial_rows(cfg, name, shape, seed, 0, shape[0])


@torch.no_grad()
def init_model_(model: nn.Module, cfg: ModelConfig, seed: int) -> nn.Module:
    """Fill every parameter of a materialised, unsharded model in place; returns the model."""
    for name, param in model.named_parameters():
        if param.is_meta:
            raise ValueError(f"parameter {name} is on the meta device; materialise the model first")
        param.copy_(initial_value(cfg, name, param.shape, seed))
    return model
