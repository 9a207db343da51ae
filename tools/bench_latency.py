#!/usr/bin/env python3
"""A sync's time against the one-way delay between sites: ours beside torchft LocalSGD, 4 groups
of 1 rank (CPU, gloo), the same tensors (a small Llama's parameters, fp32).

This kernel has no sch_netem, so the delay is injected at each collective across the groups: the
caller sleeps, before issuing it, for the delay times the one-way hops its algorithm has in
sequence (latency.py: a ring all-reduce over F groups 2(F - 1), an all-gather, reduce-scatter or
all-to-all F - 1, a broadcast F - 1, a send or receive 1) and torchft's quorum sleeps for one
round trip to the lighthouse (2). Collectives issued back to back pay their delays one after the
other, as they run on one gloo thread or one NCCL stream. Bandwidth is the loopback's: the rows
differ in latency only.

Rows:
- ours: a scheduled sync (the data in buckets of --bucket-mb, the vote riding in the first
  one, carrying the previous sync's metrics);
- ours_metrics_round: the same sync agreeing its metrics at once (as before the vote carried
  them);
- torchft LocalSGD: `LocalSGD.sync()` (its quorum, one all-reduce per parameter, its commit).

  python tools/bench_latency.py --delays-ms 0 5 20 --repeats 5 --out runs/bench-latency
"""

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tools"), str(REPO)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from cluster_bench.latency import InjectedLatency, delayed_calls  # noqa: E402
from fl_megatron.config import FederationConfig, ModelConfig  # noqa: E402
from fl_megatron.federation import FederationEngine, build_process_groups  # noqa: E402
from fl_megatron.launching.lighthouse import lighthouse_command, start_lighthouse  # noqa: E402
from fl_megatron.launching.ports import free_port  # noqa: E402
from fl_megatron.local_ranks import run_ranks  # noqa: E402
from fl_megatron.models import build_model  # noqa: E402
from fl_megatron.topology import make_layout  # noqa: E402

ROWS = ("ours", "ours_metrics_round", "torchft_localsgd")


class Shards:
    """The engine's view of a group of one rank holding the whole model: its parameters as shards."""

    def __init__(self, tensors: list) -> None:
        self.tensors = tensors

    def local_shards(self) -> list:
        return self.tensors

    def named_shards(self) -> list:
        return [(f"p{i}", t.view(-1)) for i, t in enumerate(self.tensors)]

    def refresh_after_sync(self) -> None:
        """Nothing derives from the shards here."""


def model_tensors(args, rank: int) -> list[torch.Tensor]:
    """A small Llama's parameter shapes, filled differently on every rank."""
    cfg = ModelConfig(arch="llama", num_layers=args.num_layers, hidden_size=args.hidden_size,
                      ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=8, num_query_groups=4,
                      vocab_size=args.vocab_size, max_position_embeddings=128)
    gen = torch.Generator().manual_seed(rank)
    return [torch.randn(p.shape, generator=gen) for p in build_model(cfg).parameters()]


def _timed(fn, repeats: int, group, injected: Optional[InjectedLatency] = None) -> list[float]:
    """Each repeat's time on the slowest rank (a barrier first, outside the timing; neither is
    delayed)."""
    times = []
    pause = injected.paused if injected is not None else contextlib.nullcontext
    for _ in range(repeats):
        with pause():
            dist.barrier(group=group)
        start = time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - start])
        with pause():
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        times.append(float(t))
    return times


def ours_job(rank: int, world: int, args) -> dict:
    torch.set_num_threads(1)
    layout = make_layout(world, ranks_per_node=1, group_size=1)
    groups = build_process_groups(layout, "cpu", timedelta(minutes=5))
    shards = Shards(model_tensors(args, rank))
    config = FederationConfig(group_size=1, sync_interval=1, bucket_mb=args.bucket_mb)
    engine = FederationEngine(shards, groups, config)
    step = iter(range(1, 1 << 20))
    syncs = {"ours": lambda: engine.after_step(next(step)),
             "ours_metrics_round": lambda: engine.sync(next(step), full=False, metrics_now=True)}
    out = {}
    for delay in args.delays_ms:
        for row, sync in syncs.items():
            sync()  # warm-up, and the first sync's metrics to carry
            with InjectedLatency(delay / 1e3, world) as injected:
                out[f"{row}@{delay}"] = _timed(sync, args.repeats, dist.group.WORLD, injected)
            if delay > 0:  # one-way delays per sync, in sequence
                out[f"{row}:hops"] = round(injected.slept_s / (delay / 1e3) / args.repeats)
    return out


