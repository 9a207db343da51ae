#!/usr/bin/env python3
"""Plot runs side by side from their metrics.jsonl files (matplotlib, Agg: no display needed).

    python tools/plot_runs.py runs/fsdp runs/fl-h8 [--label FSDP "FL H=8"] [--out plots]

Writes, one line per run: loss_vs_tokens.png, loss_vs_time.png (wall clock: elapsed_s),
eval_loss_vs_tokens.png (when a run evaluated), bytes_per_tier.png (rank 0's cumulative
intra-node and inter-node payload bytes against step) and, for runs with DBench metrics
(--fl-topology other than complete, or --fl-dbench-metrics), consensus.png (consensus distance
and the bytes the groups sent, against step; Ada's graphs marked). A federated run's
metrics.jsonl has the federation's records (at each sync); its groups' own per-step records
(groups/group_GGGGG.jsonl) go into group_loss.png: each group's loss against step, with the
federation's mean at the syncs. Runs that recorded per-sync telemetry get sync_telemetry.png: the
MB/s each network tier carried during each sync's exchange, and the fraction of the time spent
waiting on the sync. Needs pip install -e ".[plots]".
"""

import argparse
import importlib.util
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fl_megatron.training.run_files import group_records, logged_steps, read_jsonl  # noqa: E402

MIB = 2 ** 20


@dataclass
class Run:
    """One run's records: a record per logged step (a federated run's merged from its groups'
    files, see fl_megatron.training.run_files.logged_steps) and evaluation records, in order."""

    label: str
    steps: list
    evals: list
    groups: dict = field(default_factory=dict)  # group -> its own step records (federated runs)
    federation: list = field(default_factory=list)  # metrics.jsonl's step records (a federated run's: its syncs)
    syncs: list = field(default_factory=list)  # metrics.jsonl's records of a sync (an overlapped landing has no loss)


def read_records(run_dir: Path) -> list[dict]:
    """The objects of RUN_DIR/metrics.jsonl; a torn last line (a killed run) is skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run_dir} has no metrics.jsonl: is it a run directory (--run-dir) of a run "
                         "that logged at least one step?")
    return read_jsonl(path)


def default_label(run_dir: Path) -> str:
    """The directory's name, with the layout from summary.json when there is one."""
    label = Path(run_dir).resolve().name
    summary = Path(run_dir) / "summary.json"
    if summary.is_file():
        layout = json.loads(summary.read_text()).get("layout") or {}
        if layout.get("num_groups", 1) > 1:
            sync = layout.get("sync_interval") or "never"
            label += f" ({layout['num_groups']} groups of {layout['group_size']}, sync {sync})"
    return label


def load_run(run_dir: Path, label: Optional[str] = None) -> Run:
    records = read_records(run_dir)
    return Run(label or default_label(run_dir), logged_steps(run_dir), [r for r in records if "eval_loss" in r],
               group_records(run_dir), [r for r in records if "loss" in r],
               [r for r in records if "sync_exchange_seconds" in r])


def wall_clock(records: list) -> list[float]:
    """elapsed_s made continuous over resumes (each resumed process counts from 0 again)."""
    out, offset, previous = [], 0.0, 0.0
    for r in records:
        if r["elapsed_s"] < previous:
            offset += previous
        previous = r["elapsed_s"]
        out.append(offset + previous)
    return out


def _figure(title: str, xlabel: str, ylabel: str, ncols: int = 1):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4 * ncols, 4.4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    for ax in axes:
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    return fig, axes


def loss_vs_tokens(runs: Sequence[Run]):
    fig, (ax,) = _figure("Training loss", "tokens", "loss (mean over ranks)")
    for run in runs:
        ax.plot([r["tokens"] for r in run.steps], [r["loss"] for r in run.steps], label=run.label)
    ax.legend()
    return fig


def loss_vs_time(runs: Sequence[Run]):
    """Loss against wall-clock seconds; runs whose records have no elapsed_s are left out."""
    timed = [run for run in runs if run.steps and all("elapsed_s" in r for r in run.steps)]
    if not timed:
        return None
    fig, (ax,) = _figure("Training loss against wall-clock time", "seconds since training started",
                         "loss (mean over ranks)")
    for run in timed:
        ax.plot(wall_clock(run.steps), [r["loss"] for r in run.steps], label=run.label)
    ax.legend()
    return fig


def eval_loss_vs_tokens(runs: Sequence[Run]):
    """Held-out loss against tokens (step x tokens per step); None when no run evaluated."""
    evaluated = [run for run in runs if run.evals and run.steps]
    if not evaluated:
        return None
    fig, (ax,) = _figure("Evaluation loss", "tokens", "eval loss")
    for run in evaluated:
        per_step = run.steps[-1]["tokens"] / run.steps[-1]["step"]
        ax.plot([r["step"] * per_step for r in run.evals], [r["eval_loss"] for r in run.evals],
                marker="o", label=run.label)
    ax.legend()
    return fig


def bytes_per_tier(runs: Sequence[Run]):
    """Two panels, intra-node and inter-node: cumulative MiB of rank 0 against step (runs that
    did not count bytes, such as the torchft peers, are left out)."""
    fig, axes = _figure("Payload bytes per network tier (rank 0, cumulative)", "step", "MiB", ncols=2)
    for ax, tier in zip(axes, ("intra_node", "inter_node")):
        ax.set_title(tier.replace("_", "-"))
        for run in runs:
            counted = [r for r in run.steps if f"{tier}_bytes" in r]
            if counted:
                ax.plot([r["step"] for r in counted], [r[f"{tier}_bytes"] / MIB for r in counted], label=run.label)
        ax.legend()
    return fig


