"""The cost model's prediction for one benchmark row, on the emulated cluster's links."""

import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from fl_megatron.config import resolve  # noqa: E402
from fl_megatron.config.flags import parse_args  # noqa: E402
from fl_megatron.cost_model import Cluster, Variant, predict, workload_for  # noqa: E402
from fl_megatron.cost_model.coupling import jitter_wait_per_step, world_all_reduce_seconds  # noqa: E402

# Bytes on a 1500-byte-MTU Ethernet wire per TCP payload byte in a ring: each 1448-byte segment
# travels in a 1514-byte frame, and the node also sends one 66-byte ACK per two segments it receives
# (rings receive as much as they send).
TCP_WIRE_OVERHEAD = (1514 + 66 / 2) / 1448
# on-node work (compute and loopback collectives) is inside the calibrated compute time
FREE_GBPS = 1e9


def emulated_cluster(rate_mbit: float | None) -> Cluster:
    """gloo rings over tbf links of `rate_mbit` (None: unshaped, links taken as free)."""
    inter = rate_mbit / 1000 if rate_mbit else FREE_GBPS
    return Cluster(inter_node_gbps=inter, intra_node_gbps=FREE_GBPS, wire_overhead=TCP_WIRE_OVERHEAD,
                   library="gloo")


def predict_row(row, common_flags: list[str], nodes: int, ranks_per_node: int, rate_mbit: float | None,
                compute_s: float, steps: int, warmup: int, evaluations: int = 1, jitter_s: float = 0.0) -> dict:
    """Predicted seconds per step over the timed span and inter-node wire bytes of the whole run.
    `jitter_s`: the mean of each group's random stall before every step (order statistics: the
    slowest group's stall every step where the groups meet every step, its stalls' sum over H
    steps where they meet only at syncs); a `lockstep` row also pays a world all-reduce per step."""
    world = nodes * ranks_per_node
    ours = row.layout_flags() if row.is_peer else row.flags()  # a peer's extra flags are its algorithm's
    cfg, _ = parse_args([*common_flags, *ours, "--ranks-per-node", str(ranks_per_node)])
    run = resolve(cfg, world, ranks_per_node)
    work = replace(workload_for(run, compute_seconds=compute_s), eval_forwards=cfg.training.eval_iters)
    p = predict(Variant(row.label, run.layout, row.sync_interval, row.replica_split,
                        cfg.federation.overlap_steps, fragments=cfg.federation.fragments), work,
                emulated_cluster(rate_mbit))
    span, seconds = steps - warmup, p.span_seconds(steps, warmup)
    coupled = "lockstep" in row.fault or not run.layout.is_federated or not row.sync_interval
    stall = jitter_wait_per_step(run.layout.num_groups, row.sync_interval or 1, jitter_s, coupled)
    barrier = world_all_reduce_seconds(run.layout, emulated_cluster(rate_mbit)) if "lockstep" in row.fault else 0.0
    seconds += span * (stall + barrier)
    return {"step_seconds": seconds / span, "tokens_per_s": span * run.tokens_per_step / seconds,
            "inter_node_bytes": p.run_inter_node_bytes(steps, evaluations),
            "sync_seconds": p.sync_seconds, "compute_seconds": compute_s, "tokens_per_step": run.tokens_per_step}


def as_tuned(row, run_dir: Path):
    """A --fl-tune row as the mode its run chose last (its metrics.jsonl's last `tune` record), for
    the prediction: the row itself where the run made no choice."""
    if "--fl-tune" not in row.extra or not (run_dir / "metrics.jsonl").exists():
        return row
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    decisions = [json.loads(line)["tune"] for line in lines if '"tune"' in line]
    if not decisions:
        return row
    return replace(row, sync_interval=decisions[-1]["mode"]["sync_interval"], extra=tuple(decisions[-1]["flags"]))
