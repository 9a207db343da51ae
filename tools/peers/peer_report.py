"""Averages over all ranks of all replica groups, and the metrics.jsonl / summary.json the peer writes.

Every cross-rank value is reduced in two hops, after training (outside the timed span): a SUM
over this replica group with torch.distributed (the torchrun job's gloo group), then the torchft
Manager's allreduce across replica groups (AVG divides by the quorum's participants). With equal
groups that is the mean over all G * F ranks, which is what fl_megatron's trainer logs.
"""

import math

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from fl_megatron.config.flags import config_to_json
from fl_megatron.training.memory import peak_memory_bytes, peak_memory_kind
from fl_megatron.training.run_files import RunFiles

from peer_config import PeerRun
from peer_loop import StepLog

LOSS_SCOPE = "mean over all ranks of all replica groups"


def _across_groups(manager, tensor: torch.Tensor, op) -> torch.Tensor:
    """The Manager's allreduce, in place; raises if torchft reports an error (it would otherwise
    leave the tensor unreduced and carry on)."""
    work = manager.allreduce(tensor, reduce_op=op)
    work.wait()
    error = manager.errored()
    if error is not None:
        raise RuntimeError(f"torchft allreduce across replica groups failed: {error}")
    return tensor


def world_mean(peer: PeerRun, manager, tensor: torch.Tensor) -> torch.Tensor:
    """Mean of `tensor` over every rank of every replica group."""
    out = tensor.detach().clone()
    dist.all_reduce(out)
    out /= peer.group_size
    return _across_groups(manager, out, ReduceOp.AVG)


def world_gather(peer: PeerRun, manager, value: float) -> list[float]:
    """One float64 value per global rank, in global-rank order (exact for integers below 2**53)."""
    slots = torch.zeros(peer.world_size, dtype=torch.float64)
    slots[peer.global_rank] = value
    dist.all_reduce(slots)
    return _across_groups(manager, slots, ReduceOp.SUM).tolist()


def step_records(peer: PeerRun, log: StepLog, stats: list[list[float]]) -> list[dict]:
    """metrics.jsonl records for the logged steps (every --log-interval, synced steps, the last),
    with the fields of fl_megatron's records that apply; times are this rank's."""
    t, tokens_per_step = peer.run.cfg.training, peer.run.tokens_per_step
    records, interval_start, interval_steps = [], log.start, 0
    for i, (loss, norm) in enumerate(stats):
        done, interval_steps = i + 1, interval_steps + 1
        if not (done % t.log_interval == 0 or done == t.train_iters or log.synced[i]):
            continue
        seconds = log.ends[i] - interval_start
        records.append({"step": done, "tokens": done * tokens_per_step, "elapsed_s": log.ends[i] - log.start,
                        "loss": loss, "lr": log.lrs[i], "grad_norm": norm,
                        "tokens_per_s": interval_steps * tokens_per_step / max(seconds, 1e-9),
                        "synced": log.synced[i]})
        interval_start, interval_steps = log.ends[i], 0
    return records


def write_report(peer: PeerRun, manager, log: StepLog, eval_loss_local, device: torch.device) -> dict:
    """Reduce over all ranks (collective on every rank) and write the files on global rank 0."""
    per_step = torch.stack([torch.stack(log.losses).float(), torch.stack(log.norms).float()], dim=1)
    stats = world_mean(peer, manager, per_step).tolist()
    eval_loss = float(world_mean(peer, manager, eval_loss_local.reshape(1))) if eval_loss_local is not None \
        else None
    peaks = world_gather(peer, manager, float(peak_memory_bytes(device)))
    t, fed = peer.run.cfg.training, peer.run.cfg.federation
    final_eval = None if eval_loss is None else \
        {"step": t.train_iters, "elapsed_s": log.eval_elapsed, "eval_loss": eval_loss,
         "eval_perplexity": math.exp(min(eval_loss, 50.0))}
    tokens = t.train_iters * peer.run.tokens_per_step
    synced_steps = [i + 1 for i, s in enumerate(log.synced) if s]
    summary = {
        "system": peer.system,
        "first_step": 1, "last_step": t.train_iters, "stopped_early": None,
        "final_train_loss": stats[-1][0],
        "loss_scope": LOSS_SCOPE,
        "eval_loss": eval_loss,
        "eval_perplexity": final_eval["eval_perplexity"] if final_eval else None,
        "evals": [final_eval] if final_eval else [],
        "tokens": tokens,
        "wall_seconds": log.wall,
        "tokens_per_s": tokens / max(log.wall, 1e-9),
        "peak_memory_bytes_per_rank": [int(p) for p in peaks],
        "peak_memory_kind": peak_memory_kind(device),
        "last_sync_step": synced_steps[-1] if synced_steps else 0,
        "syncs_committed": len(synced_steps),
        "syncs_expected": -(-t.train_iters // fed.sync_interval),
        "torchft": {"algorithm": peer.algorithm, "sync_every": fed.sync_interval,
                    "outer_lr": peer.outer_lr if peer.algorithm == "diloco" else None,
                    "outer_momentum": peer.outer_momentum if peer.algorithm == "diloco" else None,
                    "min_replica_size": peer.num_groups},
        "layout": {"world_size": peer.world_size, "ranks_per_node": peer.group_size,
                   "group_size": peer.group_size, "num_groups": peer.num_groups, "hsdp_shard_size": peer.group_size,
                   "replicas": 1, "sync_interval": fed.sync_interval},
    }
    files = RunFiles(t.run_dir, peer.global_rank == 0)
    files.write_config(config_to_json(peer.run.cfg))
    files.open_metrics()
    for record in step_records(peer, log, stats):
        files.log(record)
    if final_eval:
        files.log(final_eval)
    files.write_summary(summary)
    files.close()
    return summary
