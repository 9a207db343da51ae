#!/usr/bin/env python3
"""Benchmark the federation sync and the memory it costs, side by side in one run (CPU, gloo).

1. Sync overhead, for each backend (fsdp2, deepspeed): the time of one federation sync (FL+FSDP,
   2 groups of 2) divided by the time of a bare all-reduce of the same bytes on the same peer
   groups (target <= 1.10); and for FL+HSDP (2 groups of 2, 2 replicas x 1 shard) replica split
   against naive averaging. Then the time of one training step (FL+FSDP, 2 groups of 2) of
   deepspeed against fsdp2 for the same model and batch.
2. Memory (fsdp2): peak memory per rank of FL+FSDP (2 groups of 2, a sync every step) divided by that
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

from fl_megatron.backends import make_backend
from fl_megatron.config import FederationConfig, ModelConfig, RunConfig, resolve
from fl_megatron.costs import sync_comm, wire_bytes_per_element, wire_volume
from fl_megatron.federation import FederationEngine, build_process_groups
from fl_megatron.local_ranks import run_ranks
from fl_megatron.models import count_parameters


def model_config(args) -> ModelConfig:
    return ModelConfig(arch="llama", num_layers=args.num_layers, hidden_size=args.hidden_size,
                       ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_heads,
                       num_query_groups=args.num_heads // 2, vocab_size=args.vocab_size,
                       max_position_embeddings=args.seq_length)


def run_config(args, backend: str, group_size: int, shard_size=None, world: int = 4) -> RunConfig:
    """The benchmark's model and batch on `backend`, federated as given, a sync every step."""
    cfg = RunConfig(model=model_config(args))
    cfg.parallel.backend = backend
    cfg.deepspeed = {} if backend == "deepspeed" else None
    t = cfg.training
    t.seq_length, t.micro_batch_size, t.lr, t.train_iters, t.seed = (
        args.seq_length, args.micro_batch_size, 1e-4, 10_000, 1)
    cfg.data.tokenizer_vocab_size = args.vocab_size
    t.bf16 = args.bf16
    cfg.federation = FederationConfig(group_size=group_size, hsdp_shard_size=shard_size, sync_interval=1,
                                      bucket_mb=args.bucket_mb)
    return cfg


def _build(args, world, backend_name, group_size, shard_size=None):
    """(config, process groups, backend) on this rank."""
    run = resolve(run_config(args, backend_name, group_size, shard_size, world), world, world)
    groups = build_process_groups(run.layout, "cpu")
    return run.cfg, groups, make_backend(run, groups, torch.device("cpu"))


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return _slowest(time.perf_counter() - start)


