"""A run's batches and loss, shared by the Trainer and the torchft peer (tools/peers)."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..config import ResolvedRun
from ..data import BatchSource
from ..data.sources import run_samples


def open_run_data(run: ResolvedRun, world_size: int, prepares: bool, samples=None):
    """(train BatchSource over `world_size` ranks, valid samples or None). The preparing rank builds
    data and index caches first and the others open what it built after a barrier on the default
    process group (files are written atomically, so a crash leaves no half file). `samples`: (train,
    valid) already opened by the caller."""
    cfg = run.cfg
    d, t = cfg.data, cfg.training

    def build():
        return samples or run_samples(d, t.seq_length, t.seed, cfg.model.vocab_size, bool(t.eval_iters))

    if prepares:
        train, valid = build()
        train.prepare_for(t.train_iters * run.accumulation * t.micro_batch_size * world_size)
        if valid is not None:
            valid.prepare_for(t.eval_iters * t.micro_batch_size * world_size)
    dist.barrier()
    if not prepares:
        train, valid = build()
    return BatchSource(train, None, world_size, t.micro_batch_size, run.accumulation), valid


class DataError(ValueError):
    """Training data that cannot be used, found while training (the dry run cannot read every token)."""


def next_token_loss(backend, batch: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Cross entropy of predicting each next token of one micro-batch; token ids outside the
    vocabulary are an error naming them."""
    low, high = torch.aminmax(batch)
    if int(high) >= vocab_size or int(low) < 0:
        bad = int(high) if int(high) >= vocab_size else int(low)
        raise DataError(f"the data holds token id {bad} but the model's vocab_size is {vocab_size}: the data "
                        "was tokenised with another vocabulary, or its .bin file is damaged")
    batch = batch.to(device, non_blocking=True)
    logits = backend.forward(batch[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
