"""The records a run logs per step: each group's own (reduced inside the group, every logged step)
and the federation's (over all groups, at each sync from its vote, or every logged step when the
run has a single group). docs/metrics.md lists the fields."""

from dataclasses import dataclass
from typing import Optional

from ..federation import SyncResult
from ..federation.vote import Vote, token_weight


@dataclass
class Interval:
    """Steps and seconds since a record was last written, on one clock."""

    start: float
    steps: int = 0

    def take(self, now: float) -> tuple[int, float]:
        """(steps, seconds) of the interval ending now; the next one starts now."""
        taken = (self.steps, now - self.start)
        self.start, self.steps = now, 0
        return taken


def step_record(step: int, tokens_per_step: int, elapsed: float, loss: float, grad_norm: float, lr: float,
                tokens_per_s: float, sync: Optional[SyncResult], bytes_so_far: dict,
                interval_seconds: Optional[float] = None) -> dict:
    """The fields every step record has, and the sync's when this step synced. `interval_seconds`:
    the wall time the record covers (the sync's share of it is the time spent waiting on it)."""
    record = {
        "step": step, "tokens": step * tokens_per_step, "elapsed_s": elapsed,
        "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
        "synced": sync is not None, "sync_seconds": sync.seconds if sync else 0.0,
        **bytes_so_far,
    }
    if sync is not None:
        if sync.variance is not None:  # agreed at once (the last sync, elastic mode, DBench metrics)
            record.update(param_variance=sync.variance, param_rms=sync.param_rms)
        if sync.carried is not None:  # the previous sync's, carried by this one's vote
            c = sync.carried
            record.update(prev_sync_step=c.step, prev_sync_param_variance=c.variance, prev_sync_param_rms=c.param_rms)
        record.update(sync_telemetry(sync, interval_seconds))
        if sync.sick_groups:
            record["sick_groups"] = list(sync.sick_groups)
        if sync.fragments:
            record["fragments"] = list(sync.fragments)
        if sync.consensus is not None:
            c = sync.consensus
            record.update(graph=sync.graph, consensus_distance=c.distance, consensus_relative=c.relative,
                          group_norms=c.group_norms, group_bytes=c.group_bytes)
    return record


def vote_figures(vote: Vote) -> tuple[float, float, dict]:
    """(mean loss, mean gradient norm, the per-group fields) of the groups that reported."""
    losses = [v for v in vote.losses if v is not None]
    norms = [v for v in vote.grad_norms if v is not None]
    mean = lambda values: sum(values) / len(values) if values else float("nan")  # noqa: E731
    fields = {"group_losses": vote.losses, "group_grad_norms": vote.grad_norms,
              "loss_spread": (max(losses) - min(losses)) if losses else float("nan")}
    if any(t is not None for t in vote.tokens):  # per-group step counts: what weighted this average (sum 1)
        senders = [g for g in range(len(vote.tokens)) if g not in vote.sick and g not in vote.joining]
        fields.update(group_tokens=vote.tokens, group_step_seconds=vote.step_seconds,
                      group_weights=[(token_weight(vote.tokens, senders, g) or 1.0) / len(senders)
                                     if g in senders else 0.0 for g in range(len(vote.tokens))])
    return mean(losses), mean(norms), fields


def sync_telemetry(sync: SyncResult, interval_seconds: Optional[float]) -> dict:
    """Per tier, the bytes/s this rank's exchange achieved on the wire (its bytes over the time the
    exchange took, in the background for an overlapped sync), and the fraction of the record's wall
    time that training waited on the sync."""
    out = {"sync_exchange_seconds": sync.exchange_seconds}
    for tier, nbytes in sorted(sync.wire_bytes_by_tier.items()):
        if nbytes and sync.exchange_seconds > 0:
            out[f"sync_{tier.replace('-', '_')}_bytes_per_s"] = nbytes / sync.exchange_seconds
    if interval_seconds:
        out["sync_wait_fraction"] = min(1.0, sync.seconds / interval_seconds)
    return out
