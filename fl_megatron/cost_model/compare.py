"""Predict a configured run beside its baselines (the text --dry-run and tools/cost_model.py print)."""

from typing import Optional

from ..config import ResolvedRun
from .network import Cluster
from .report import prediction_row, table_text, workload_text
from .timing import Workload, predict
from .variants import baseline_variants, federated_variants
from .workload import workload_for


def compare_rows(run: ResolvedRun, work: Optional[Workload] = None) -> list[dict]:
    """Prediction rows of FSDP and HSDP over all ranks and of the configured federated layout."""
    cfg, layout = run.cfg, run.layout
    work = work or workload_for(run)
    cluster = Cluster.from_config(cfg.cluster)
    h = cfg.federation.sync_interval if cfg.federation.syncing else 0
    variants = baseline_variants(layout.world_size, layout.ranks_per_node) + \
        federated_variants(layout, h, cfg.federation.overlap_steps, cfg.federation.densest_graph,
                                              cfg.federation.fragments)
    predictions = [predict(v, work, cluster, cfg.cluster.overlap) for v in variants]
    baselines = {p.variant.label: p for p in predictions[:2]}
    return [prediction_row(p, work.tokens_per_step, baselines) for p in predictions]


def compare_text(run: ResolvedRun, work: Optional[Workload] = None) -> str:
    """The rows as a table, with the cluster they assume."""
    c = run.cfg.cluster
    work = work or workload_for(run)
    rows = compare_rows(run, work)
    baselines = [r["variant"] for r in rows[:2]]
    source = ("given (--compute-seconds)" if c.compute_seconds is not None
              else f"from FLOPs at {c.mfu:.0%} of {c.peak_tflops:g} TFLOP/s")
    return "\n".join([
        f"  predicted time (cost model; {c.collective_library} rings, inter-node {c.inter_node_gbps:g} Gbit/s "
        f"per node, intra-node {c.intra_node_gbps:g} Gbit/s per rank, overlap {c.overlap:g}; compute "
        f"{work.compute_seconds:.3f} s per step {source}):",
        workload_text(run, work),
        table_text(rows, baselines)])
