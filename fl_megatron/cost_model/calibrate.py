"""Link speeds from what a run measured, in the cost model's own terms (pure Python).

The probe's tiny all-reduce gives the latency of one ring step; its largest payload, with that
latency taken off, gives the bandwidth at which the cost model's own formula (`collective_time`:
the busiest node's ring edges for inter-node, one edge for intra-node) predicts the measured
time. A tier the run did not probe keeps the configured figure. `rescale_inter_node` corrects the
links later from measured syncs (--fl-tune's re-check).
"""

import dataclasses
from typing import Optional

from ..costs import INTER_GROUP, INTRA_GROUP, Collective, ring_volume
from ..topology import Layout
from .network import Cluster, collective_time

HUGE_GBPS = 1e12  # the other tier's speed while one tier is fitted: it then costs nothing


def _ring_steps(ranks: int) -> int:
    return 2 * (ranks - 1)


def fitted_speeds(layout: Layout, group: str, tier: str, ranks: int, small_s: float, payload_bytes: int,
                  payload_s: float, base: Cluster) -> tuple[float, float]:
    """(Gbit/s, latency in us) of `tier` at which the cost model predicts the measured all-reduces
    of the process groups of kind `group` ("peer", or "federation": every rank of a group)."""
    latency_us = small_s / _ring_steps(ranks) * 1e6
    elements = payload_bytes / 4
    kind = "peer" if group == "peer" else "shard"
    c = Collective("probe", "all_reduce", kind, ranks, INTER_GROUP if group == "peer" else INTRA_GROUP, tier,
                   ring_volume("all_reduce", elements, ranks), 4)
    fast_other = dict(inter_node_gbps=1.0, intra_node_gbps=HUGE_GBPS) if tier == "inter-node" else \
        dict(inter_node_gbps=HUGE_GBPS, intra_node_gbps=1.0)
    unit = dataclasses.replace(base, inter_node_latency_us=0.0, intra_node_latency_us=0.0, **fast_other)
    at_one_gbps = collective_time(c, layout if group == "peer" else _federation_as_shard(layout), unit).seconds
    transfer = max(payload_s - small_s, 1e-9)  # the latency of its ring steps is the tiny one's
    return at_one_gbps / transfer, latency_us


def _federation_as_shard(layout: Layout) -> Layout:
    """A layout whose shard groups are the federation groups (FL+HSDP probes the whole group)."""
    return dataclasses.replace(layout, shard_size=layout.group_size) if layout.is_hsdp else layout


def cluster_from_probe(layout: Layout, probe, base: Cluster) -> Cluster:
    """The cost model's cluster with the probed tiers' speeds (`probe`: a LinkProbe or its dict)."""
    timings = probe["timings"] if isinstance(probe, dict) else [dataclasses.asdict(t) for t in probe.timings]
    fitted = {}
    for t in timings:
        if t["ranks"] < 2 or not t["payload_bytes"] or t["tier"] in fitted:
            continue
        fitted[t["tier"]] = fitted_speeds(layout, t["group"], t["tier"], t["ranks"], t["small_seconds"],
                                          t["payload_bytes"], t["payload_seconds"], base)
    out = base
    if "inter-node" in fitted:
        gbps, lat = fitted["inter-node"]
        out = dataclasses.replace(out, inter_node_gbps=gbps, inter_node_latency_us=lat)
    if "intra-node" in fitted:
        gbps, lat = fitted["intra-node"]
        out = dataclasses.replace(out, intra_node_gbps=gbps, intra_node_latency_us=lat)
    return out


def rescale_tier(cluster: Cluster, tier: str, predicted_s: float, measured_s: float) -> Optional[Cluster]:
    """The cluster whose `tier` bandwidth makes a transfer predicted at `predicted_s` take
    `measured_s` (None when either is not positive)."""
    if predicted_s <= 0 or measured_s <= 0:
        return None
    name = "inter_node_gbps" if tier == "inter-node" else "intra_node_gbps"
    return dataclasses.replace(cluster, **{name: getattr(cluster, name) * predicted_s / measured_s})


def dry_run_flags(cluster: Cluster) -> str:
    """The flags that give --dry-run and tools/cost_model.py these link figures."""
    return (f"--inter-node-gbps {cluster.inter_node_gbps:.4g} --inter-node-latency-us {cluster.inter_node_latency_us:.4g} "
            f"--intra-node-gbps {cluster.intra_node_gbps:.4g} --intra-node-latency-us {cluster.intra_node_latency_us:.4g}")
