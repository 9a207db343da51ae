"""Learning rate per optimizer step: linear warm-up, then cosine, linear or constant decay."""

import math

from ..config.training import TrainingConfig


def learning_rate(step: int, cfg: TrainingConfig) -> float:
    """Learning rate of optimizer step `step` (0-based)."""
    if step < 0:
        raise ValueError(f"step={step} must be >= 0")
    warmup = cfg.lr_warmup_iters
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    span = cfg.decay_iters() - warmup
    progress = 1.0 if span <= 0 else min(1.0, (step - warmup) / span)
    if cfg.lr_decay_style == "linear":
        return cfg.lr - (cfg.lr - cfg.min_lr) * progress
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
