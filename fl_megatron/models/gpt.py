"""GPT-2-style decoder: learned positions, pre-LayerNorm, GELU MLP, biases everywhere."""

import torch
import torch.nn.functional as F
from torch import nn

from ..config.model import ModelConfig
from .layers import GeluMLP, SelfAttention


class GPTBlock(nn.Module):
    """One GPT-2 transformer block."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = SelfAttention(cfg, bias=True)
        self.mlp_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = GeluMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Root keeps embed, pos_embed, norm and output (tied by default); blocks in `layers`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_embed = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.layers = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.output = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [b, s, vocab] for token ids [b, s]."""
        seq_len = input_ids.shape[1]
        if seq_len > self.cfg.max_position_embeddings:
            raise ValueError(f"sequence length {seq_len} exceeds "
                             f"max_position_embeddings={self.cfg.max_position_embeddings}")
        positions = torch.arange(seq_len, device=input_ids.device)
        x = self.embed(input_ids) + self.pos_embed(positions)
        for block in self.layers:
            x = block(x)
        x = self.norm(x)
        weight = self.embed.weight if self.output is None else self.output.weight
        return F.linear(x, weight)
