"""The published setup (Mittone and Aldinucci, Euro-Par 2026): Llama 3.1 8B on 128 nodes x 4 A100,
H = 8, its four layouts, with every assumption the prediction needs and where it comes from."""

from dataclasses import dataclass, replace

from ..config import ResolvedRun, RunConfig, resolve
from ..config.cluster import ClusterConfig
from ..models import get_preset
from ..topology import make_layout
from .network import Cluster
from .solve import solve_monotone
from .timing import Prediction, Variant, Workload, predict
from .workload import workload_for

PUBLISHED_SPEEDUP = 8.04  # "up to 8.04x faster data processing" (FL vs FSDP/HSDP, identical hyper-parameters)
WORLD, RANKS_PER_NODE, SYNC_INTERVAL = 512, 4, 8


@dataclass(frozen=True)
class Assumption:
    name: str
    value: str
    source: str


ASSUMPTIONS = (
    Assumption("model", "Llama 3.1 8B (our llama3.1-8b preset), bf16, AdamW", "the paper (docs/method.md)"),
    Assumption("batch", "micro-batch 2 per GPU, no accumulation", "the paper"),
    Assumption("sequence length", "8192 tokens", "ASSUMED: Llama 3.1's pre-training length; the notes do not give it"),
    Assumption("cluster", "128 nodes x 4 A100, InfiniBand between nodes, H = 8", "the paper"),
    Assumption("intra-node link", "200 GB/s per GPU (1600 Gbit/s), 2 us per ring step",
               "ASSUMED: NVLink 3 is 600 GB/s bidirectional per A100 (NVIDIA datasheet); NCCL rings "
               "reach roughly 200-230 GB/s of bus bandwidth on A100 nodes"),
    Assumption("inter-node link", "200 Gbit/s per node, 5 us per ring step",
               "ASSUMED: one HDR InfiniBand port (200 Gbit/s) per node; the notes do not name the fabric"),
    Assumption("collectives", "NCCL rings (reduce-scatter moves (G-1)/G of the data)",
               "NCCL; trees and NVLink SHARP are left out"),
    Assumption("compute", "312 TFLOP/s peak (A100 dense bf16) at 40 % MFU, 6N + 12*L*h*seq FLOPs per token",
               "peak: NVIDIA A100 datasheet; 40 %: ASSUMED, typical of well-tuned FSDP training"),
    Assumption("precision on the wire", "bf16 all-gathers, fp32 gradient reduce-scatter and fp32 syncs",
               "how our FSDP2 backend runs bf16 (MixedPrecisionPolicy reduce_dtype fp32)"),
    Assumption("overlap", "none: communication and compute add up", "ASSUMED (an upper bound on step time)"),
)

LEFT_OUT = (
    "stragglers and jitter: every step waits for the slowest rank",
    "fabric topology and congestion: the inter-node link is taken as full bisection at the per-node rate",
    "NCCL's algorithm choice: trees, NVLS and several channels per NIC change the latency terms",
    "overlap of FSDP prefetching with compute (the overlap setting models it as one fraction)",
    "memory pressure: at 8192 tokens and micro-batch 2 FSDP over 4 GPUs may not fit an A100 "
    "without activation recomputation, which adds a third to compute",
    "data loading, evaluation, checkpointing, kernel launch overheads and optimizer step time",
)


def published_run(seq_length: int = 8192) -> ResolvedRun:
    """The FSDP run of the paper as our configuration (the federated ones differ only in layout)."""
    cfg = RunConfig(model=get_preset("llama3.1-8b"), preset="llama3.1-8b")
    cfg.training.bf16, cfg.training.micro_batch_size, cfg.training.seq_length = True, 2, seq_length
    cfg.training.eval_iters = 0
    cfg.model.max_position_embeddings = max(cfg.model.max_position_embeddings, seq_length)
    cfg.parallel.ranks_per_node = RANKS_PER_NODE
    cfg.cluster = ClusterConfig(inter_node_gbps=200.0, intra_node_gbps=1600.0, inter_node_latency_us=5.0,
                                intra_node_latency_us=2.0, peak_tflops=312.0, mfu=0.4)
    return resolve(cfg, WORLD, RANKS_PER_NODE)


def published_variants() -> list[Variant]:
    """The four published layouts; FL+HSDP as the reference code runs it (naive) and with replica split."""
    lay = lambda g=None, s=None: make_layout(WORLD, RANKS_PER_NODE, g, shard_size=s)  # noqa: E731
    return [Variant("FSDP", lay()), Variant("HSDP", lay(s=4)),
            Variant("FL+FSDP", lay(4), SYNC_INTERVAL),
            Variant("FL+HSDP naive", lay(32, 4), SYNC_INTERVAL, replica_split=False),
            Variant("FL+HSDP split", lay(32, 4), SYNC_INTERVAL, replica_split=True)]


def predictions(work: Workload, cluster: Cluster, overlap: float = 0.0) -> dict[str, Prediction]:
    return {v.label: predict(v, work, cluster, overlap) for v in published_variants()}


def best_speedup(work: Workload, cluster: Cluster, overlap: float = 0.0) -> tuple[str, float]:
    """The largest predicted speed-up of a federated layout over its baseline (FL+FSDP over FSDP,
    FL+HSDP over HSDP), as the paper's "up to"."""
    p = predictions(work, cluster, overlap)
    pairs = {"FL+FSDP vs FSDP": ("FL+FSDP", "FSDP"), "FL+HSDP naive vs HSDP": ("FL+HSDP naive", "HSDP"),
             "FL+HSDP split vs HSDP": ("FL+HSDP split", "HSDP")}
    ratios = {name: p[base].mean_step_seconds / p[fl].mean_step_seconds for name, (fl, base) in pairs.items()}
    name = max(ratios, key=ratios.get)
    return name, ratios[name]


def implied_values(work: Workload, cluster: Cluster, target: float = PUBLISHED_SPEEDUP) -> dict:
    """For each assumption that could carry the result, the value at which the best predicted speed-up
    equals `target` with everything else as assumed, or None and the speed-up at the knob's extreme
    ("limit": zero bandwidth, zero compute, 1 s of latency per ring step)."""
    knobs = {
        "inter_node_gbps": (lambda g: best_speedup(work, replace(cluster, inter_node_gbps=g))[1], 1e-4, 1e5, 1e-4),
        "compute_seconds": (lambda c: best_speedup(replace(work, compute_seconds=c), cluster)[1], 1e-6, 1e4, 0.0),
        "inter_node_latency_us": (lambda a: best_speedup(work, replace(cluster, inter_node_latency_us=a))[1],
                                  1e-3, 1e6, 1e6),
    }
    out = {"target": target}
    for name, (f, low, high, extreme) in knobs.items():
        out[name] = {"value": solve_monotone(f, target, low, high), "limit": f(extreme)}
    return out


def published_workload(seq_length: int = 8192) -> tuple[ResolvedRun, Workload, Cluster]:
    run = published_run(seq_length)
    return run, workload_for(run), Cluster.from_config(run.cfg.cluster)