def consensus(runs: Sequence[Run]):
    """Two panels: the relative consensus distance measured before each sync (marker: the graph
    that sync used) and the cumulative MiB the groups sent to each other; None without metrics."""
    measured = [run for run in runs if any("consensus_relative" in r for r in run.steps)]
    if not measured:
        return None
    fig, (left, right) = _figure("Consensus across federation groups (DBench)", "step", "", ncols=2)
    left.set_ylabel("relative consensus distance (before the sync)")
    left.set_yscale("log")
    right.set_ylabel("MiB sent between groups (all groups, cumulative)")
    markers = {"complete": "o", "ring": "s", "torus": "D", "exponential": "^", "one-peer-exponential": "v",
               "none": "x"}
    for run in measured:
        syncs = [r for r in run.steps if "consensus_relative" in r]
        line, = left.plot([r["step"] for r in syncs], [max(r["consensus_relative"], 1e-30) for r in syncs],
                          label=run.label, alpha=0.6)
        for graph in sorted({r["graph"] for r in syncs}):
            picked = [r for r in syncs if r["graph"] == graph]
            left.scatter([r["step"] for r in picked], [max(r["consensus_relative"], 1e-30) for r in picked],
                         marker=markers.get(graph, "."), color=line.get_color(), label=f"{run.label}: {graph}")
        total, cumulative = 0.0, []
        for r in syncs:
            total += sum(r["group_bytes"]) / MIB
            cumulative.append(total)
        right.plot([r["step"] for r in syncs], cumulative, label=run.label)
    left.legend(fontsize="small")
    right.legend()
    return fig


def sync_telemetry(runs: Sequence[Run]):
    """Two panels against step, one point per sync: the MB/s each network tier carried during the
    exchange (rank 0's wire bytes over the exchange's time), and the fraction of the time between
    two records that training waited on the sync; None when no run recorded them."""
    measured = [(run, run.syncs or [r for r in run.steps if "sync_exchange_seconds" in r]) for run in runs]
    measured = [(run, syncs) for run, syncs in measured if syncs]
    if not measured:
        return None
    fig, (left, right) = _figure("What each sync achieved", "step", "", ncols=2)
    left.set_ylabel("MB/s on the wire during the exchange")
    right.set_ylabel("fraction of the time waiting on the sync")
    for run, syncs in measured:
        for tier in ("inter_node", "intra_node"):
            key = f"sync_{tier}_bytes_per_s"
            points = [r for r in syncs if key in r]
            if points:
                left.plot([r["step"] for r in points], [r[key] / 1e6 for r in points], marker="o",
                          label=f"{run.label}: {tier.replace('_', '-')}")
        waits = [r for r in syncs if "sync_wait_fraction" in r]
        right.plot([r["step"] for r in waits], [r["sync_wait_fraction"] for r in waits], marker="o", label=run.label)
    left.legend(fontsize="small")
    right.legend()
    return fig


def group_loss(runs: Sequence[Run]):
    """Each group's own loss against step (thin lines, the run's colour) and the federation's
    mean at each sync (markers); None when no run has group records."""
    grouped = [run for run in runs if run.groups]
    if not grouped:
        return None
    fig, (ax,) = _figure("Training loss of each federation group", "step", "loss (mean over the group's ranks)")
    for run in grouped:
        line, = ax.plot([r["step"] for r in run.federation], [r["loss"] for r in run.federation], "o",
                        label=f"{run.label}: mean over groups at the syncs")
        for records in run.groups.values():
            ax.plot([r["step"] for r in records], [r["loss"] for r in records], color=line.get_color(),
                    linewidth=0.7, alpha=0.5)
    ax.legend()
    return fig


def plot_runs(runs: Sequence[Run]) -> dict:
    """{file name: Figure} for every plot that has data."""
    figures = {"loss_vs_tokens.png": loss_vs_tokens(runs), "loss_vs_time.png": loss_vs_time(runs),
               "eval_loss_vs_tokens.png": eval_loss_vs_tokens(runs), "bytes_per_tier.png": bytes_per_tier(runs),
               "consensus.png": consensus(runs), "group_loss.png": group_loss(runs),
               "sync_telemetry.png": sync_telemetry(runs)}
    return {name: fig for name, fig in figures.items() if fig is not None}


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (--run-dir of each run)")
    p.add_argument("--out", default="plots", metavar="DIR", help="where the PNG files go (default: plots)")
    p.add_argument("--label", nargs="+", action="extend", metavar="NAME",
                   help="one legend label per run, in order (default: directory name and layout)")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        if importlib.util.find_spec("matplotlib") is None:
            raise ValueError('matplotlib is not installed: pip install -e ".[plots]"')
        if args.label and len(args.label) != len(args.run_dirs):
            raise ValueError(f"{len(args.label)} --label value(s) for {len(args.run_dirs)} run directories; "
                             "give one label per run or none")
        labels = args.label or [None] * len(args.run_dirs)
        runs = [load_run(Path(d), label) for d, label in zip(args.run_dirs, labels)]
    except ValueError as e:
        print(f"plot_runs: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, fig in plot_runs(runs).items():
        fig.savefig(out / name, dpi=120)
        print(f"wrote {out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
