#!/usr/bin/env python3
"""Predict time per step, tokens/s and speed-ups of FSDP, HSDP, FL+FSDP and FL+HSDP on a cluster.

  python tools/cost_model.py --preset published          # the paper's setup, its assumptions, and
                                                         # what its 8.04x implies
  python tools/cost_model.py --model llama3.1-8b --world-size 256 --ranks-per-node 8 \\
      --fl-group-size 8 --bf16 --micro-batch-size 1 --seq-length 8192 --inter-node-gbps 100
      # any pretrain flags (--config too) plus the cluster flags (see docs/flags.md, section cluster)

The same model prints the "predicted time" block of --dry-run. --json FILE also writes the rows.
"""

import argparse
import json
from dataclasses import replace
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fl_megatron.config import resolve  # noqa: E402
from fl_megatron.config.flags import parse_args  # noqa: E402
from fl_megatron.cost_model import prediction_row, table_text  # noqa: E402
from fl_megatron.cost_model.report import workload_text  # noqa: E402
from fl_megatron.cost_model.compare import compare_rows, compare_text  # noqa: E402
from fl_megatron.cost_model.flops import train_flops_per_token  # noqa: E402
from fl_megatron.cost_model.published import (ASSUMPTIONS, LEFT_OUT, PUBLISHED_SPEEDUP, best_speedup,  # noqa: E402
                                              implied_values, predictions, published_workload)


def published(seq_length: int) -> tuple[str, dict]:
    """The published-setup report and its JSON form."""
    run, work, cluster = published_workload(seq_length)
    preds = predictions(work, cluster)
    baselines = {k: preds[k] for k in ("FSDP", "HSDP")}
    rows = [prediction_row(p, work.tokens_per_step, baselines) for p in preds.values()]
    pair, best = best_speedup(work, cluster)
    implied = implied_values(work, cluster)
    t = run.cfg.training
    flops = train_flops_per_token(work.num_params, run.cfg.model, t.seq_length) * t.micro_batch_size * t.seq_length
    lines = ["Published setup (Mittone and Aldinucci, Euro-Par 2026): Llama 3.1 8B pre-training on 512 A100 "
             "(128 nodes x 4), H = 8", "", "Assumptions:"]
    lines += [f"  - {a.name}: {a.value}\n      source: {a.source}" for a in ASSUMPTIONS]
    lines += ["", "Predicted:", workload_text(run, work),
              table_text(rows, list(baselines)), "",
              f"Best predicted speed-up: {pair} {best:.2f}x; published: up to {PUBLISHED_SPEEDUP}x.", "",
              f"What {PUBLISHED_SPEEDUP}x implies, everything else as assumed:"]
    bw, c, lat = (implied[k] for k in ("inter_node_gbps", "compute_seconds", "inter_node_latency_us"))
    lines.append(f"  - an effective inter-node bandwidth of {bw['value']:.2f} Gbit/s per node (assumed "
                 f"{cluster.inter_node_gbps:g})" if bw["value"] else
                 f"  - no inter-node bandwidth: even near zero bandwidth the model gives {bw['limit']:.2f}x "
                 "(the ratio of inter-node bytes per step)")
    lines.append(f"  - a compute time of {c['value']:.3f} s per step, i.e. {flops / c['value'] / 312e12:.1%} MFU "
                 f"(assumed {work.compute_seconds:.3f} s)" if c["value"] else
                 f"  - no compute time: with zero compute the model gives {c['limit']:.2f}x")
    lines.append(f"  - an inter-node latency of {lat['value']:.1f} us per ring step (assumed "
                 f"{cluster.inter_node_latency_us:g} us; FSDP over 512 ranks pays it 511 or 2 x 511 times "
                 "per collective, per module)" if lat["value"] else
                 f"  - no inter-node latency: even at 1 s per ring step the model gives {lat['limit']:.2f}x")
    fp32 = implied_values(replace(work, param_bytes=4), cluster)
    bw32 = fp32["inter_node_gbps"]
    lines.append("  - if the runs gathered parameters in fp32 (4 bytes, not bf16): "
                 + (f"an effective inter-node bandwidth of {bw32['value']:.2f} Gbit/s per node" if bw32["value"]
                    else f"no bandwidth either (at most {bw32['limit']:.2f}x)"))
    data_fp32 = {"implied_fp32_gathers": fp32}
    lines += ["", "The model leaves out:"] + [f"  - {item}" for item in LEFT_OUT]
    data = {"assumptions": [a.__dict__ for a in ASSUMPTIONS], "rows": rows, "best_pair": pair,
            "best_speedup": best, "published_speedup": PUBLISHED_SPEEDUP, "implied": implied,
            "left_out": list(LEFT_OUT), **data_fp32}
    return "\n".join(lines), data


def configured(argv: list[str]) -> tuple[str, dict]:
    """The report for a configuration given as pretrain flags (with --world-size)."""
    cfg, _ = parse_args(argv)
    if cfg.parallel.world_size is None:
        raise ValueError("give --world-size (and --ranks-per-node) to plan a cluster")
    run = resolve(cfg, cfg.parallel.world_size, cfg.parallel.ranks_per_node)
    text = "\n".join([*(line for line in run.layout.describe().splitlines()), compare_text(run)])
    return text, {"rows": compare_rows(run)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0], add_help=False)
    parser.add_argument("--preset", choices=["published"], help="a preset setup instead of flags")
    parser.add_argument("--seq-length-published", type=int, default=8192,
                        help="sequence length assumed for the published setup")
    parser.add_argument("--json", metavar="FILE", help="also write the rows and assumptions as JSON")
    parser.add_argument("-h", "--help", action="store_true")
    ns, rest = parser.parse_known_args(argv)
    if ns.help:
        parser.print_help()
        print("\nAll pretrain flags are accepted too: python -m fl_megatron.pretrain --help")
        return 0
    try:
        text, data = published(ns.seq_length_published) if ns.preset else configured(rest)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    if ns.json:
        Path(ns.json).write_text(json.dumps(data, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
