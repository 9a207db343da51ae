"""Cost model: predicted time per step and per sync of FSDP, HSDP, FL+FSDP and FL+HSDP on a two-tier
cluster, from the byte counts of `fl_megatron.costs`, link speeds per tier, the collective algorithm
that runs, and the compute time per step. Pure Python: used by --dry-run and tools/cost_model.py."""

from .network import Cluster, CollectiveTime, collective_time, ring_edges, wire_op
from .report import prediction_row, table_text
from .timing import Prediction, Variant, Workload, predict
from .variants import baseline_variants, comparison_variants, federated_variants
from .workload import parameter_counts, workload_for

__all__ = ["Cluster", "CollectiveTime", "Prediction", "Variant", "Workload", "baseline_variants",
           "collective_time", "comparison_variants", "federated_variants", "parameter_counts", "predict",
           "prediction_row", "ring_edges", "table_text", "wire_op", "workload_for"]
