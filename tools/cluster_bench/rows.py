"""The rows of the two-tier benchmark: which system, backend and layout each one runs."""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Row:
    """One run of the benchmark. group_size/shard_size are ranks (None: all ranks / the group);
    sync_interval 0 means no averaging; system is "fl-megatron" or "torchft-localsgd"/"-diloco";
    fault: an FL_MEGATRON_FAULT the row adds (`lockstep`: the loop coupled every step, as before)."""

    key: str
    label: str
    group_size: int
    shard_size: int | None = None
    sync_interval: int = 0
    replica_split: bool = True
    backend: str = "fsdp2"
    system: str = "fl-megatron"
    extra: tuple = field(default_factory=tuple)
    fault: str = ""

    @property
    def is_peer(self) -> bool:
        return self.system != "fl-megatron"

    def layout_flags(self) -> list[str]:
        """The layout, averaging and backend of this row as pretrain flags."""
        out = ["--fl-group-size", str(self.group_size), "--fl-sync-interval", str(self.sync_interval),
               "--backend", self.backend, "--fl-replica-split" if self.replica_split else "--no-fl-replica-split"]
        return out + (["--fl-hsdp-shard-size", str(self.shard_size)] if self.shard_size else [])

    def flags(self) -> list[str]:
        """Flags of this row on top of the benchmark's common flags (peers add their algorithm)."""
        return self.layout_flags() + list(self.extra)


SPARSE = ("--fl-sync-dtype", "int2", "--fl-topk-density", "0.0156", "--fl-error-feedback")


def all_rows(nodes: int, ranks_per_node: int, sync_interval: int) -> list[Row]:
    """Every row that the cluster shape allows, baselines first."""
    world, rpn, h = nodes * ranks_per_node, ranks_per_node, sync_interval
    rows = [Row("fsdp", f"FSDP over {world}", world)]
    if nodes > 1 and rpn > 1:
        rows.append(Row("hsdp", f"HSDP {nodes}x{rpn} (shard in node)", world, rpn))
    rows.append(Row("fl-fsdp", f"FL+FSDP {nodes} groups of {rpn}", rpn, None, h))
    rows.append(Row("fl-fsdp-lockstep", "FL+FSDP, a world all-reduce every step (before)", rpn, None, h,
                    fault="lockstep"))
    int8 = ("--fl-sync-dtype", "int8", "--fl-error-feedback")
    rows.append(Row("fl-fsdp-bf16", "FL+FSDP, bf16 sync", rpn, None, h, extra=("--fl-sync-dtype", "bf16")))
    rows.append(Row("fl-fsdp-int8", "FL+FSDP, int8 sync + EF", rpn, None, h, extra=int8))
    rows.append(Row("fl-fsdp-int8-overlap", "FL+FSDP, int8 + EF, overlap 1", rpn, None, h,
                    extra=(*int8, "--fl-overlap-steps", "1")))
    int4 = ("--fl-sync-dtype", "int4", "--fl-error-feedback")
    rows.append(Row("fl-fsdp-int4", "FL+FSDP, int4 sync + EF", rpn, None, h, extra=int4))
    rows.append(Row("fl-fsdp-int4-overlap", "FL+FSDP, int4 + EF, overlap 1", rpn, None, h,
                    extra=(*int4, "--fl-overlap-steps", "1")))
    if h % 2 == 0 and h >= 4:  # Streaming DiLoCo's schedule: half the shards every H/2 steps
        rows.append(Row("fl-fsdp-int4-frag2-overlap", "FL+FSDP, int4 + EF, 2 fragments, overlap 1", rpn, None, h,
                        extra=(*int4, "--fl-fragments", "2", "--fl-overlap-steps", "1")))
        # the sparse sync (SparseLoCo's 64 of every 4,096 at 2 bits), on the same schedule
        rows.append(Row("fl-fsdp-sparse-frag2-overlap", "FL+FSDP, int2 top 0.0156 + EF, 2 fragments, overlap 1",
                        rpn, None, h, extra=(*SPARSE, "--fl-fragments", "2", "--fl-overlap-steps", "1")))
    if h % 4 == 0 and h >= 8:  # the most fragments --fl-tune allows by default (--fl-tune-max-fragments 4)
        rows.append(Row("fl-fsdp-int4-frag4-overlap", "FL+FSDP, int4 + EF, 4 fragments, overlap 1", rpn, None, h,
                        extra=(*int4, "--fl-fragments", "4", "--fl-overlap-steps", "1")))
    rows.append(Row("fl-fsdp-tune", "FL+FSDP, --fl-tune (int4 allowed)", rpn, None, h,
                    extra=("--fl-tune", "--fl-tune-lowest-precision", "int4")))
    if nodes >= 4 and rpn > 1 and nodes % 2 == 0:  # groups of two nodes: P = 2 replicas of a node's shard
        g = 2 * rpn
        rows.append(Row("fl-hsdp-naive", f"FL+HSDP {world // g}x(2x{rpn}) naive", g, rpn, h, replica_split=False))
        rows.append(Row("fl-hsdp-split", f"FL+HSDP {world // g}x(2x{rpn}) split", g, rpn, h))
    rows.append(Row("torchft-localsgd", "torchft LocalSGD (FSDP2 in node)", rpn, None, h, system="torchft-localsgd",
                    extra=("--algorithm", "localsgd")))
    rows.append(Row("torchft-diloco", "torchft DiLoCo (FSDP2 in node)", rpn, None, h, system="torchft-diloco",
                    extra=("--algorithm", "diloco")))
    rows.append(Row("zero3", f"DeepSpeed ZeRO-3 over {world}", world, backend="deepspeed"))
    rows.append(Row("fl-zero3", f"FL+ZeRO-3 {nodes} groups of {rpn}", rpn, None, h, backend="deepspeed"))
    return rows


def select_rows(rows: list[Row], keys: list[str] | None) -> list[Row]:
    """The rows named in `keys` (all when None); unknown names are an error listing the valid ones."""
    if not keys:
        return rows
    known = {r.key: r for r in rows}
    unknown = [k for k in keys if k not in known]
    if unknown:
        raise ValueError(f"unknown or inapplicable row(s) {', '.join(unknown)} for this cluster; "
                         f"valid: {', '.join(known)}")
    return [known[k] for k in keys]