def sync_job(rank, world, args, backend_name, group_size, shard_size):
    """Median sync time (replica split and naive) against bare all-reduces of the same bytes."""
    torch.set_num_threads(1)
    cfg, groups, backend = _build(args, world, backend_name, group_size, shard_size)
    layout = groups.layout
    engines = {split: FederationEngine(backend, groups, FederationConfig(
        group_size=group_size, hsdp_shard_size=shard_size, sync_interval=1, replica_split=split,
        bucket_mb=args.bucket_mb)) for split in ([True, False] if layout.is_hsdp else [True])}
    shard_elems = sum(s.numel() for s in backend.local_shards())
    bare = {"shard": torch.randn(shard_elems)}
    if layout.is_hsdp:
        bare["slice"] = torch.randn(shard_elems // layout.replicas)
    # the sync's scalar round, bare: the vote's inside the group (across the groups its ballot
    # rides on the data, or is summed beside it, issued together)
    scalars = torch.zeros(8, dtype=torch.float64)
    shards = backend.local_shards()
    rounds = {"bare_scalar_rounds": lambda: dist.all_reduce(scalars, op=dist.ReduceOp.MAX, group=groups.federation),
              # the vote's non-finite scan, bare: one fused norm over the shards (vote.any_nonfinite)
              "bare_scan": lambda: torch._foreach_norm(shards)}
    times = {k: [] for k in [*(f"sync_split={s}" for s in engines), *(f"bare_{k}" for k in bare), *rounds]}
    payload = {}
    for i in range(args.warmup + args.repeats):
        for split, engine in engines.items():
            holder = {}
            # a scheduled sync, as training makes it (after_step: H = 1 here)
            t = _timed(lambda holder=holder, engine=engine, i=i: holder.setdefault("r", engine.after_step(i + 1)))
            payload[f"sync_split={split}"] = holder["r"].inter_group_bytes
            if i >= args.warmup:
                times[f"sync_split={split}"].append(t)
        for name, buf in bare.items():
            t = _timed(lambda buf=buf: dist.all_reduce(buf, op=dist.ReduceOp.AVG, group=groups.peer))
            if i >= args.warmup:
                times[f"bare_{name}"].append(t)
        for name, fn in rounds.items():
            t = _timed(fn)
            if i >= args.warmup:
                times[name].append(t)
    # on the wire, measured (the ledger's payload through the ring) beside the cost model's count
    wire = {k: wire_volume("complete", layout.num_groups, b) for k, b in payload.items()}
    predicted = {f"sync_split={s}": sync_comm(layout, count_parameters(cfg.model), wire_bytes_per_element("fp32"),
                                              replica_split=s).bytes_by_scope["inter-group"] for s in engines}
    return {"median_s": {k: statistics.median(v) for k, v in times.items()}, "inter_group_bytes": payload,
            "inter_group_wire_bytes": wire, "predicted_wire_bytes": predicted,
            "shard_bytes": shard_elems * wire_bytes_per_element("fp32")}


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _train_steps(rank, args, cfg, groups, backend, steps: int, sync_interval: int) -> list:
    """Per-step seconds (slowest rank) of `steps` AdamW steps on random tokens, syncing every
    `sync_interval` steps (0: never)."""
    engine = FederationEngine(backend, groups, cfg.federation)
    gen = torch.Generator().manual_seed(rank)
    step_times = []
    for step in range(steps):
        tokens = torch.randint(0, cfg.model.vocab_size, (args.micro_batch_size, args.seq_length + 1), generator=gen)
        dist.barrier()
        start = time.perf_counter()
        logits = backend.forward(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 tokens[:, 1:].reshape(-1))
        backend.backward(loss, 1, last=True)
        backend.optimizer_step(1e-4)
        if sync_interval and (step + 1) % sync_interval == 0:
            engine.sync(step + 1)
        step_times.append(_slowest(time.perf_counter() - start))
    return step_times


def memory_job(rank, world, args, group_size):
    """Peak RSS of a few training steps (a sync after each when federated)."""
    torch.set_num_threads(1)
    baseline = _rss_now()
    cfg, groups, backend = _build(args, world, "fsdp2", group_size)
    step_times = _train_steps(rank, args, cfg, groups, backend, args.memory_steps,
                              1 if groups.layout.is_federated else 0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_rss": peak, "baseline_rss": baseline, "step_s": statistics.median(step_times[1:] or step_times)}


def step_job(rank, world, args, backend_name):
    """Median training-step time, FL+FSDP over 2 groups of 2, no syncs (the step alone)."""
    torch.set_num_threads(1)
    cfg, groups, backend = _build(args, world, backend_name, 2)
    times = _train_steps(rank, args, cfg, groups, backend, args.warmup + args.repeats, 0)
    return statistics.median(times[args.warmup:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--bf16", action="store_true", help="bf16 compute with fp32 masters (default fp32)")
    p.add_argument("--only", choices=("sync", "memory"), help="run one of the two parts")
    p.add_argument("--backends", default="fsdp2,deepspeed",
                   help="comma-separated backends for the sync part (deepspeed needs DeepSpeed installed)")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    params = count_parameters(model_config(args))
    print(f"model: llama, {args.num_layers} layers, hidden {args.hidden_size}, {params:,} parameters "
          f"({params * 4 / 2**20:.1f} MiB fp32), {'bf16' if args.bf16 else 'fp32'} compute; "
          f"4 CPU ranks on gloo, {os.cpu_count()} cores", flush=True)
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
    backends = [b for b in args.backends.split(",") if b]
    for name in backends:
        print(f"\n[1/2] {name}: sync time vs a bare all-reduce of the same bytes on the same peer groups", flush=True)
        results[name] = _sync_report(args, name)
    if len(backends) > 1:
        steps = {name: run_ranks(4, step_job, args, name, timeout=1200)[0] for name in backends}
        base = steps[backends[0]]
        print(f"\n  training step (FL+FSDP, 2 groups of 2, micro-batch {args.micro_batch_size} x seq "
              f"{args.seq_length}, median of {args.repeats}): " +
              ", ".join(f"{n} {t * 1e3:.0f} ms ({t / base:.2f}x {backends[0]})" for n, t in steps.items()), flush=True)
        results["step_seconds"] = steps


def _sync_report(args, backend_name: str) -> dict:
    results = {}
    fsdp = run_ranks(4, sync_job, args, backend_name, 2, None, timeout=1200)[0]
    ratio = fsdp["median_s"]["sync_split=True"] / fsdp["median_s"]["bare_shard"]
    m = fsdp["median_s"]
    print(f"  FL+FSDP (2 groups of 2): sync {m['sync_split=True'] * 1e3:.1f} ms, bare all-reduce "
          f"{m['bare_shard'] * 1e3:.1f} ms of {fsdp['shard_bytes'] / 2**20:.1f} MiB "
          f"-> ratio {ratio:.3f} (target <= 1.10)", flush=True)
    own = m["bare_shard"] + m["bare_scalar_rounds"] + m["bare_scan"]
    print(f"    its parts bare, one after another as a sync needs them: the non-finite scan "
          f"({m['bare_scan'] * 1e3:.1f} ms), the vote's round inside the group ({m['bare_scalar_rounds'] * 1e3:.1f} ms), "
          f"the exchange = {own * 1e3:.1f} ms, {own / m['bare_shard']:.3f} of the bare all-reduce; sync / its parts "
          f"{m['sync_split=True'] / own:.3f} (the rest is the host's work)", flush=True)
    results["fl_fsdp"] = dict(fsdp, ratio=ratio, ratio_to_own_parts=m["sync_split=True"] / own,
                              parts_over_bare=own / m["bare_shard"])
    hsdp = run_ranks(4, sync_job, args, backend_name, 2, 1, timeout=1200)[0]
    m = hsdp["median_s"]
    print(f"  FL+HSDP (2 groups of 2 = 2 replicas x 1 shard): replica split {m['sync_split=True'] * 1e3:.1f} ms "
          f"({hsdp['inter_group_bytes']['sync_split=True'] / 2**20:.1f} MiB inter-group), naive "
          f"{m['sync_split=False'] * 1e3:.1f} ms ({hsdp['inter_group_bytes']['sync_split=False'] / 2**20:.1f} MiB); "
          f"bare all-reduce of the slice {m['bare_slice'] * 1e3:.1f} ms, of the whole shard {m['bare_shard'] * 1e3:.1f} ms",
          flush=True)
    for key, label in (("sync_split=True", "replica split"), ("sync_split=False", "naive")):
        print(f"    {label}: {hsdp['inter_group_wire_bytes'][key] / 2**20:.2f} MiB per rank on the inter-group wire, "
              f"cost model {hsdp['predicted_wire_bytes'][key] / 2**20:.2f} MiB", flush=True)
    print(f"  naive / replica split time: {m['sync_split=False'] / m['sync_split=True']:.2f}x; "
          f"split sync / bare all-reduce of its inter-group bytes: {m['sync_split=True'] / m['bare_slice']:.2f}x "
          f"(it also all-gathers the slices inside the group)", flush=True)
    results["fl_hsdp"] = hsdp
    return results


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
