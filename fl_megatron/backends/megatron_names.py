"""Parameter names and layouts of megatron-core's GPTModel against ours, as data.

megatron-core fuses q, k and v into `linear_qkv` (grouped per key/value head: the query heads of
group g, then its key head, then its value head) and gate and up into `linear_fc1`. Every other
tensor is ours under another name. `megatron_layout(cfg)` lists, for each megatron parameter,
the row ranges of our parameters it is made of, in order; both directions follow from it, one
tensor at a time (no megatron import here).
"""

from dataclasses import dataclass
from typing import Callable

import torch

from ..config.model import ModelConfig


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of our parameter `name`, stacked into a megatron parameter."""

    name: str
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


def _qkv_pieces(cfg: ModelConfig, ours: str, kind: str) -> list[Piece]:
    """linear_qkv rows (weight or bias) for one block: per key/value group, q heads then k then v."""
    hd, per_group = cfg.head_dim, cfg.num_attention_heads // cfg.kv_heads
    pieces = []
    for g in range(cfg.kv_heads):
        q0 = g * per_group * hd
        pieces += [Piece(f"{ours}.q_proj.{kind}", q0, q0 + per_group * hd),
                   Piece(f"{ours}.k_proj.{kind}", g * hd, (g + 1) * hd),
                   Piece(f"{ours}.v_proj.{kind}", g * hd, (g + 1) * hd)]
    return pieces


def _whole(name: str, rows: int) -> list[Piece]:
    return [Piece(name, 0, rows)]


def megatron_layout(cfg: ModelConfig) -> dict[str, list[Piece]]:
    """megatron parameter name -> the pieces of ours it stacks (dim 0), for GPTModel with the
    local layer spec (separate norms; no tensor or pipeline parallelism)."""
    h, ffn, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    gpt = cfg.arch == "gpt"
    kinds = ("weight", "bias") if gpt else ("weight",)
    out = {"embedding.word_embeddings.weight": _whole("embed.weight", v)}
    if gpt:
        out["embedding.position_embeddings.weight"] = _whole("pos_embed.weight", cfg.max_position_embeddings)
    for i in range(cfg.num_layers):
        ours, theirs = f"layers.{i}", f"decoder.layers.{i}"
        for kind in kinds:
            out[f"{theirs}.input_layernorm.{kind}"] = _whole(f"{ours}.attn_norm.{kind}", h)
            out[f"{theirs}.pre_mlp_layernorm.{kind}"] = _whole(f"{ours}.mlp_norm.{kind}", h)
        for kind in kinds:
            out[f"{theirs}.self_attention.linear_qkv.{kind}"] = _qkv_pieces(cfg, f"{ours}.attn", kind)
            out[f"{theirs}.self_attention.linear_proj.{kind}"] = _whole(f"{ours}.attn.o_proj.{kind}", h)
            if gpt:
                out[f"{theirs}.mlp.linear_fc1.{kind}"] = _whole(f"{ours}.mlp.fc_in.{kind}", ffn)
                out[f"{theirs}.mlp.linear_fc2.{kind}"] = _whole(f"{ours}.mlp.fc_out.{kind}", h)
        if not gpt:
            out[f"{theirs}.mlp.linear_fc1.weight"] = [Piece(f"{ours}.mlp.gate_proj.weight", 0, ffn),
                                                      Piece(f"{ours}.mlp.up_proj.weight", 0, ffn)]
            out[f"{theirs}.mlp.linear_fc2.weight"] = _whole(f"{ours}.mlp.down_proj.weight", h)
    for kind in kinds:
        out[f"decoder.final_layernorm.{kind}"] = _whole(f"norm.{kind}", h)
    if not cfg.tie_embeddings:
        out["output_layer.weight"] = _whole("output.weight", v)
    return out


def megatron_tensor(pieces: list[Piece], ours: Callable[[str, int, int], torch.Tensor]) -> torch.Tensor:
    """A megatron parameter from rows of ours: `ours(name, start, stop)` gives those rows."""
    return torch.cat([ours(p.name, p.start, p.stop) for p in pieces], dim=0)


def our_sources(layout: dict[str, list[Piece]]) -> dict[str, list[tuple[str, int, Piece]]]:
    """Our parameter name -> (megatron name, first row there, piece) for each piece it lies in."""
    out: dict[str, list] = {}
    for theirs, pieces in layout.items():
        row = 0
        for piece in pieces:
            out.setdefault(piece.name, []).append((theirs, row, piece))
            row += piece.rows
    return out


def our_tensor(sources: list[tuple[str, int, Piece]], theirs: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """One of our parameters re-assembled from the megatron tensors it is spread over."""
    ordered = sorted(sources, key=lambda s: s[2].start)
    return torch.cat([theirs(name)[row:row + piece.rows] for name, row, piece in ordered], dim=0)
