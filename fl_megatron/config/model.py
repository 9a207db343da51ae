"""Model architecture settings: one dataclass shared by the Llama and GPT families."""

from dataclasses import dataclass, field, fields
from typing import Optional

ARCHITECTURES = ("llama", "gpt")

# megatron-core hard-codes these Llama 3.1 RoPE scaling details (RotaryEmbedding._apply_scaling)
MEGATRON_ROPE_SCALING = {"rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
                         "rope_original_max_position": 8192}


# Upper bounds far above any published model (Llama 3.1 405B: 126 layers, hidden 16,384, FFN
# 53,248, vocabulary 128,256), so that a typo is an error rather than hours of building modules.
SIZE_LIMITS = {"num_layers": 4096, "hidden_size": 1 << 20, "ffn_hidden_size": 1 << 22,
               "num_attention_heads": 1 << 14, "vocab_size": 1 << 24, "max_position_embeddings": 1 << 24}


@dataclass
class ModelConfig:
    """Shape of a decoder-only transformer. Every field maps to a Megatron-style flag."""

    arch: str = field(default="llama", metadata={"help": "architecture family: llama or gpt"})
    num_layers: int = field(default=4, metadata={"help": "number of transformer blocks"})
    hidden_size: int = field(default=256, metadata={"help": "model width"})
    ffn_hidden_size: int = field(default=688, metadata={"help": "MLP inner width"})
    num_attention_heads: int = field(default=4, metadata={"help": "attention heads"})
    num_query_groups: Optional[int] = field(
        default=None, metadata={"help": "key/value heads for grouped-query attention (default: one per head)"})
    vocab_size: int = field(default=4096, metadata={"help": "vocabulary size (the tokenizer's, for the demo data)"})
    max_position_embeddings: int = field(
        default=2048, metadata={"help": "longest sequence the model supports (GPT: size of the position table)"})
    norm_eps: float = field(default=1e-5, metadata={"help": "epsilon of RMSNorm / LayerNorm"})
    rope_theta: float = field(default=500000.0, metadata={"help": "RoPE base frequency (llama)"})
    rope_scaling_factor: Optional[float] = field(
        default=None, metadata={"help": "Llama 3.1 RoPE scaling factor (e.g. 8.0); unset disables scaling"})
    rope_low_freq_factor: float = field(default=1.0, metadata={"help": "Llama 3.1 RoPE low-frequency factor"})
    rope_high_freq_factor: float = field(default=4.0, metadata={"help": "Llama 3.1 RoPE high-frequency factor"})
    rope_original_max_position: int = field(
        default=8192, metadata={"help": "Llama 3.1 RoPE original context length"})
    tie_embeddings: bool = field(default=False, metadata={"help": "share input embedding and output layer weights"})
    init_std: float = field(default=0.02, metadata={"help": "standard deviation of the weight initialisation"})

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads (num_query_groups, or one per attention head)."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def differences(self, other: dict, label: str) -> list[str]:
        """Each field where the model described by `other` (a dict of these fields, from a
        checkpoint or a Hugging Face config) differs from this one: 'hidden_size 64 (LABEL) vs
        128 (run)'. Fields that do not shape the weights or the computation are skipped:
        init_std, RoPE fields of GPT, the Llama 3.1 scaling details when there is no scaling;
        num_query_groups unset equals one group per head."""
        scaling_details = ("rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_position")
        ignored = {"init_std"}
        if self.arch == "gpt":
            ignored |= {name for name in _FIELD_NAMES if name.startswith("rope_")}
        elif self.rope_scaling_factor is None:
            ignored |= set(scaling_details)
        theirs = dict(other)
        if theirs.get("num_query_groups") in (None, theirs.get("num_attention_heads")) and \
                self.num_query_groups in (None, self.num_attention_heads):
            theirs["num_query_groups"] = self.num_query_groups
        return [f"{name} {theirs.get(name)!r} ({label}) vs {getattr(self, name)!r} (run)" for name in _FIELD_NAMES
                if name not in ignored and theirs.get(name) != getattr(self, name)]

    def megatron_problems(self) -> list[str]:
        """What megatron-core's GPTModel cannot express of this model (empty: it can)."""
        problems = []
        if self.arch == "llama" and self.rope_scaling_factor is not None:
            for name, value in MEGATRON_ROPE_SCALING.items():
                if getattr(self, name) != value:
                    problems.append(f"{name}={getattr(self, name)} (megatron-core fixes it at {value})")
        return problems

    def validate(self) -> None:
        """Raise ValueError naming every inconsistent number."""
        errors = []
        if self.arch not in ARCHITECTURES:
            errors.append(f"arch={self.arch!r} is not one of {', '.join(ARCHITECTURES)}")
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                     "vocab_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                errors.append(f"{name}={getattr(self, name)} must be positive")
            elif getattr(self, name) > SIZE_LIMITS[name]:
                errors.append(f"{name}={getattr(self, name)} is above {SIZE_LIMITS[name]:,}, far past any "
                              "model this tool trains (a typo?)")
        if self.num_attention_heads > 0 and self.hidden_size % self.num_attention_heads:
            errors.append(f"hidden_size={self.hidden_size} is not divisible by "
                          f"num_attention_heads={self.num_attention_heads}")
        if self.num_query_groups is not None:
            if self.num_query_groups <= 0 or self.num_attention_heads % self.num_query_groups:
                errors.append(f"num_query_groups={self.num_query_groups} must divide "
                              f"num_attention_heads={self.num_attention_heads}")
            if self.arch == "gpt" and self.num_query_groups != self.num_attention_heads:
                errors.append("the gpt architecture has no grouped-query attention: "
                              f"num_query_groups={self.num_query_groups} must equal "
                              f"num_attention_heads={self.num_attention_heads} or be unset")
        if self.num_attention_heads > 0 and self.hidden_size % self.num_attention_heads == 0 \
                and self.arch == "llama" and self.head_dim % 2:
            errors.append(f"head_dim={self.head_dim} must be even for RoPE")
        if self.init_std <= 0:
            errors.append(f"init_std={self.init_std} must be positive")
        if errors:
            raise ValueError("invalid model: " + "; ".join(errors))


_FIELD_NAMES = tuple(f.name for f in fields(ModelConfig))
