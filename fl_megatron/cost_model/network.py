"""Time and wire bytes of one ring collective on a two-tier cluster (pure Python).

A ring over a process group sends, from every rank to the next in group order, the rank's whole
per-rank volume (ring formulas in `fl_megatron.costs`). An edge between ranks on different nodes
crosses the node's network link; all groups of one kind run at once, so a node's link carries
every inter-node edge that leaves it, and the busiest node sets the time. Edges inside a node run
in parallel at the intra-node rate. Latency is paid once per ring step and per call.
"""

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from ..config.cluster import ClusterConfig
from ..costs import _GROUPS, Collective, ring_volume
from ..topology import Layout, node_of


@dataclass(frozen=True)
class Cluster:
    """Link speeds per tier (Gbit/s on the wire, per node and direction between nodes; per rank
    inside a node), ring-step latencies, header overhead and the collective library."""

    inter_node_gbps: float
    intra_node_gbps: float
    inter_node_latency_us: float = 0.0
    intra_node_latency_us: float = 0.0
    wire_overhead: float = 1.0
    library: str = "nccl"

    @classmethod
    def from_config(cls, c: ClusterConfig) -> "Cluster":
        return cls(c.inter_node_gbps, c.intra_node_gbps, c.inter_node_latency_us, c.intra_node_latency_us,
                   c.wire_overhead, c.collective_library)


@dataclass(frozen=True)
class CollectiveTime:
    """One collective on the cluster: seconds, and inter-node bytes on the wire summed over nodes."""

    collective: Collective
    seconds: float
    inter_node_wire_bytes: float
    busiest_node_edges: int


def wire_op(op: str, library: str) -> str:
    """The algorithm that actually runs: gloo reduce-scatters by all-reducing and keeping a slice."""
    return "all_reduce" if (op == "reduce_scatter" and library == "gloo") else op


def ring_edges(layout: Layout, group: str) -> tuple[Counter, bool]:
    """(inter-node ring edges leaving each node, summed over all groups of this kind; whether any
    ring edge stays inside a node). Rings follow each group's rank order."""
    leaving, local = _ring_edges(layout, group)
    return Counter(leaving), local


@lru_cache(maxsize=256)
def _ring_edges(layout: Layout, group: str) -> tuple[dict, bool]:
    """ring_edges, computed once per layout and group kind (a 512-rank layout has 512 edges per kind)."""
    leaving: Counter = Counter()
    local = False
    for ranks in _GROUPS[group](layout):
        if len(ranks) < 2:
            continue
        for a, b in zip(ranks, ranks[1:] + ranks[:1]):
            if node_of(layout, a) != node_of(layout, b):
                leaving[node_of(layout, a)] += 1
            else:
                local = True
    return dict(leaving), local


def collective_time(c: Collective, layout: Layout, cluster: Cluster) -> CollectiveTime:
    """Seconds of `c` (every group of its kind at once) and its inter-node wire bytes."""
    op = wire_op(c.op, cluster.library)
    # the per-rank volume of the algorithm that runs, from the payload the formula was given
    full = c.elements / ring_volume(c.op, 1.0, c.group_size)
    per_edge = ring_volume(op, full, c.group_size) * c.bytes_per_element
    leaving, local = ring_edges(layout, c.group)
    busiest = max(leaving.values(), default=0)
    inter_s = busiest * per_edge * cluster.wire_overhead * 8 / (cluster.inter_node_gbps * 1e9)
    intra_s = per_edge * 8 / (cluster.intra_node_gbps * 1e9) if local else 0.0
    ring_steps = 1 if op == "send" else (2 if op == "all_reduce" else 1) * (c.group_size - 1)
    latency_us = cluster.inter_node_latency_us if leaving else cluster.intra_node_latency_us
    seconds = max(inter_s, intra_s) + c.calls * ring_steps * latency_us * 1e-6
    wire = sum(leaving.values()) * per_edge * cluster.wire_overhead
    return CollectiveTime(c, seconds, wire, busiest)
