"""--init-from-hf: a run's shards start from a Hugging Face directory, each rank reading only
the rows it holds."""

import dataclasses

import torch

from ..config.model import ModelConfig
from .hf_files import SafetensorsDir
from .hf_keys import import_rows

# Fields that shape the weights (init_std and the like only shape a random start).
_IGNORED = {"init_std"}


def check_hf_source(path: str, model: ModelConfig) -> None:
    """ValueError naming every difference between the directory's model and the run's."""
    with SafetensorsDir(path) as source:
        theirs = dataclasses.asdict(source.model_config)
    ours = dataclasses.asdict(model)
    if ours.get("num_query_groups") in (None, ours["num_attention_heads"]):
        theirs["num_query_groups"] = ours["num_query_groups"]  # both mean one kv head per head
    diffs = [f"{k} {theirs.get(k)!r} (Hugging Face) vs {v!r} (run)" for k, v in ours.items()
             if k not in _IGNORED and theirs.get(k) != v and not _unused_rope_field(k, model)]
    if diffs:
        raise ValueError(f"--init-from-hf {path} holds another model: " + "; ".join(diffs)
                         + " (give the same shape flags, or drop --model and shape flags that disagree)")


def _unused_rope_field(name: str, model: ModelConfig) -> bool:
    """RoPE fields mean nothing for GPT, and the scaling details nothing without scaling."""
    if not name.startswith("rope_"):
        return False
    details = ("rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_position")
    return model.arch == "gpt" or (model.rope_scaling_factor is None and name in details)


class HFValues:
    """`InitialValues` read from a Hugging Face directory (row slices from safetensors files)."""

    def __init__(self, path: str, model: ModelConfig) -> None:
        self.model = model
        self.source = SafetensorsDir(path)

    def rows(self, name: str, shape: tuple, start: int, stop: int) -> torch.Tensor:
        from ..models.init import canonical_name

        return import_rows(self.model, canonical_name(name), start, stop, self.source.read_slice).float()
