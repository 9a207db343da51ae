"""Compute time of one optimizer step from a FLOP count and an assumed utilisation."""

from ..config.model import ModelConfig


def train_flops_per_token(num_params: int, model: ModelConfig, seq_length: int,
                          recompute: bool = False) -> float:
    """Forward and backward FLOPs per token: 6 per parameter plus attention scores, 12*L*h*seq
    (the convention of the PaLM paper's MFU, appendix B); recomputation adds one more forward
    (8 per parameter, 16*L*h*seq)."""
    dense, attention = 6 * num_params, 12 * model.num_layers * model.hidden_size * seq_length
    return (dense + attention) * (4 / 3 if recompute else 1)


def compute_seconds(num_params: int, model: ModelConfig, seq_length: int, tokens_per_rank: int,
                    peak_tflops: float, mfu: float, recompute: bool = False) -> float:
    """Seconds one rank computes for `tokens_per_rank` tokens at mfu * peak_tflops."""
    flops = train_flops_per_token(num_params, model, seq_length, recompute) * tokens_per_rank
    return flops / (peak_tflops * 1e12 * mfu)
