#!/usr/bin/env python3
"""Quality at equal tokens: evaluation perplexity of FSDP vs FL+FSDP and HSDP vs FL+HSDP, several seeds.

Every run trains the demo model on the demo data (examples/demo.json) with the same hyper-parameters,
steps and tokens; only the layout and the seed change. The network does not affect quality, so the
runs use torchrun on this machine (loopback). Prints mean and spread per layout and writes
quality.json and quality.md to --out.

  python tools/bench_quality.py --seeds 1 2 3 --out runs/quality
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SPARSE_DENSITIES = ("0.0156", "0.05")
# name -> (ranks, flags); pairs compare a baseline with its federated form at equal ranks and tokens.
# Every layout names its group size: examples/demo.json itself sets groups of 2.
LAYOUTS = {
    "FSDP": (4, ["--fl-group-size", "4"]),
    "FL+FSDP": (4, ["--fl-group-size", "2"]),
    "HSDP": (8, ["--fl-group-size", "8", "--fl-hsdp-shard-size", "2"]),
    "FL+HSDP": (8, ["--fl-group-size", "4", "--fl-hsdp-shard-size", "2"]),
    # the sync modes of docs/sync-modes.md on FL+FSDP
    "FL+FSDP int8+EF overlap": (4, ["--fl-group-size", "2", "--fl-sync-dtype", "int8", "--fl-error-feedback",
                                    "--fl-overlap-steps", "1"]),
    "FL+FSDP int4+EF": (4, ["--fl-group-size", "2", "--fl-sync-dtype", "int4", "--fl-error-feedback"]),
    "FL+FSDP int4+EF 2 fragments overlap": (4, ["--fl-group-size", "2", "--fl-sync-dtype", "int4",
                                                "--fl-error-feedback", "--fl-fragments", "2",
                                                "--fl-overlap-steps", "1"]),
    # the sparse sync (docs/sync-modes.md): SparseLoCo's density and about three times it, int2 values
    **{f"FL+FSDP sparse {d}": (4, ["--fl-group-size", "2", "--fl-sync-dtype", "int2", "--fl-topk-density", d,
                                   "--fl-error-feedback"]) for d in SPARSE_DENSITIES},
    "FL+FSDP nesterov int8+EF": (4, ["--fl-group-size", "2", "--fl-outer-optimizer", "nesterov",
                                     "--fl-sync-dtype", "int8", "--fl-error-feedback"]),
    # groups of unequal speed (docs/heterogeneous.md): a pinned plan, token weights, the lr on the
    # federation's tokens; (8, 8) is the equal plan in the same code path
    "FL+FSDP plan 8,8": (4, ["--fl-group-size", "2", "--fl-group-intervals", "8,8"]),
    "FL+FSDP plan 8,4": (4, ["--fl-group-size", "2", "--fl-group-intervals", "8,4"]),
}
# decentralised averaging over 8 groups of one rank (tools/bench_gossip.py): every one measures DBench metrics
GOSSIP = ("complete", "ring", "exponential", "one-peer-exponential", "ada")
LAYOUTS.update({f"G8 {t}": (8, ["--fl-group-size", "1", "--fl-topology", t, "--fl-dbench-metrics"]) for t in GOSSIP})
# what summary.json must report for each: (federation groups, replicas per group)
EXPECTED = {"FSDP": (1, 1), "FL+FSDP": (2, 1), "HSDP": (1, 4), "FL+HSDP": (2, 2),
            "FL+FSDP int8+EF overlap": (2, 1), "FL+FSDP int4+EF": (2, 1),
            "FL+FSDP int4+EF 2 fragments overlap": (2, 1), "FL+FSDP nesterov int8+EF": (2, 1),
            "FL+FSDP plan 8,8": (2, 1), "FL+FSDP plan 8,4": (2, 1),
            **{f"FL+FSDP sparse {d}": (2, 1) for d in SPARSE_DENSITIES},
            **{f"G8 {t}": (8, 1) for t in GOSSIP}}
PAIRS = {"fsdp": ("FSDP", "FL+FSDP"), "hsdp": ("HSDP", "FL+HSDP"),
         "int8-overlap": ("FL+FSDP", "FL+FSDP int8+EF overlap"), "int4": ("FL+FSDP", "FL+FSDP int4+EF"),
         "int4-frag2-overlap": ("FL+FSDP", "FL+FSDP int4+EF 2 fragments overlap"),
         "nesterov-int8": ("FL+FSDP", "FL+FSDP nesterov int8+EF"),
         **{f"sparse-{d}": ("FL+FSDP", f"FL+FSDP sparse {d}") for d in SPARSE_DENSITIES},
         "plan-8-4": ("FL+FSDP plan 8,8", "FL+FSDP plan 8,4")}


def run_one(name: str, seed: int, out: Path, extra: list[str], timeout: float, reuse: bool = False) -> dict:
    """One training run (or, with `reuse`, the finished run already in its directory); returns what
    its summary.json says (raises with the log tail on failure)."""
    ranks, flags = LAYOUTS[name]
    run_dir = out / f"{name.replace('+', '_')}-seed{seed}"
    if reuse and (run_dir / "summary.json").exists():
        return _result(name, seed, run_dir, "reused")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           "-m", "fl_megatron.pretrain", "--config", str(REPO / "examples" / "demo.json"), *flags,
           "--seed", str(seed), "--run-dir", str(run_dir), *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "error:" in line]
        raise RuntimeError(f"{name} seed {seed} failed ({proc.returncode}): {errors[:1] or proc.stderr[-3000:]}")
    return _result(name, seed, run_dir, f"{time.perf_counter() - start:.0f} s")


def _result(name: str, seed: int, run_dir: Path, how: str) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    got = (summary["layout"]["num_groups"], summary["layout"]["replicas"])
    if got != EXPECTED[name]:
        raise RuntimeError(f"{run_dir}: {name} ran {got[0]} groups of {got[1]} replicas, expected {EXPECTED[name]}")
    print(f"  {name:<8} seed {seed}: eval loss {summary['eval_loss']:.4f}, perplexity {summary['eval_perplexity']:.2f}, "
          f"{summary['tokens']:,} tokens ({how})", flush=True)
    return {"layout": name, "seed": seed, "run_dir": str(run_dir), "eval_loss": summary["eval_loss"],
            "eval_perplexity": summary["eval_perplexity"], "tokens": summary["tokens"]}


def stats(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def markdown(results: list[dict], table: dict) -> str:
    lines = ["| layout | seeds | tokens | eval perplexity mean | std | min | max |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, s in table.items():
        tokens = next(r["tokens"] for r in results if r["layout"] == name)
        lines.append(f"| {name} | {s['n']} | {tokens:,} | {s['mean']:.2f} | {s['std']:.2f} | {s['min']:.2f} | {s['max']:.2f} |")
    return "\n".join(lines) + "\n"


def parse_runs_args(parser: argparse.ArgumentParser, argv, default_out: str) -> tuple:
    """Add the options every seeds benchmark shares, parse; returns (args, extra flags, out dir)."""
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--out", default=default_out)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--reuse", action="store_true", help="keep finished runs found in --out instead of rerunning them")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="-- then flags passed to every run")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return args, [a for a in args.extra if a != "--"], out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", nargs="+", choices=sorted(PAIRS), default=["fsdp", "hsdp"])
    args, extra, out = parse_runs_args(parser, argv, "runs/quality")
    results = []
    names = list(dict.fromkeys(name for pair in args.pairs for name in PAIRS[pair]))  # each layout once
    for name in names:
        for seed in args.seeds:
            results.append(run_one(name, seed, out, extra, args.timeout, args.reuse))
    table = {name: stats([r["eval_perplexity"] for r in results if r["layout"] == name]) for name in names}
    for pair in args.pairs:
        base, fl = PAIRS[pair]
        ratios = [math.exp(a["eval_loss"] - b["eval_loss"]) for a in results if a["layout"] == base
                  for b in results if b["layout"] == fl and b["seed"] == a["seed"]]
        table[f"{base}/{fl} perplexity ratio"] = stats(ratios)
        gaps = [(b["eval_loss"] - a["eval_loss"]) / a["eval_loss"] for a in results if a["layout"] == base
                for b in results if b["layout"] == fl and b["seed"] == a["seed"]]
        table[f"{fl} vs {base} relative eval-loss difference"] = stats(gaps)
    paired = [k for k in table if k.endswith((" ratio", " difference"))]
    text = markdown(results, {k: v for k, v in table.items() if k not in paired})
    for key, s in table.items():
        if key in paired:
            text += f"\n{key} (same seed): mean {s['mean']:.4f}, std {s['std']:.4f}, min {s['min']:.4f}, max {s['max']:.4f}\n"
    print(text)
    (out / "quality.json").write_text(json.dumps({"runs": results, "stats": table}, indent=2) + "\n")
    (out / "quality.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
