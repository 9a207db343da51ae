#!/usr/bin/env python
"""Checkpoint cost on CPU ranks: save and load time and peak memory per rank, and the Hugging Face
converter's peak memory against the model's fp32 size.

    python tools/bench_checkpoint.py [--ranks 4] [--group-size 2] [--backend fsdp2] [--dir DIR]

Default model: a Llama of about 125M parameters (12 layers, hidden 768, vocab 32000), AdamW, one
training step before saving (so the moments exist). Peak memory is the process's maximum
resident set size (ru_maxrss), which includes the interpreter and torch (reported separately).
"""

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fl_megatron.config import RunConfig, resolve
from fl_megatron.local_ranks import run_ranks
from fl_megatron.models import count_parameters, get_preset


def _config(args, directory: str) -> RunConfig:
    cfg = RunConfig(model=get_preset("llama-tiny"))
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups = 12, 768, 2048, 12, 4
    m.vocab_size = 32000
    cfg.parallel.backend = args.backend
    cfg.deepspeed = {} if args.backend == "deepspeed" else None
    cfg.data.mock_data = True
    cfg.training.seq_length, cfg.training.micro_batch_size, cfg.training.train_iters = 64, 1, 10
    cfg.federation.group_size = args.group_size
    cfg.checkpoint.save = cfg.checkpoint.load = directory
    return cfg


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rank(rank, world, args, directory):
    from fl_megatron.backends import make_backend
    from fl_megatron.checkpoint import Checkpointer
    from fl_megatron.federation import FederationEngine, build_process_groups

    run = resolve(_config(args, directory), world, world)
    groups = build_process_groups(run.layout, "cpu", async_checkpoint=args.backend == "fsdp2")
    backend = make_backend(run, groups, torch.device("cpu"))
    engine = FederationEngine(backend, groups, run.cfg.federation)
    tokens = torch.randint(0, run.cfg.model.vocab_size, (1, 65), generator=torch.Generator().manual_seed(rank))
    loss = torch.nn.functional.cross_entropy(backend.forward(tokens[:, :-1]).float().flatten(0, 1), tokens[:, 1:].flatten())
    backend.backward(loss, 1, last=True)
    backend.optimizer_step(1e-4)
    built = _peak_mib()
    checkpointer = Checkpointer(run, rank, backend, engine)
    dist.barrier()
    start = time.perf_counter()
    checkpointer.save(1)
    save_s = time.perf_counter() - start
    saved = _peak_mib()
    dist.barrier()
    start = time.perf_counter()
    checkpointer.resume(lambda text: None)
    load_s = time.perf_counter() - start
    out = {"save_s": save_s, "load_s": load_s, "peak_after_build_mib": built, "peak_after_save_mib": saved,
           "peak_after_load_mib": _peak_mib()}
    if args.backend == "fsdp2":  # the same save with --async-save: the stall, then the background write
        checkpointer.options.async_save = True
        dist.barrier()
        start = time.perf_counter()
        checkpointer.save(2)
        out["async_stall_s"] = time.perf_counter() - start
        start = time.perf_counter()
        checkpointer.finish_pending()
        out["async_publish_wait_s"] = time.perf_counter() - start
        out["peak_after_async_mib"] = _peak_mib()
    return out


def _converter_peak(checkpoint: str, output: str, dtype: str) -> float:
    """Peak RSS (MiB) of the converter, and of a process importing the same modules."""
    code = ("import resource, sys\nfrom fl_megatron.convert.from_checkpoint import convert\n"
            "{}\nprint(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")
    run = f"convert({checkpoint!r}, {output!r}, dtype={dtype!r}, log=lambda *_: None)"
    out = subprocess.run([sys.executable, "-c", code.format(run)], capture_output=True, text=True, check=True)
    base = subprocess.run([sys.executable, "-c", code.format("import torch.distributed.checkpoint, safetensors.torch")],
                          capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1]), float(base.stdout.split()[-1])


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--group-size", type=int, default=2)
    p.add_argument("--backend", default="fsdp2", choices=["fsdp2", "deepspeed"])
    p.add_argument("--dir", help="where to write (default: a temporary directory)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        ckpt = str(Path(tmp) / "ckpt")
        params = count_parameters(_config(args, ckpt).model)
        results = run_ranks(args.ranks, _rank, args, ckpt, timeout=1800)
        size = sum(f.stat().st_size for f in (Path(ckpt) / "iter_0000001").rglob("*") if f.is_file())
        peak, base = _converter_peak(ckpt, str(Path(tmp) / "hf"), "fp32")
    fp32_mib = params * 4 / 2**20
    print(f"model: {params:,} parameters ({fp32_mib:,.0f} MiB in fp32), backend {args.backend}, "
          f"{args.ranks} ranks in groups of {args.group_size}; checkpoint {size / 2**20:,.0f} MiB on disk")
    for rank, r in enumerate(results):
        print(f"  rank {rank}: save {r['save_s']:.2f} s, load {r['load_s']:.2f} s; peak RSS after build "
              f"{r['peak_after_build_mib']:,.0f} MiB, after save {r['peak_after_save_mib']:,.0f} MiB, "
              f"after load {r['peak_after_load_mib']:,.0f} MiB")
    if "async_stall_s" in results[0]:
        stall = max(r["save_s"] for r in results)
        staged = max(r["async_stall_s"] for r in results)
        waited = max(r["async_publish_wait_s"] for r in results)
        print(f"  --async-save: training stalls {staged:.2f} s (state copied to host memory) instead of "
              f"{stall:.2f} s, {stall / max(staged, 1e-9):.1f}x less, slowest rank; the write then took "
              f"{waited:.2f} s more in the background (here waited for at once; in a run, at the next sync); "
              f"peak RSS after it {max(r['peak_after_async_mib'] for r in results):,.0f} MiB")
    print(f"  converter (fp32 export): peak RSS {peak:,.0f} MiB = {peak / fp32_mib:.2f} x the model's fp32 size; "
          f"without the {base:,.0f} MiB of an interpreter with torch loaded: {(peak - base) / fp32_mib:.2f} x")
    print(json.dumps({"params": params, "ranks": results, "converter_peak_mib": peak, "baseline_mib": base}))


if __name__ == "__main__":
    main()
