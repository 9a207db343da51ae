"""What rank 0 prints: the start-up banner and one progress line per logged step."""

import sys

from ..config.parallel import FederationConfig
from ..config.training import TrainingConfig
from ..group_layout import group_sizes_of
from ..topology import Layout


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def progress_line(record: dict, total_steps: int, eta_seconds: float) -> str:
    """One line: step/total, loss, lr, tokens/s, sync, ETA."""
    parts = [f"step {record['step']:>{len(str(total_steps))}}/{total_steps}",
             f"loss {record['loss']:.4f}", f"lr {record['lr']:.2e}",
             f"grad {record['grad_norm']:.3f}", f"{record['tokens_per_s']:,.0f} tok/s"]
    if record.get("synced"):
        sync = f"sync {record['sync_seconds'] * 1e3:.0f} ms"
        if "param_variance" in record:
            sync += f" var {record['param_variance']:.2e}"
        elif "prev_sync_param_variance" in record:  # the previous sync's, carried by this one's vote
            sync += f" var {record['prev_sync_param_variance']:.2e} (step {record['prev_sync_step']})"
        if "fragments" in record:
            sync += f" fragment {','.join(map(str, record['fragments']))}"
        if "graph" in record:
            sync += f" {record['graph']} consensus {record['consensus_distance']:.3e} ({record['consensus_relative']:.2e} rel)"
        parts.append(sync)
    parts.append(f"ETA {format_duration(eta_seconds)}")
    return " | ".join(parts)


def say(text: str, enabled: bool = True) -> None:
    if enabled:
        print(text, file=sys.stdout, flush=True)


def batch_line(t: TrainingConfig, accum: int, layout: Layout) -> str:
    """Samples per rank, per group step and over all ranks (banner and dry run)."""
    per_rank = t.micro_batch_size * accum
    sizes = sorted(set(group_sizes_of(layout)[0]), reverse=True)
    per_group = "/".join(str(per_rank * g) for g in sizes) + (" (by group size)" if len(sizes) > 1 else "")
    return (f"  batch: micro {t.micro_batch_size} x {accum} accumulation = {per_rank} samples per rank, "
            f"{per_group} per group step, {per_rank * layout.world_size} over all ranks "
            f"({per_rank * layout.world_size * t.seq_length:,} tokens of seq {t.seq_length} per step)")


def federation_line(layout: Layout, fed: FederationConfig) -> str:
    """When and how the groups are averaged (banner and dry run)."""
    if not layout.is_federated:
        return "  federation: none (a single group)"
    if not fed.syncing:
        return "  federation: averaging disabled (independent groups)"
    split = f", {'replica split' if fed.replica_split else 'naive'} HSDP averaging" if layout.is_hsdp else ""
    outer = ""
    if not fed.plain_average:
        outer = f", outer {fed.outer_optimizer} lr {fed.resolved_outer_lr:g}"
        if fed.outer_optimizer != "fedavg":
            outer += f" momentum {fed.outer_momentum:g}"
        sparse = f" sparse (top {fed.topk_density:g} of each chunk)" if fed.topk_density else ""
        decay = fed.resolved_error_feedback_decay
        outer += f", {fed.sync_dtype}{sparse} sync" + (
            f" with error feedback{f' (decay {decay:g})' if decay != 1 else ''}" if fed.error_feedback else "")
    if fed.gossip:
        graph = f"ada over {' < '.join(fed.ada_ladder)}" if fed.topology == "ada" else f"{fed.topology} gossip"
        full = f", a full average every {fed.global_average_interval} syncs" if fed.global_average_interval else ""
        return (f"  federation: {graph} every {fed.sync_interval} steps{full}, a full average after the last"
                f"{split}; DBench metrics at every sync")
    if fed.per_group_steps:
        plan = (f"each group its own steps per round ({'/'.join(map(str, fed.pinned_intervals))}, pinned)"
                if fed.group_intervals else f"each group as many steps per round as fit in the fastest group's "
                                            f"{fed.sync_interval} (balanced from the measured step times; the first "
                                            "round one step each)")
        return (f"  federation: token-weighted average after {plan}, and after the last; the lr follows the "
                f"federation's tokens{split}{outer}")
    if fed.fragments > 1:
        return (f"  federation: average 1 of {fed.fragments} fragments every {fed.fragment_interval} steps, in turn "
                f"(each every {fed.sync_interval} steps), all after the last{split}{outer}")
    return f"  federation: average every {fed.sync_interval} steps and after the last{split}{outer}"
