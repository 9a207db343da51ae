"""Tables of predictions: time per step and per sync, tokens/s, inter-node bytes and speed-ups."""

from ..costs import format_bytes
from .timing import Prediction, Workload


def workload_text(run, work: Workload) -> str:
    """The batch and sequence length a prediction assumes, resolved (so a flag that did not take is seen)."""
    t = run.cfg.training
    sequences = work.tokens_per_step // t.seq_length
    return (f"  workload: micro-batch {t.micro_batch_size} x sequence length {t.seq_length} x "
            f"{run.accumulation} micro-batch(es) per rank and step = {sequences:,} sequences, "
            f"{work.tokens_per_step:,} tokens per step over {run.world_size} ranks; {work.num_params:,} parameters")


def prediction_row(p: Prediction, tokens_per_step: int, baselines: dict[str, Prediction]) -> dict:
    """Plain-JSON summary of one prediction, with the speed-up over each baseline."""
    row = {"variant": p.variant.label, "layout": _layout_text(p), "compute_s": p.compute_seconds,
           "step_s": p.step_seconds, "sync_s": p.sync_seconds, "sync_interval": p.variant.sync_every,
           "mean_step_s": p.mean_step_seconds, "tokens_per_s": tokens_per_step / p.mean_step_seconds,
           "inter_node_bytes_per_step": p.step_inter_node_bytes,
           "inter_node_bytes_per_sync": p.sync_inter_node_bytes}
    for name, base in baselines.items():
        row[f"x_{name}"] = base.mean_step_seconds / p.mean_step_seconds
    return row


def _layout_text(p: Prediction) -> str:
    lay = p.variant.layout
    inner = f"{lay.replicas}x{lay.shard_size}" if lay.is_hsdp else f"{lay.shard_size}"
    return f"{lay.num_groups} x ({inner})"


def table_text(rows: list[dict], baselines: list[str]) -> str:
    """A fixed-width table of prediction rows."""
    head = (f"  {'variant':<14} {'groups x (P x S)':<17} {'compute':>8} {'step':>8} {'sync':>8} {'H':>3} "
            f"{'mean/step':>9} {'tokens/s':>11} {'inter-node/step':>15} {'/sync':>10}"
            + "".join(f" {'x ' + b:>8}" for b in baselines))
    lines = [head]
    for r in rows:
        lines.append(
            f"  {r['variant']:<14} {r['layout']:<17} {r['compute_s']:>7.3f}s {r['step_s']:>7.3f}s "
            f"{r['sync_s']:>7.3f}s {r['sync_interval'] or '-':>3} {r['mean_step_s']:>8.3f}s "
            f"{r['tokens_per_s']:>11,.0f} {format_bytes(r['inter_node_bytes_per_step']):>15} "
            f"{format_bytes(r['inter_node_bytes_per_sync']):>10}"
            + "".join(f" {r['x_' + b]:>7.2f}x" for b in baselines))
    return "\n".join(lines)
