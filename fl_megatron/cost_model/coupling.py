"""What coupling the groups at every step would cost: the latency of a world all-reduce of a few
numbers, and the wait for the slowest group under per-step jitter (order statistics).

Between syncs the groups never meet, so a group's random stalls (a slow node, a GC pause, a
data stall) add up over the H steps of a sync interval and only the sum's maximum over the
groups is waited for at the sync; a loop that met the world after every step would wait for the
slowest group's stall at every step instead.
"""

import random
import statistics

from ..topology import Layout
from .network import Cluster


def world_all_reduce_seconds(layout: Layout, cluster: Cluster) -> float:
    """Latency of one ring all-reduce of a few numbers over every rank: 2 (N - 1) ring steps,
    each paying the inter-node latency when the job spans nodes (the intra-node one if not)."""
    spans = layout.world_size > layout.ranks_per_node
    latency_us = cluster.inter_node_latency_us if spans else cluster.intra_node_latency_us
    return 2 * (layout.world_size - 1) * latency_us * 1e-6


def jitter_wait_per_step(num_groups: int, interval: int, mean_s: float, coupled: bool,
                         samples: int = 20_000, seed: int = 0) -> float:
    """Expected extra seconds per step that the slowest group's stalls cost, each group stalling
    before every step for an exponential time of mean `mean_s` (independently): the mean over
    `samples` draws of max over groups of one step's stall (`coupled`: a meeting every step), or of
    the stalls summed over `interval` steps, divided by `interval` (meetings only at syncs)."""
    if mean_s <= 0:
        return 0.0
    rng = random.Random(seed)
    steps = 1 if coupled else interval
    draws = [max(sum(rng.expovariate(1 / mean_s) for _ in range(steps)) for _ in range(num_groups))
             for _ in range(samples)]
    return statistics.fmean(draws) / steps
