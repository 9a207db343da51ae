"""The cluster a run is planned for: link speeds and compute rate (used only by the time prediction
of --dry-run and tools/cost_model.py; a real run measures instead)."""

from dataclasses import dataclass, field
from typing import Optional

COLLECTIVE_LIBRARIES = ("nccl", "gloo")


@dataclass
class ClusterConfig:
    """Link bandwidths and latencies per tier, the collective library and the compute rate, for the
    predicted time per step of --dry-run (defaults: an A100 node with NVLink and one 200 Gbit/s
    InfiniBand port; see docs/cost-model.md)."""

    inter_node_gbps: float = field(default=200.0, metadata={
        "help": "bandwidth between nodes, per node and direction, Gbit/s on the wire"})
    intra_node_gbps: float = field(default=1600.0, metadata={
        "help": "bandwidth of one rank's link inside a node, Gbit/s (NVLink ring bus bandwidth on GPUs)"})
    inter_node_latency_us: float = field(default=5.0, metadata={
        "help": "latency of one ring step between nodes, microseconds"})
    intra_node_latency_us: float = field(default=2.0, metadata={
        "help": "latency of one ring step inside a node, microseconds"})
    wire_overhead: float = field(default=1.0, metadata={
        "help": "bytes on the wire per payload byte (headers); TCP over Ethernet at MTU 1500 is 1514/1448"})
    collective_library: str = field(default="nccl", metadata={
        "help": "nccl or gloo: gloo's reduce-scatter is an all-reduce plus a slice (twice the bytes)"})
    peak_tflops: float = field(default=312.0, metadata={
        "help": "peak dense TFLOP/s of one rank in the compute dtype (A100 bf16: 312), for the dry run's "
                "estimates; a --fl-tune run times its own device instead"})
    mfu: float = field(default=0.4, metadata={
        "help": "model FLOPs utilisation assumed for the compute time (fraction of peak)"})
    compute_seconds: Optional[float] = field(default=None, metadata={
        "help": "compute time of one optimizer step per rank, seconds (default: from FLOPs, --peak-tflops "
                "and --mfu)"})
    device_memory_gib: float = field(default=80.0, metadata={
        "help": "memory of one accelerator, GiB: --dry-run warns when its per-rank estimate exceeds it "
                "(A100/H100 80 GB: 80, H200: 141)"})
    overlap: float = field(default=0.0, metadata={
        "help": "fraction of the in-group communication hidden behind compute, 0 to 1 (federation "
                "syncs are blocking)"})

    def validate(self) -> None:
        errors = []
        for name in ("inter_node_gbps", "intra_node_gbps", "peak_tflops", "device_memory_gib"):
            if not getattr(self, name) > 0:
                errors.append(f"{name}={getattr(self, name)} must be positive")
        for name in ("inter_node_latency_us", "intra_node_latency_us"):
            if getattr(self, name) < 0:
                errors.append(f"{name}={getattr(self, name)} must be >= 0")
        if self.wire_overhead < 1:
            errors.append(f"wire_overhead={self.wire_overhead} must be at least 1 (headers add bytes)")
        if self.collective_library not in COLLECTIVE_LIBRARIES:
            errors.append(f"collective_library={self.collective_library!r} is not one of "
                          f"{', '.join(COLLECTIVE_LIBRARIES)}")
        if not 0 < self.mfu <= 1:
            errors.append(f"mfu={self.mfu} must be in (0, 1]")
        if self.compute_seconds is not None and self.compute_seconds < 0:
            errors.append(f"compute_seconds={self.compute_seconds} must be >= 0")
        if not 0 <= self.overlap <= 1:
            errors.append(f"overlap={self.overlap} must be in [0, 1]")
        if errors:
            raise ValueError("cluster settings: " + "; ".join(errors))
