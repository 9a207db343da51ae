"""Where the federation groups meet: the collectives across groups a run makes, for --dry-run.

Between two syncs every collective stays inside one federation group (the sharded step, the
group's loss and gradient norm, stop requests of a single group). The groups meet at a sync
(its vote, its exchange, its metrics), at an evaluation, at a checkpoint and at the start and
the end of the run. tests/test_group_isolation.py records every collective of whole runs
and checks this.
"""

import math

from ..config import ResolvedRun
from ..cost_model.coupling import world_all_reduce_seconds
from ..cost_model.network import Cluster


def meeting_lines(run: ResolvedRun, num_params: int) -> list[str]:
    """The dry run's section on collectives that span federation groups."""
    cfg, layout = run.cfg, run.layout
    fed, t, c = cfg.federation, cfg.training, cfg.checkpoint
    if not layout.is_federated:
        return ["  collectives across federation groups: none (a single group)"]
    f = layout.num_groups
    watching = c.exit_signal_handler or c.exit_duration_in_mins is not None
    if not fed.syncing:
        lines = ["  collectives across federation groups: none between checkpoints (averaging disabled)"]
        if watching:
            lines.append("    stop requests  all-reduce of 2 numbers over the job after every step (independent "
                         "groups have no sync to agree at)")
        return lines + _occasional(t, c)
    interval = fed.fragment_interval
    # a rank's shard (over S ranks) of the fragment a sync moves, its replica's slice with the
    # HSDP replica split, cut into buckets of --fl-bucket-mb
    elements = num_params / layout.shard_size / fed.fragments / (layout.replicas if fed.replica_split else 1)
    buckets = max(1, math.ceil(elements * 4 / (fed.bucket_mb * (1 << 20))))
    if fed.gossip:
        exchange = f"about {buckets} batches of point-to-point sends to the graph's neighbours (peer group)"
    elif fed.topk_density:
        exchange = (f"about {buckets} all-gather(s) of every group's sparse payload (top {fed.topk_density:g} of "
                    f"each chunk, {fed.sync_dtype} values) over the peer group")
    elif fed.sync_dtype != "fp32":
        exchange = f"about {buckets} x (all-to-all + all-gather) of {fed.sync_dtype} buckets over the peer group"
    else:
        exchange = f"about {buckets} all-reduce(s) of {fed.sync_dtype} buckets over the peer group"
    lines = [f"  collectives across federation groups: none between syncs; per sync (every {interval} steps), "
             f"over the peer group ({f} ranks, one per group):",
             f"    vote           all-reduce (max) of {3 * f + 2} numbers: sick groups, each group's loss and "
             "gradient norm, stop requests",
             f"    exchange       {exchange}"]
    if fed.inner_state == "average":
        lines.append("    inner state    the same again for the optimizer's moments")
    lines.append("    metrics        all-reduce of 3 numbers (variance, rms)" if not fed.measures_consensus else
                 "    metrics        all-reduces of the consensus sample and of its per-tensor table, group bytes")
    if fed.overlap_steps:
        lines.append(f"    (overlapped: the exchange runs in the background and lands {fed.overlap_steps} "
                     "step(s) later, where the groups wait for it)")
    if watching:
        lines.append(f"    a SIGTERM or time limit is agreed at the next vote: the run stops at most {interval} "
                     "steps after it, right after that sync")
    coupled = world_all_reduce_seconds(layout, Cluster.from_config(cfg.cluster))
    lines.append(f"    (a loop meeting the whole job after every step would pay {coupled * 1e3:.2f} ms of latency per "
                 f"step here, {2 * (layout.world_size - 1)} ring steps, and wait for the slowest group every step)")
    return lines + _occasional(t, c)


def _occasional(t, c) -> list[str]:
    """Evaluations and checkpoints, where the groups meet too."""
    lines = []
    if t.eval_iters:
        when = f"every {t.eval_interval} steps and at the end" if t.eval_interval else "at the end"
        lines.append(f"    evaluation     all-reduce of 1 number over the job, {when}")
    if c.save:
        when = f"every {c.save_interval} steps, " if c.save_interval else ""
        lines.append(f"    checkpoint     3 barriers over the job, {when}at the end and at an early stop")
    return lines
