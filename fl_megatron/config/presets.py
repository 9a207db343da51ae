"""Named model shapes. Lookups return fresh ModelConfig copies that callers may mutate."""

import dataclasses
from types import MappingProxyType

from .model import ModelConfig

_LLAMA31_ROPE = dict(rope_theta=500000.0, rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
                     rope_high_freq_factor=4.0, rope_original_max_position=8192,
                     max_position_embeddings=131072, norm_eps=1e-5)

_PRESETS = MappingProxyType({
    "llama-tiny": ModelConfig(
        arch="llama", num_layers=4, hidden_size=256, ffn_hidden_size=704, num_attention_heads=4,
        num_query_groups=2, vocab_size=4096, max_position_embeddings=1024, rope_theta=10000.0,
        tie_embeddings=False),
    "gpt-tiny": ModelConfig(
        arch="gpt", num_layers=4, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=4,
        vocab_size=4096, max_position_embeddings=1024, tie_embeddings=True),
    "llama3.1-8b": ModelConfig(
        arch="llama", num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
        num_query_groups=8, vocab_size=128256, tie_embeddings=False, **_LLAMA31_ROPE),
    "llama3.1-70b": ModelConfig(
        arch="llama", num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
        num_query_groups=8, vocab_size=128256, tie_embeddings=False, **_LLAMA31_ROPE),
    "llama3.2-1b": ModelConfig(
        arch="llama", num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32,
        num_query_groups=8, vocab_size=128256, tie_embeddings=True,
        **{**_LLAMA31_ROPE, "rope_scaling_factor": 32.0}),
    "gpt2-small": ModelConfig(
        arch="gpt", num_layers=12, hidden_size=768, ffn_hidden_size=3072, num_attention_heads=12,
        vocab_size=50257, max_position_embeddings=1024, norm_eps=1e-5, tie_embeddings=True),
    # GPT-3 XL and 6.7B (Brown et al. 2020, table 2.1): the GPT-2 architecture (learned positions,
    # LayerNorm, GELU, tied embeddings) with the GPT-2 BPE vocabulary and a 2048-token context.
    "gpt3-1.3b": ModelConfig(
        arch="gpt", num_layers=24, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=16,
        vocab_size=50257, max_position_embeddings=2048, norm_eps=1e-5, tie_embeddings=True),
    "gpt3-6.7b": ModelConfig(
        arch="gpt", num_layers=32, hidden_size=4096, ffn_hidden_size=16384, num_attention_heads=32,
        vocab_size=50257, max_position_embeddings=2048, norm_eps=1e-5, tie_embeddings=True),
})


class _Presets(dict):
    """Read-only name -> ModelConfig mapping whose lookups return fresh copies."""

    def __init__(self):
        super().__init__(_PRESETS)

    def __getitem__(self, name: str) -> ModelConfig:
        return dataclasses.replace(super().__getitem__(name))

    def get(self, name, default=None):
        return self[name] if name in self else default

    def values(self):
        return [self[k] for k in self]

    def items(self):
        return [(k, self[k]) for k in self]

    def _read_only(self, *args, **kwargs):
        raise TypeError("PRESETS is read-only")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _read_only


PRESETS: dict[str, ModelConfig] = _Presets()


def get_preset(name: str) -> ModelConfig:
    """Fresh copy of a named preset; ValueError lists the valid names."""
    if name not in _PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(_PRESETS)}")
    return dataclasses.replace(_PRESETS[name])
