"""Averages over all ranks of all replica groups, and the metrics.jsonl / summary.json the peer writes.

Every cross-rank value is reduced in two hops, after training (outside the timed span): a SUM
over this replica group with torch.distributed (the torchrun job's gloo group), then the torchft
Manager's allreduce across replica groups (AVG divides by the quorum's participants; the
per-step losses are summed with a count of the ranks that trained each step instead, since a
restarted group trained only the steps after its heal). With equal groups that is the mean over
all G * F ranks, which is what fl_megatron's trainer logs.
"""

import json
import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from fl_megatron.config.flags import config_to_json
from fl_megatron.training.memory import peak_memory_bytes, peak_memory_kind
from fl_megatron.training.run_files import RunFiles, atomic_write_text

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


def step_stats(peer: PeerRun, manager, log: StepLog, device: torch.device) -> list[list[float]]:
    """(loss, gradient norm) of every step 1 ... --train-iters, each the mean over the ranks that
    trained it (all of them, unless a group was lost and healed later): a SUM of the values and of
    a count in this group, then over the groups."""
    steps = peer.run.cfg.training.train_iters
    rows = torch.zeros(steps, 3, dtype=torch.float32, device=device)
    if log.losses:
        rows[log.first_step:, 0] = torch.stack(log.losses).float()
        rows[log.first_step:, 1] = torch.stack(log.norms).float()
        rows[log.first_step:, 2] = 1.0
    dist.all_reduce(rows)
    _across_groups(manager, rows, ReduceOp.SUM)
    count = rows[:, 2:].clamp(min=1.0)
    return (rows[:, :2] / count).tolist()


def step_records(peer: PeerRun, log: StepLog, stats: list[list[float]]) -> list[dict]:
    """metrics.jsonl records for the logged steps this rank trained (every --log-interval, synced
    steps, the last), with the fields of fl_megatron's records that apply; times are this rank's."""
    t, tokens_per_step = peer.run.cfg.training, peer.run.tokens_per_step
    records, interval_start, interval_steps = [], log.start, 0
    for j, end in enumerate(log.ends):
        i = log.first_step + j
        (loss, norm), done = stats[i], i + 1
        interval_steps += 1
        if not (done % t.log_interval == 0 or done == t.train_iters or log.synced[j]):
            continue
        seconds = end - interval_start
        records.append({"step": done, "tokens": done * tokens_per_step, "elapsed_s": end - log.start,
                        "loss": loss, "lr": log.lrs[j], "grad_norm": norm,
                        "tokens_per_s": interval_steps * tokens_per_step / max(seconds, 1e-9),
                        "synced": log.synced[j]})
        interval_start, interval_steps = end, 0
    return records


def group_record(peer: PeerRun, log: StepLog, restarts: int) -> dict:
    """What this replica group trained (rank 0 of each group writes it to
    groups/torchft_group_GGGGG.json): its first and last step, the step it healed at after a
    restart (None: it never restarted) and the steps whose sync committed."""
    return {"group": peer.replica_group, "first_step": log.first_step + 1,
            "last_step": log.first_step + len(log.ends), "restarts": restarts,
            "healed_at_step": log.first_step if restarts else None, "heal_s": log.heal_s,
            "synced_steps": [log.first_step + j + 1 for j, s in enumerate(log.synced) if s],
            "wall_seconds": log.wall}


def write_report(peer: PeerRun, manager, log: StepLog, eval_loss_local, device: torch.device,
                 restarts: int = 0) -> dict:
    """Reduce over all ranks (collective on every rank) and write the files on global rank 0;
    rank 0 of each replica group writes its group_record."""
    stats = step_stats(peer, manager, log, device)
    eval_loss = float(world_mean(peer, manager, eval_loss_local.reshape(1))) if eval_loss_local is not None \
        else None
    peaks = world_gather(peer, manager, float(peak_memory_bytes(device)))
    t, fed = peer.run.cfg.training, peer.run.cfg.federation
    final_eval = None if eval_loss is None else \
        {"step": t.train_iters, "elapsed_s": log.eval_elapsed, "eval_loss": eval_loss,
         "eval_perplexity": math.exp(min(eval_loss, 50.0))}
    tokens = (t.train_iters - log.first_step) * peer.run.tokens_per_step
    synced_steps = [log.first_step + i + 1 for i, s in enumerate(log.synced) if s]
    summary = {
        "system": peer.system,
        "first_step": log.first_step + 1, "last_step": t.train_iters, "stopped_early": None,
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
        "syncs_expected": -(-t.train_iters // fed.sync_interval) - log.first_step // fed.sync_interval,
        "torchft": {"algorithm": peer.algorithm, "sync_every": fed.sync_interval,
                    "outer_lr": peer.outer_lr if peer.algorithm == "diloco" else None,
                    "outer_momentum": peer.outer_momentum if peer.algorithm == "diloco" else None,
                    "min_replica_size": peer.min_replicas},
        "layout": {"world_size": peer.world_size, "ranks_per_node": peer.group_size,
                   "group_size": peer.group_size, "num_groups": peer.num_groups, "hsdp_shard_size": peer.group_size,
                   "replicas": 1, "sync_interval": fed.sync_interval},
    }
    if peer.group_rank == 0:
        atomic_write_text(Path(t.run_dir) / "groups" / f"torchft_group_{peer.replica_group:05d}.json",
                          json.dumps(group_record(peer, log, restarts), indent=1) + "\n")
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
