"""Parallel layout and federation settings."""

from dataclasses import dataclass, field
from typing import Optional

BACKENDS = ("fsdp2", "deepspeed", "megatron")


@dataclass
class ParallelConfig:
    """Where the ranks are and which sharding backend trains inside a federation group."""

    backend: str = field(default="fsdp2", metadata={"help": "sharding backend inside a group: fsdp2 (PyTorch FSDP2), deepspeed "
                                                        "(ZeRO-3; default when --deepspeed_config is given) or "
                                                        "megatron (megatron-core's distributed optimizer)"})
    deepspeed_config: Optional[str] = field(
        default=None, metadata={"help": "DeepSpeed JSON config (ZeRO-3, bf16, optimizer, batch sizes, ...) with "
                                        "an optional 'federation' block; implies --backend deepspeed"})
    world_size: Optional[int] = field(
        default=None, metadata={"help": "number of ranks; taken from the launcher (WORLD_SIZE) "
                                        "unless --dry-run is planning a larger run"})
    ranks_per_node: Optional[int] = field(
        default=None, metadata={"help": "ranks (GPUs) per node; default: LOCAL_WORLD_SIZE from the "
                                        "launcher, else the world size up to 8"})
    distributed_timeout_minutes: float = field(
        default=10.0, metadata={"help": "timeout of every collective; a hung rank fails the job after it"})

    def validate(self) -> None:
        errors = []
        if self.backend not in BACKENDS:
            errors.append(f"backend={self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.world_size is not None and self.world_size < 1:
            errors.append(f"world_size={self.world_size} must be at least 1")
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            errors.append(f"ranks_per_node={self.ranks_per_node} must be at least 1")
        if self.distributed_timeout_minutes <= 0:
            errors.append(f"distributed_timeout_minutes={self.distributed_timeout_minutes} must be positive")
        if errors:
            raise ValueError("invalid parallel settings: " + "; ".join(errors))


@dataclass
class FederationConfig:
    """Federation groups and how (and how often) they are averaged."""

    group_size: Optional[int] = field(
        default=None, metadata={"help": "ranks per federation group G (default: the whole world, i.e. no federation)"})
    num_groups: Optional[int] = field(
        default=None, metadata={"help": "number of federation groups F = world / G (alternative to --fl-group-size)"})
    sync_interval: int = field(
        default=8, metadata={"help": "average the groups every H optimizer steps and at the end; 0 disables"})
    hsdp_shard_size: Optional[int] = field(
        default=None, metadata={"help": "HSDP shard size S inside a group (S divides G; default G = FSDP)"})
    replica_split: bool = field(
        default=True, metadata={"help": "FL+HSDP: each replica averages 1/P of the shard across groups, then "
                                        "the replicas all-gather (P times less inter-group traffic); "
                                        "--no-fl-replica-split gives the naive average"})
    bucket_mb: float = field(
        default=32.0, metadata={"help": "size of the buckets that pack small shards into one collective (MiB)"})
    disable_sync: bool = field(
        default=False, metadata={"help": "never average the groups (independent groups; same as H = 0)"})

    @property
    def syncing(self) -> bool:
        """Whether averaging happens at all (H > 0 and not disabled)."""
        return self.sync_interval > 0 and not self.disable_sync

    def validate(self) -> None:
        errors = []
        for name in ("group_size", "num_groups", "hsdp_shard_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                errors.append(f"{name}={value} must be at least 1")
        if self.sync_interval < 0:
            errors.append(f"sync_interval={self.sync_interval} must be >= 0 (0 disables syncing)")
        if self.bucket_mb <= 0:
            errors.append(f"bucket_mb={self.bucket_mb} must be positive")
        if errors:
            raise ValueError("invalid federation settings: " + "; ".join(errors))
