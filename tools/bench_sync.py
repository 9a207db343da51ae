#!/usr/bin/env python3
"""Benchmark the federation sync and the memory it costs, side by side in one run (CPU, gloo).

1. Sync overhead: the time of one federation sync (FL+FSDP, 2 groups of 2) divided by the time
   of a bare all-reduce of the same bytes on the same peer groups (target <= 1.10); and for
   FL+HSDP (2 groups of 2, 2 replicas x 1 shard) replica split against naive averaging.
2. Memory: peak memory per rank of FL+FSDP (2 groups of 2, a sync every step) divided by that
   of FSDP over one group of 2 for the same model and batch (target <= 1.05): the same shard
   size per rank, so the ratio is what federation itself adds.

Timings are medians over repeats, each the slowest rank's time; ratios come from one run,
measured interleaved. Usage: python tools/bench_sync.py [--hidden-size 512 --num-layers 8 ...]
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

from fl_megatron.backends import FSDP2Backend
from fl_megatron.config import FederationConfig, ModelConfig, TrainingConfig
from fl_megatron.federation import FederationEngine, build_process_groups
from fl_megatron.local_ranks import run_ranks
from fl_megatron.models import count_parameters
from fl_megatron.topology import make_layout
from fl_megatron.backends.optimizer import build_optimizer


def model_config(args) -> ModelConfig:
    return ModelConfig(arch="llama", num_layers=args.num_layers, hidden_size=args.hidden_size,
                       ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_heads,
                       num_query_groups=args.num_heads // 2, vocab_size=args.vocab_size,
                       max_position_embeddings=args.seq_length)


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return _slowest(time.perf_counter() - start)


def sync_job(rank, world, args, group_size, shard_size):
    """Median sync time (replica split and naive) against bare all-reduces of the same bytes."""
    torch.set_num_threads(1)
    layout = make_layout(world, world, group_size=group_size, shard_size=shard_size)
    groups = build_process_groups(layout, "cpu")
    backend = FSDP2Backend(model_config(args), groups, torch.device("cpu"), seed=1)
    engines = {split: FederationEngine(backend, groups, FederationConfig(
        group_size=group_size, hsdp_shard_size=shard_size, sync_interval=1, replica_split=split,
        bucket_mb=args.bucket_mb)) for split in ([True, False] if layout.is_hsdp else [True])}
    shard_elems = sum(s.numel() for s in backend.local_shards())
    bare = {"shard": torch.randn(shard_elems)}
    if layout.is_hsdp:
        bare["slice"] = torch.randn(shard_elems // layout.replicas)
    times = {k: [] for k in [*(f"sync_split={s}" for s in engines), *(f"bare_{k}" for k in bare)]}
    payload = {}
    for i in range(args.warmup + args.repeats):
        for split, engine in engines.items():
            holder = {}
            t = _timed(lambda: holder.setdefault("r", engine.sync(i + 1)))
            payload[f"sync_split={split}"] = holder["r"].inter_group_bytes
            if i >= args.warmup:
                times[f"sync_split={split}"].append(t)
        for name, buf in bare.items():
            t = _timed(lambda: dist.all_reduce(buf, op=dist.ReduceOp.AVG, group=groups.peer))
            if i >= args.warmup:
                times[f"bare_{name}"].append(t)
    return {"median_s": {k: statistics.median(v) for k, v in times.items()},
            "inter_group_bytes": payload, "shard_bytes": shard_elems * 4}


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_job(rank, world, args, group_size):
    """Peak RSS of a few training steps (a sync after each when federated)."""
    torch.set_num_threads(1)
    baseline = _rss_now()
    layout = make_layout(world, world, group_size=group_size)
    groups = build_process_groups(layout, "cpu")
    cfg = model_config(args)
    backend = FSDP2Backend(cfg, groups, torch.device("cpu"), seed=1)
    optimizer = build_optimizer(backend.model.named_parameters(), TrainingConfig(lr=1e-4))
    engine = FederationEngine(backend, groups, FederationConfig(group_size=group_size, sync_interval=1,
                                                                bucket_mb=args.bucket_mb))
    gen = torch.Generator().manual_seed(rank)
    step_times = []
    for step in range(args.memory_steps):
        tokens = torch.randint(0, cfg.vocab_size, (args.micro_batch_size, args.seq_length + 1), generator=gen)
        start = time.perf_counter()
        logits = backend.forward(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        backend.clip_grad_norm(1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        engine.after_step(step + 1, last=step + 1 == args.memory_steps)
        step_times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_rss": peak, "baseline_rss": baseline, "step_s": statistics.median(step_times[1:] or step_times)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--ffn-hidden-size", type=int, default=1408)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=16384)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=32.0)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--memory-steps", type=int, default=4)
    p.add_argument("--only", choices=("sync", "memory"), help="run one of the two parts")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    params = count_parameters(model_config(args))
    print(f"model: llama, {args.num_layers} layers, hidden {args.hidden_size}, {params:,} parameters "
          f"({params * 4 / 2**20:.1f} MiB fp32); 4 CPU ranks on gloo, {os.cpu_count()} cores", flush=True)
    results = {"parameters": params}

    if args.only != "memory":
        sync_part(args, results)
    if args.only != "sync":
        memory_part(args, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def sync_part(args, results: dict) -> None:
    print("\n[1/2] sync time vs a bare all-reduce of the same bytes on the same peer groups", flush=True)
    fsdp = run_ranks(4, sync_job, args, 2, None, timeout=1200)[0]
    ratio = fsdp["median_s"]["sync_split=True"] / fsdp["median_s"]["bare_shard"]
    print(f"  FL+FSDP (2 groups of 2): sync {fsdp['median_s']['sync_split=True'] * 1e3:.1f} ms, bare all-reduce "
          f"{fsdp['median_s']['bare_shard'] * 1e3:.1f} ms of {fsdp['shard_bytes'] / 2**20:.1f} MiB "
          f"-> ratio {ratio:.3f} (target <= 1.10)", flush=True)
    results["fl_fsdp"] = dict(fsdp, ratio=ratio)
    hsdp = run_ranks(4, sync_job, args, 2, 1, timeout=1200)[0]
    m = hsdp["median_s"]
    print(f"  FL+HSDP (2 groups of 2 = 2 replicas x 1 shard): replica split {m['sync_split=True'] * 1e3:.1f} ms "
          f"({hsdp['inter_group_bytes']['sync_split=True'] / 2**20:.1f} MiB inter-group), naive "
          f"{m['sync_split=False'] * 1e3:.1f} ms ({hsdp['inter_group_bytes']['sync_split=False'] / 2**20:.1f} MiB); "
          f"bare all-reduce of the slice {m['bare_slice'] * 1e3:.1f} ms, of the whole shard {m['bare_shard'] * 1e3:.1f} ms",
          flush=True)
    print(f"  naive / replica split time: {m['sync_split=False'] / m['sync_split=True']:.2f}x; "
          f"split sync / bare all-reduce of its inter-group bytes: {m['sync_split=True'] / m['bare_slice']:.2f}x "
          f"(it also all-gathers the slices inside the group)", flush=True)
    results["fl_hsdp"] = hsdp


def memory_part(args, results: dict) -> None:
    print("\n[2/2] peak memory per rank, same model and micro-batch, a sync after every step", flush=True)
    fl = run_ranks(4, memory_job, args, 2, timeout=1200)
    base = run_ranks(2, memory_job, args, 2, timeout=1200)
    wide = run_ranks(4, memory_job, args, 4, timeout=1200)

    def peak(rows, key="peak_rss"):
        return max(r[key] for r in rows)

    def above(rows):
        return max(r["peak_rss"] - r["baseline_rss"] for r in rows)

    ratio_peak = peak(fl) / peak(base)
    ratio_above = above(fl) / above(base)
    for name, rows in [("FL+FSDP, 2 groups of 2", fl), ("FSDP over 2 (one group)", base), ("FSDP over 4", wide)]:
        print(f"  {name:<24} peak RSS {peak(rows) / 2**20:8.1f} MiB, above start {above(rows) / 2**20:7.1f} MiB, "
              f"step {statistics.median(r['step_s'] for r in rows):.2f} s", flush=True)
    print(f"  FL+FSDP / FSDP (same group shape): peak {ratio_peak:.3f}, above start {ratio_above:.3f} "
          f"(target <= 1.05)", flush=True)
    results["memory"] = {"fl_fsdp": fl, "fsdp_2": base, "fsdp_4": wide, "ratio_peak": ratio_peak,
                         "ratio_above_start": ratio_above}


if __name__ == "__main__":
    sys.exit(main())
