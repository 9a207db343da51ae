#!/usr/bin/env python3
"""Decentralised averaging at equal steps: eval loss and inter-group bytes of FedAvg (complete),
ring, exponential, one-peer exponential and Ada over 8 federation groups, several seeds.

Every run trains the demo model on the demo data (examples/demo.json) on 8 ranks, one per group,
with the same hyper-parameters and steps; only the topology and the seed change. Bytes are what
each group sent to other groups over the run (metrics.jsonl `group_bytes`: a gossip round's
sends, FedAvg's all-reduce at its ring size 2(G-1)/G, and every sync's metric sample), averaged
over groups. Writes gossip.json, gossip.md and eval_loss_vs_bytes.png to --out.

  python tools/bench_gossip.py --seeds 1 2 3 --out runs/gossip -- --micro-batch-size 2
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
sys.path.insert(0, str(TOOLS))

from bench_quality import GOSSIP, parse_runs_args, run_one, stats  # noqa: E402


def sync_summary(run_dir: str) -> tuple[float, dict]:
    """(bytes one group sent to the others over the run, averaged over groups; how many syncs
    used each graph), from the run's sync records."""
    syncs = [r for r in map(json.loads, (Path(run_dir) / "metrics.jsonl").read_text().splitlines()) if "graph" in r]
    per_group = [sum(b) for b in zip(*(r["group_bytes"] for r in syncs))]
    graphs: dict = {}
    for r in syncs:
        graphs[r["graph"]] = graphs.get(r["graph"], 0) + 1
    return statistics.fmean(per_group), graphs


def table(results: list[dict]) -> str:
    base = {r["seed"]: r for r in results if r["topology"] == "complete"}
    lines = ["| topology | seeds | eval loss mean | std | min | max | vs FedAvg (mean, per seed) | MB sent per group "
             "| x FedAvg bytes | graphs used (seed 1) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for topology in GOSSIP:
        rows = [r for r in results if r["topology"] == topology]
        if not rows:
            continue
        loss, sent = stats([r["eval_loss"] for r in rows]), statistics.fmean(r["bytes"] for r in rows)
        gaps = [(r["eval_loss"] - base[r["seed"]]["eval_loss"]) / base[r["seed"]]["eval_loss"]
                for r in rows if r["seed"] in base]
        fedavg = statistics.fmean(r["bytes"] for r in base.values()) if base else float("nan")
        lines.append(f"| {topology} | {loss['n']} | {loss['mean']:.4f} | {loss['std']:.4f} | {loss['min']:.4f} | "
                     f"{loss['max']:.4f} | {100 * statistics.fmean(gaps):+.2f} % ({', '.join(f'{100 * g:+.2f}' for g in gaps)}) "
                     f"| {sent / 1e6:.1f} | {sent / fedavg:.2f} | {rows[0]['graphs']} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for topology in GOSSIP:
        rows = [r for r in results if r["topology"] == topology]
        if rows:
            xs, ys = [r["bytes"] / 1e6 for r in rows], [r["eval_loss"] for r in rows]
            ax.scatter(xs, ys, alpha=0.45)
            ax.errorbar(statistics.fmean(xs), statistics.fmean(ys), yerr=statistics.stdev(ys) if len(ys) > 1 else 0,
                        fmt="o", capsize=4, label=topology, color=ax.collections[-1].get_facecolor()[0][:3])
    ax.set_xlabel("MB sent per group to other groups (whole run)")
    ax.set_ylabel("final eval loss")
    ax.set_title("8 federation groups: eval loss against inter-group bytes (dots: seeds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--topologies", nargs="+", choices=GOSSIP, default=list(GOSSIP))
    args, extra, out = parse_runs_args(parser, argv, "runs/gossip")
    results = []
    for topology in args.topologies:
        for seed in args.seeds:
            run = run_one(f"G8 {topology}", seed, out, extra, args.timeout, args.reuse)
            sent, graphs = sync_summary(run["run_dir"])
            run.update(topology=topology, bytes=sent, graphs=graphs)
            results.append(run)
    text = table(results)
    print(text)
    (out / "gossip.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "gossip.md").write_text(text)
    plot(results, out / "eval_loss_vs_bytes.png")
    print(f"wrote {out / 'gossip.md'} and {out / 'eval_loss_vs_bytes.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
