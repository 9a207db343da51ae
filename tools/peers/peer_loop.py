"""The peer's data, loss and training loop: the batches, loss, schedule and timed span of
fl_megatron's Trainer, with torchft's hooks on the optimizer doing the syncs."""

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from fl_megatron.data import BatchSource, eval_batches
from fl_megatron.faults import kill_point
from fl_megatron.training.run_data import next_token_loss, open_run_data
from fl_megatron.training.lr_schedule import learning_rate

from peer_config import PeerRun


def load_data(peer: PeerRun):
    """(train BatchSource over the whole federated world, valid samples or None), as the Trainer opens
    them: rank 0 of each replica group prepares the caches, its group then opens them."""
    return open_run_data(peer.run, peer.world_size, peer.group_rank == 0)


@dataclass
class StepLog:
    """Per-step values of this rank (losses and norms stay tensors: no host sync in the loop), for
    the steps first_step + 1 ... --train-iters (first_step > 0: a restarted group that healed
    at that step)."""

    first_step: int = 0
    start: float = 0.0
    wall: float = 0.0
    losses: list = field(default_factory=list)
    norms: list = field(default_factory=list)
    lrs: list = field(default_factory=list)
    synced: list = field(default_factory=list)
    ends: list = field(default_factory=list)   # perf_counter after each step (and its sync)
    eval_elapsed: float = 0.0                  # seconds from `start` to the end of the final evaluation
    heal_s: Optional[float] = None             # a restarted group: seconds it waited and healed


def train_steps(peer: PeerRun, backend, source: BatchSource, manager, final_sync: Callable[[], None],
                device: torch.device, first_step: int = 0) -> StepLog:
    """Optimizer steps first_step + 1 ... --train-iters; the algorithm syncs inside
    optimizer.step() every H steps.

    fl_megatron also averages after the last step when --train-iters is not a multiple of H;
    `final_sync` does that sync here. The timed span is Trainer.train's: from before the first
    step to after the last step, its sync included. A step synced when the Manager committed
    (its step count grew). FL_MEGATRON_FAULT=kill:forward-backward:STEP:RANK SIGKILLs global
    rank RANK before the forward of step STEP (fl_megatron.faults, as in fl_megatron.pretrain)."""
    t = peer.run.cfg.training
    accum, vocab, H = peer.run.accumulation, peer.run.cfg.model.vocab_size, peer.run.cfg.federation.sync_interval
    log = StepLog(first_step=first_step)
    log.start = time.perf_counter()
    for step in range(first_step, t.train_iters):
        kill_point("forward-backward", step + 1, peer.global_rank)
        total = torch.zeros((), device=device)
        for micro in range(accum):
            loss = next_token_loss(backend, source.micro_batch(peer.global_rank, step, micro), vocab, device)
            backend.backward(loss, accum, last=micro == accum - 1)
            total += loss.detach()
        committed = manager.current_step()
        norm, lr = backend.optimizer_step(learning_rate(step, t))
        done = step + 1
        if done == t.train_iters and done % H:
            final_sync()
        log.losses.append(total / accum)
        log.norms.append(norm.detach().float().reshape(()))
        log.lrs.append(lr)
        log.synced.append(manager.current_step() > committed)
        log.ends.append(time.perf_counter())
    log.wall = time.perf_counter() - log.start
    return log


@torch.no_grad()
def local_eval_loss(peer: PeerRun, backend, valid, device: torch.device) -> torch.Tensor:
    """Mean loss of this rank's held-out batches: the ones Trainer.evaluate gives the same global rank."""
    t = peer.run.cfg.training
    batches = eval_batches(valid, peer.global_rank, peer.world_size, t.micro_batch_size, t.eval_iters)
    return torch.stack([next_token_loss(backend, b, peer.run.cfg.model.vocab_size, device) for b in batches]).mean()
