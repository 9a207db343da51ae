"""Decoder-only models (plain nn.Modules, no sharding) and helpers to build and initialise them."""

import torch
from torch import nn

from ..config.model import ModelConfig
from .gpt import GPT
from .init import init_model_, initial_rows, initial_value, parameter_kind
from .llama import Llama
from ..config.presets import PRESETS, get_preset

_FAMILIES = {"llama": Llama, "gpt": GPT}


def build_model(cfg: ModelConfig, device="meta") -> nn.Module:
    """Validate `cfg` and build its model on `device` (on "meta" nothing is allocated)."""
    cfg.validate()
    with torch.device(device):
        return _FAMILIES[cfg.arch](cfg)


def count_parameters(cfg: ModelConfig) -> int:
    """Number of unique parameters (tied weights counted once), computed on the meta device."""
    return sum(p.numel() for p in build_model(cfg, "meta").parameters())


__all__ = ["GPT", "Llama", "PRESETS", "build_model", "count_parameters", "get_preset",
           "init_model_", "initial_rows", "initial_value", "parameter_kind"]
