"""Llama 3 / 3.1 decoder: pre-norm RMSNorm, RoPE, grouped-query attention, SwiGLU."""

import torch
import torch.nn.functional as F
from torch import nn

from ..config.model import ModelConfig
from .layers import RMSNorm, RotaryEmbedding, SelfAttention, SwiGLUMLP


class LlamaBlock(nn.Module):
    """One transformer block; takes the RoPE tables computed once by the root."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = SelfAttention(cfg, bias=False)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = SwiGLUMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Root keeps embed, norm and output (tied output reuses embed.weight); blocks in `layers`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rope = RotaryEmbedding(cfg)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [b, s, vocab] for token ids [b, s]."""
        x = self.embed(input_ids)
        cos, sin = self.rope(input_ids.shape[1], x.device, x.dtype)
        for block in self.layers:
            x = block(x, cos, sin)
        x = self.norm(x)
        weight = self.embed.weight if self.output is None else self.output.weight
        return F.linear(x, weight)