def torchft_job(rank: int, world: int, args, lighthouse: str) -> dict:
    """torchft LocalSGD over the same tensors: one Manager per group (of one rank), the quorum's
    round trip to the lighthouse and every all-reduce delayed as ours are."""
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import LocalSGD

    torch.set_num_threads(1)
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(minutes=5))
    model = torch.nn.ParameterList([torch.nn.Parameter(t) for t in model_tensors(args, rank)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    timeout = timedelta(minutes=5)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=lambda state: None,
                      state_dict=lambda: {}, min_replica_size=world, use_async_quorum=True, timeout=timeout,
                      quorum_timeout=timeout, rank=0, world_size=1, store_addr="127.0.0.1", store_port=port,
                      lighthouse_addr=lighthouse, replica_id=f"bench_latency_{rank}", hostname="127.0.0.1",
                      init_sync=False)
    algo = LocalSGD(manager, model, optimizer, sync_every=1)
    out = {}
    try:
        for delay in args.delays_ms:
            algo.sync()  # warm-up (the first quorum configures the communicator)
            with delayed_calls(manager, delay / 1e3, world) as delayed:
                out[f"torchft_localsgd@{delay}"] = _timed(algo.sync, args.repeats, dist.group.WORLD)
            if delay > 0:
                out["torchft_localsgd:hops"] = round(delayed.slept_s / (delay / 1e3) / args.repeats)
    finally:
        manager.shutdown(wait=False)
        del store
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--delays-ms", type=float, nargs="+", default=[0.0, 5.0, 20.0], help="one-way delays")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--ffn-hidden-size", type=int, default=352)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--bucket-mb", type=float, default=32.0)
    p.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    p.add_argument("--out", help="also write bench.json and bench.md here")
    args = p.parse_args(argv)
    if args.groups < 2 or args.repeats < 1 or min(args.delays_ms) < 0:
        p.error("need --groups >= 2, --repeats >= 1 and delays >= 0")
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's manager logs every quorum and commit at info
    tensors = model_tensors(args, 0)
    print(f"{args.groups} groups of 1 rank, {len(tensors)} tensors, {sum(t.numel() for t in tensors):,} fp32 "
          f"parameters ({sum(t.numel() for t in tensors) * 4 / 2**20:.1f} MiB); one-way delay injected at each "
          f"collective across the groups; median of {args.repeats}, slowest rank", flush=True)
    times = {}
    if {"ours", "ours_metrics_round"} & set(args.rows):
        times.update(run_ranks(args.groups, ours_job, args, timeout=1800)[0])
    if "torchft_localsgd" in args.rows:
        with tempfile.TemporaryDirectory() as logs:
            bind = f"127.0.0.1:{free_port()}"
            proc, _ = start_lighthouse(lighthouse_command(bind, args.groups, join_timeout_ms=1000), Path(logs))
            try:
                times.update(run_ranks(args.groups, torchft_job, args, f"http://{bind}", timeout=1800)[0])
            finally:
                proc.kill()
                proc.wait()
    table = {row: {d: statistics.median(times[f"{row}@{d}"]) for d in args.delays_ms}
             for row in ROWS if row in args.rows}
    hop_counts = {row: times.get(f"{row}:hops") for row in table}
    lines = ["| sync | one-way delays in sequence | " + " | ".join(f"{d:g} ms" for d in args.delays_ms) + " |",
             "| --- | --- |" + " --- |" * len(args.delays_ms)]
    lines += [f"| {row} | {hop_counts[row] if hop_counts[row] is not None else '-'} | "
              + " | ".join(f"{s * 1e3:.0f} ms" for s in by_delay.values()) + " |" for row, by_delay in table.items()]
    print("\n".join(lines), flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps({"args": vars(args), "median_s": table, "hops": hop_counts,
                                                    "times_s": times}, indent=1))
        (out / "bench.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
