"""Parallel layout and federation settings."""

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from ..costs import SPARSE_VALUE_BITS, in_flight_shards, sync_state_shards, wire_bytes_per_element
from ..graph_fit import ADA_LEVELS, TOPOLOGIES
from .sync_mode import PRECISIONS, SyncMode

BACKENDS = ("fsdp2", "deepspeed", "megatron")
OUTER_OPTIMIZERS = ("fedavg", "nesterov", "adam")
SYNC_DTYPES = ("fp32", "bf16", "int8", "int4", "int2")  # int2: the sparse sync's values only
INNER_STATE_POLICIES = ("keep", "average", "reset")
MAX_FRAGMENTS = 1024  # far more than Streaming DiLoCo's schedules; far fewer than any rank's shard elements

SPARSE_DECAY = 0.95  # the error feedback's decay with --fl-topk-density (SparseLoCo's)
# the outer learning rate when --fl-outer-lr is not given (nesterov: DiLoCo's 0.7)
DEFAULT_OUTER_LR = {"fedavg": 1.0, "nesterov": 0.7, "adam": 1e-3}


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
    group_sizes: str = field(
        default="", metadata={"help": "groups of unequal size: ranks per group, comma-separated in rank order "
                                      "(e.g. 8,4: a site of 8 GPUs beside one of 4); replaces --fl-group-size and "
                                      "--fl-num-groups; in elastic mode every group's job gives the same list "
                                      "(docs/heterogeneous.md)"})
    hsdp_shard_sizes: str = field(
        default="", metadata={"help": "with --fl-group-sizes: each group's HSDP shard size, comma-separated "
                                      "(default: each group's size, FSDP inside every group)"})
    group_ranks_per_node: str = field(
        default="", metadata={"help": "with --fl-group-sizes, where the sites' nodes differ: each group's ranks "
                                      "(GPUs) per node, comma-separated (e.g. 8,4); every group then covers whole "
                                      "nodes of its own (default: --ranks-per-node for every group)"})
    group_intervals: str = field(
        default="", metadata={"help": "pin each group's optimizer steps per round, comma-separated in group order "
                                      "(e.g. 8,4: a group twice as slow takes half the steps); the average is "
                                      "weighted by the tokens each group trained and the learning rate follows the "
                                      "federation's tokens (docs/heterogeneous.md, 'Groups of unequal speed')"})
    balance_steps: bool = field(
        default=False, metadata={"help": "plan each group's steps per round from its measured step time: the "
                                         "fastest takes --fl-sync-interval, the others what fits in that time; "
                                         "token-weighted average, learning rate on the federation's tokens"})
    replica_split: bool = field(
        default=True, metadata={"help": "FL+HSDP: each replica averages 1/P of the shard across groups, then "
                                        "the replicas all-gather (P times less inter-group traffic); "
                                        "--no-fl-replica-split gives the naive average"})
    bucket_mb: float = field(
        default=32.0, metadata={"help": "size of the buckets that pack small shards into one collective (MiB)"})
    disable_sync: bool = field(
        default=False, metadata={"help": "never average the groups (independent groups; same as H = 0)"})
    outer_optimizer: str = field(
        default="fedavg", metadata={"help": "what a sync does with the averaged pseudo-gradient (round-start anchor "
                                            "minus local shard): fedavg (anchor - lr * it; lr 1 is the plain "
                                            "average), nesterov (DiLoCo's outer SGD with Nesterov momentum) or adam"})
    outer_lr: Optional[float] = field(
        default=None, metadata={"help": "outer learning rate (default: fedavg 1.0, nesterov 0.7, adam 0.001)"})
    outer_momentum: float = field(
        default=0.9, metadata={"help": "outer Nesterov momentum (nesterov) or Adam beta1 (adam)"})
    inner_state: str = field(
        default="keep", metadata={"help": "the inner optimizer's state at a sync: keep each group's (the published "
                                          "method), average it across groups too (fp32, twice the bytes for Adam), "
                                          "or reset it"})
    sync_dtype: str = field(
        default="fp32", metadata={"help": "what crosses groups at a sync: fp32 (exact), bf16, or int8 / int4 with "
                                          "one fp32 scale per block of 256 (summed in fp32 either way; int4 "
                                          "wants --fl-error-feedback)"})
    topk_density: float = field(
        default=0.0, metadata={"help": "sparse sync: of every 4,096 elements of the pseudo-gradient (plus its "
                                       "error-feedback residual) send only the largest magnitudes, this fraction "
                                       "of them (0.0156: SparseLoCo's 64 of 4,096), the values in --fl-sync-dtype "
                                       "int2, int4, int8 or bf16 (one fp32 scale per chunk), their places in 12 "
                                       "bits; needs --fl-error-feedback; 0: dense"})
    error_feedback_decay: Optional[float] = field(
        default=None, metadata={"help": "error feedback: the residual is multiplied by this before the next sync adds "
                                        "it (default: 0.95 with --fl-topk-density, as SparseLoCo; 1 otherwise)"})
    overlap_steps: int = field(
        default=0, metadata={"help": "start each sync in the background and keep training this many steps while it "
                                     "travels (K < H), then merge: the new anchor plus each group's own progress "
                                     "since the sync started (two more fp32 shards while in flight); the last "
                                     "sync is blocking"})
    fragments: int = field(
        default=1, metadata={"help": "cut each rank's shards into N fragments and sync one of them every H/N steps, "
                                     "in turn (Streaming DiLoCo): each fragment still syncs every H steps, the "
                                     "bytes spread over N syncs of 1/N; N divides H; the last sync and a sick "
                                     "group's reset cover every fragment"})
    link_probe: bool = field(
        default=True, metadata={"help": "at start-up, time a few collectives over the peer group and a group inside "
                                        "the federation group (a few MB, about a second): the links' bandwidth and "
                                        "latency as the run sees them, printed as --dry-run flags and kept in "
                                        "config.json (federated runs; not in elastic mode)"})
    tune: bool = field(
        default=False, metadata={"help": "pick the sync precision, overlap, fragments and H from the probed links and "
                                         "the measured step time with the cost model, at the first sync and again "
                                         "when the measured syncs leave its prediction (--fl-tune-*: the bounds; "
                                         "docs/sync-modes.md, 'Let it choose')"})
    tune_lowest_precision: str = field(
        default="int8", metadata={"help": "--fl-tune: the lowest sync precision it may pick (fp32, bf16, int8, int4; "
                                          "int8 and int4 always with error feedback)"})
    tune_topk_density: float = field(
        default=0.0, metadata={"help": "--fl-tune: also weigh the sparse sync at this density, int2 values with "
                                       "error feedback (0: never; at 0.0156 it sends about 141x less than fp32, "
                                       "and its quality at your model size is yours to check: docs/sync-modes.md)"})
    tune_max_sync_interval: Optional[int] = field(
        default=None, metadata={"help": "--fl-tune: the largest H it may pick (default: --fl-sync-interval, "
                                        "unchanged); it tries H, its doublings and this value"})
    tune_overlap: bool = field(
        default=True, metadata={"help": "--fl-tune: whether it may overlap a sync with the next step (two more fp32 "
                                        "shard buffers while in flight)"})
    tune_max_fragments: int = field(
        default=4, metadata={"help": "--fl-tune: the most fragments it may cut the shards into (1, 2, 4, ... "
                                     "dividing H)"})
    tune_every: int = field(
        default=8, metadata={"help": "--fl-tune: compare the measured sync time with the prediction every this many "
                                     "syncs, and choose again when the links changed (0: choose once)"})
    tune_threshold: float = field(
        default=0.5, metadata={"help": "--fl-tune: choose again when the measured sync time is more than 1 + this "
                                       "times the prediction, or less than 1 / (1 + this) times it"})
    tune_tolerance: float = field(
        default=0.03, metadata={"help": "--fl-tune: prefer the most exact mode predicted within this fraction of "
                                        "the fastest (a smaller H, a finer precision, no overlap, fewer fragments)"})
    sick_loss_ratio: float = field(
        default=0.0, metadata={"help": "at a sync, also leave out (and reset to the others' average) a group whose "
                                       "loss exceeds this many times the best group's; 0 disables (groups with "
                                       "NaN/Inf shards are always left out)"})
    topology: str = field(
        default="complete", metadata={"help": "which groups exchange shards at a sync: complete (FedAvg, the "
                                              "all-reduce), ring, torus, exponential, one-peer-exponential (gossip: "
                                              "each group mixes with its neighbours, fp32) or ada (a graph chosen "
                                              "at each sync from the measured consensus distance); the last sync "
                                              "is always a full average"})
    global_average_interval: int = field(
        default=0, metadata={"help": "gossip topologies: make every M-th sync a full average (0: never)"})
    ada_graphs: str = field(
        default="none,one-peer-exponential,complete",
        metadata={"help": "ada: the graphs it moves between, sparse to dense, comma-separated (none: no exchange)"})
    ada_low: float = field(
        default=1.5, metadata={"help": "ada: go one graph sparser when the relative consensus distance is below "
                                       "this many times the drift reference (its value one interval after a full "
                                       "average)"})
    ada_high: float = field(
        default=3.0, metadata={"help": "ada: go one graph denser when it is above this many times the reference"})
    ada_hold: int = field(
        default=1, metadata={"help": "ada: syncs to stay on a graph after a change before the next change"})
    ada_warmup: int = field(
        default=2, metadata={"help": "ada: syncs on the densest graph first (the early phase matters most)"})
    dbench_metrics: bool = field(
        default=False, metadata={"help": "measure DBench metrics before every sync: consensus distance overall and "
                                         "per tensor, each group's parameter norm and bytes sent (always on for "
                                         "gossip topologies; one all-reduce of a fp64 sample, --fl-consensus-samples)"})
    consensus_samples: int = field(
        default=65536, metadata={"help": "DBench metrics: shard elements per rank sampled for the consensus distance "
                                         "(contiguous blocks at the same places on every peer); 0 takes every "
                                         "element: exact, but the sample then moves the whole shard in fp64"})
    error_feedback: bool = field(
        default=False, metadata={"help": "bf16/int8/int4 sync: carry each rank's compression error into its next sync "
                                         "(one more fp32 shard per rank)"})
    elastic: bool = field(
        default=False, metadata={"help": "each federation group is its own job (its own torchrun, world and failure "
                                         "domain); the groups meet at syncs over torchft's quorum of the live groups "
                                         "(--fl-lighthouse), and a restarted or new group heals from them "
                                         "(docs/failures.md)"})
    lighthouse: Optional[str] = field(
        default=None, metadata={"help": "elastic: HOST:PORT of the torchft lighthouse every group reports to "
                                        "(default: the TORCHFT_LIGHTHOUSE environment variable)"})
    group_id: Optional[int] = field(
        default=None, metadata={"help": "elastic: this job's federation group slot, 0 .. --fl-num-groups - 1 "
                                        "(default: the FL_GROUP_ID environment variable)"})
    min_groups: int = field(
        default=1, metadata={"help": "elastic: live groups a sync needs; with fewer, the live ones wait up to "
                                     "--fl-quorum-timeout-minutes, then save (--save) and stop with exit code 5 "
                                     "naming the missing groups (the lighthouse's --min_replicas)"})
    sync_digest: bool = field(
        default=False, metadata={"help": "elastic: record a SHA-256 of each rank's shards, inner optimizer state "
                                         "and sync state after every sync in the group's metrics.jsonl (after an fp32 "
                                         "average the groups' shards agree bit for bit; one host read of them per sync)"})
    quorum_timeout_minutes: float = field(
        default=30.0, metadata={"help": "elastic: how long a sync waits for its quorum of live groups (a "
                                        "restarted group also waits this long for the live groups' next sync)"})
    start_wait_seconds: float = field(
        default=120.0, metadata={"help": "elastic: at a fresh federation's start (the lighthouse has formed no quorum "
                                         "yet, or no other group heartbeats), how long a group waits for every group "
                                         "slot to heartbeat before the first meeting, so that a group a few seconds "
                                         "late is in it instead of healing into the run H steps later (0: meet at "
                                         "once). Below --distributed-timeout-minutes"})
    peer_timeout_seconds: float = field(
        default=120.0, metadata={"help": "elastic: how long one cross-group collective of a sync may take; past it "
                                         "the sync is voted down, the quorum's communicator aborted (NCCL) or timed "
                                         "out (gloo), and the live groups go on without the hung peer at the next "
                                         "sync (docs/failures.md). Must exceed the slowest chunk's exchange"})

    @property
    def mode(self) -> SyncMode:
        """The sync mode these settings start in (the engine owns the current one)."""
        return SyncMode(self.sync_dtype, self.overlap_steps, self.fragments, self.sync_interval, self.error_feedback,
                        self.topk_density)

    def with_mode(self, mode: SyncMode) -> "FederationConfig":
        """A copy of these settings in `mode` (this object is left as it is)."""
        return dataclasses.replace(self, **mode.fields())

    @property
    def resolved_outer_lr(self) -> float:
        return DEFAULT_OUTER_LR.get(self.outer_optimizer, 1.0) if self.outer_lr is None else self.outer_lr

    @property
    def plain_average(self) -> bool:
        """Whether a sync is today's exact FedAvg of fp32 shards (no anchor, no compression)."""
        return (self.outer_optimizer == "fedavg" and self.resolved_outer_lr == 1.0 and self.sync_dtype == "fp32"
                and self.overlap_steps == 0)

    @property
    def sync_bytes_per_element(self) -> float:
        """Bytes one shard element occupies on the inter-group wire (the cost model's count)."""
        return wire_bytes_per_element(self.sync_dtype, self.topk_density)

    @property
    def outer_state_shards(self) -> float:
        """fp32 shard-sized buffers a rank keeps for the sync (the cost model's count)."""
        return sync_state_shards(self.outer_optimizer, self.plain_average, self.error_feedback,
                                 bool(self.overlap_steps), self.fragments)

    @property
    def in_flight_shards(self) -> float:
        """fp32 shard-sized buffers of an overlapped sync in flight (the cost model's count)."""
        return in_flight_shards(bool(self.overlap_steps), self.fragments)

    @property
    def fragment_interval(self) -> int:
        """Steps between two syncs: H, or H/N with fragments."""
        return self.sync_interval // self.fragments

    @property
    def gossip(self) -> bool:
        """Whether syncs may mix with neighbour groups instead of averaging over all of them."""
        return self.topology != "complete"

    @property
    def measures_consensus(self) -> bool:
        return self.gossip or self.dbench_metrics

    @property
    def densest_graph(self) -> str:
        """The graph a sync uses at most: the topology, or Ada's densest (dry run and cost model)."""
        return self.ada_ladder[-1] if self.topology == "ada" else self.topology

    @property
    def ada_ladder(self) -> list[str]:
        return [g.strip() for g in self.ada_graphs.split(",") if g.strip()]

    @property
    def unequal_sizes(self) -> Optional[tuple[list[int], list[int], list[int]]]:
        """(group sizes, shard sizes, ranks per node of each group or []) from --fl-group-sizes,
        --fl-hsdp-shard-sizes and --fl-group-ranks-per-node; None when the groups are given by
        --fl-group-size or --fl-num-groups. ValueError on a malformed list."""
        if not self.group_sizes:
            for name in ("hsdp_shard_sizes", "group_ranks_per_node"):
                if getattr(self, name):
                    raise ValueError(f"{name} needs group_sizes (--fl-group-sizes)")
            return None
        sizes = _int_list("group_sizes", self.group_sizes)
        shards = _int_list("hsdp_shard_sizes", self.hsdp_shard_sizes) if self.hsdp_shard_sizes else list(sizes)
        nodes = _int_list("group_ranks_per_node", self.group_ranks_per_node) if self.group_ranks_per_node else []
        return sizes, shards, nodes

    def _group_sizes_list_error(self) -> Optional[str]:
        """Why --fl-group-sizes (and the lists beside it) cannot be read, or None."""
        try:
            _ = self.unequal_sizes
        except ValueError as e:
            return str(e)
        return None

    @property
    def group_slots(self) -> Optional[int]:
        """Elastic mode's group slots: one per --fl-group-sizes entry, else --fl-num-groups."""
        if self.group_sizes and self._group_sizes_list_error() is None:
            return len(self.unequal_sizes[0])
        return self.num_groups

    @property
    def pinned_intervals(self) -> list[int]:
        """--fl-group-intervals as counts (empty when not given). ValueError on a malformed list."""
        return _int_list("group_intervals", self.group_intervals) if self.group_intervals else []

    @property
    def per_group_steps(self) -> bool:
        """Whether groups take their own step counts per round (pinned or balanced)."""
        return bool(self.group_intervals) or self.balance_steps

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
        errors += self._group_sizes_errors()
        errors += self._per_group_steps_errors()
        if self.sync_interval < 0:
            errors.append(f"sync_interval={self.sync_interval} must be >= 0 (0 disables syncing)")
        if self.bucket_mb <= 0:
            errors.append(f"bucket_mb={self.bucket_mb} must be positive")
        if self.outer_optimizer not in OUTER_OPTIMIZERS:
            errors.append(f"outer_optimizer={self.outer_optimizer!r} is not one of {', '.join(OUTER_OPTIMIZERS)}")
        if self.outer_lr is not None and self.outer_lr <= 0:
            errors.append(f"outer_lr={self.outer_lr} must be positive")
        if not 0 <= self.outer_momentum < 1:
            errors.append(f"outer_momentum={self.outer_momentum} must lie in [0, 1)")
        if self.overlap_steps < 0:
            errors.append(f"overlap_steps={self.overlap_steps} must be >= 0")
        errors += self._fragment_errors()
        if self.sick_loss_ratio != 0 and self.sick_loss_ratio <= 1:
            errors.append(f"sick_loss_ratio={self.sick_loss_ratio} must be above 1 (or 0: off)")
        if self.inner_state not in INNER_STATE_POLICIES:
            errors.append(f"inner_state={self.inner_state!r} is not one of {', '.join(INNER_STATE_POLICIES)}")
        if self.sync_dtype not in SYNC_DTYPES:
            errors.append(f"sync_dtype={self.sync_dtype!r} is not one of {', '.join(SYNC_DTYPES)}")
        elif self.error_feedback and self.sync_dtype == "fp32":
            errors.append("error_feedback needs a compressed sync (sync_dtype bf16, int8 or int4): fp32 loses nothing")
        errors += self._sparse_errors()
        errors += self._gossip_errors()
        errors += self._elastic_errors()
        errors += self._tune_errors()
        if errors:
            raise ValueError("invalid federation settings: " + "; ".join(errors))

    def _sparse_errors(self) -> list[str]:
        """Problems of the sparse sync (--fl-topk-density) and of the error feedback's decay."""
        errors = []
        if self.error_feedback_decay is not None and not 0 < self.error_feedback_decay <= 1:
            errors.append(f"error_feedback_decay={self.error_feedback_decay} must lie in (0, 1]")
        if not self.topk_density:
            if self.sync_dtype == "int2":
                errors.append("sync_dtype int2 is the sparse sync's only: give --fl-topk-density (e.g. 0.0156)")
            return errors
        if not 0 < self.topk_density <= 0.5:
            errors.append(f"topk_density={self.topk_density} must lie in (0, 0.5] (above half, send dense int4)")
        if self.sync_dtype not in SPARSE_VALUE_BITS:
            errors.append(f"topk_density: the values go in sync_dtype {', '.join(SPARSE_VALUE_BITS)}, not "
                          f"{self.sync_dtype!r}")
        if not self.error_feedback:
            errors.append("topk_density needs error_feedback (--fl-error-feedback): what a sparse sync leaves out "
                          "must be carried into the next one, or it is lost")
        if self.group_sizes:
            errors.append("topk_density: groups of unequal size (--fl-group-sizes) average atom by atom, which the "
                          "sparse sync does not do yet; use equal groups or a dense sync")
        return errors

    @property
    def resolved_error_feedback_decay(self) -> float:
        """The residual's decay: --fl-error-feedback-decay, else 0.95 for the sparse sync, else 1."""
        if self.error_feedback_decay is not None:
            return self.error_feedback_decay
        return SPARSE_DECAY if self.topk_density else 1.0

    def _tune_errors(self) -> list[str]:
        """Problems of --fl-tune and its bounds."""
        errors = []
        if self.tune_lowest_precision not in PRECISIONS:
            errors.append(f"tune_lowest_precision={self.tune_lowest_precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.tune_max_sync_interval is not None and self.tune_max_sync_interval < max(self.sync_interval, 1):
            errors.append(f"tune_max_sync_interval={self.tune_max_sync_interval} must be at least "
                          f"sync_interval={self.sync_interval}")
        if self.tune_max_fragments < 1:
            errors.append(f"tune_max_fragments={self.tune_max_fragments} must be at least 1")
        if not 0 <= self.tune_topk_density <= 0.5:
            errors.append(f"tune_topk_density={self.tune_topk_density} must lie in [0, 0.5] (0: no sparse sync)")
        if self.tune_every < 0 or self.tune_threshold <= 0 or not 0 <= self.tune_tolerance < 1:
            errors.append(f"tune_every={self.tune_every} must be >= 0, tune_threshold={self.tune_threshold} positive "
                          f"and tune_tolerance={self.tune_tolerance} in [0, 1)")
        if not self.tune:
            return errors
        if not self.syncing:
            errors.append("tune picks how the groups sync: it needs sync_interval > 0 and syncing enabled")
        if self.elastic and self.tune_max_sync_interval not in (None, self.sync_interval):
            errors.append(f"tune_max_sync_interval={self.tune_max_sync_interval}: in elastic mode tune keeps "
                          f"sync_interval={self.sync_interval}, on which each group's checkpoints and exits and a "
                          "restarted group's heal are placed (leave --fl-tune-max-sync-interval out)")
        if self.topology != "complete":
            errors.append(f"tune picks among complete averages; topology={self.topology} mixes fp32 parameters "
                          "along a graph (leave out --fl-tune, or use topology complete)")
        if self.inner_state == "reset":
            errors.append("tune may pick fragments, which inner_state reset refuses; use keep or average")
        if not self.link_probe:
            errors.append("tune needs the start-up link probe (link_probe)")
        return errors

    def _group_sizes_errors(self) -> list[str]:
        """Problems of --fl-group-sizes and --fl-hsdp-shard-sizes on their own (the layout checks
        them against the world and its nodes)."""
        try:
            unequal = self.unequal_sizes
        except ValueError as e:
            return [str(e)]
        if unequal is None:
            return []
        errors = [f"group_sizes replaces {name}={getattr(self, name)}: give one of them"
                  for name in ("group_size", "num_groups", "hsdp_shard_size") if getattr(self, name) is not None]
        sizes, shards, nodes = unequal
        for name, values in (("hsdp_shard_sizes", shards), ("group_ranks_per_node", nodes or sizes)):
            if len(values) != len(sizes):
                errors.append(f"{name} has {len(values)} values for {len(sizes)} groups: give one per group")
        return errors

    def _per_group_steps_errors(self) -> list[str]:
        """What per-group step counts (--fl-group-intervals, --fl-balance-steps) cannot run with yet,
        each with the reason (the layout checks the count of intervals against the groups)."""
        try:
            pinned = self.pinned_intervals
        except ValueError as e:
            return [str(e)]
        if not self.per_group_steps:
            return []
        errors = []
        if pinned and self.balance_steps:
            errors.append("group_intervals pins each group's steps and balance_steps plans them: give one of them")
        for wrong, why in ((not self.syncing, "the groups must sync (sync_interval > 0, syncing enabled)"),
                           (self.overlap_steps > 0, f"overlap_steps={self.overlap_steps}: an overlapped sync "
                                                    "lands a fixed number of steps later, which differs per group"),
                           (self.fragments > 1, f"fragments={self.fragments}: the fragments' turns are counted in "
                                                "steps, which differ per group"),
                           (self.tune, "tune: it picks one H for every group"),
                           (self.gossip or self.dbench_metrics, f"topology {self.topology}"
                                                                f"{' with DBench metrics' if self.dbench_metrics else ''}: "
                                                                "the weighted average is a complete one")):
            if wrong:
                errors.append(f"per-group step counts (group_intervals, balance_steps) do not run with {why} yet")
        return errors

    def _elastic_errors(self) -> list[str]:
        """What elastic mode refuses, with the reason (docs/failures.md, "Elastic mode")."""
        if not self.elastic:
            return [f"{name}={getattr(self, name)!r} is for elastic mode (--fl-elastic)"
                    for name in ("lighthouse", "group_id") if getattr(self, name) is not None] + \
                (["sync_digest is for elastic mode (--fl-elastic), where each group writes its own records"]
                 if self.sync_digest else [])
        errors = []
        if self.min_groups < 1:
            errors.append(f"min_groups={self.min_groups} must be at least 1")
        if self.quorum_timeout_minutes <= 0:
            errors.append(f"quorum_timeout_minutes={self.quorum_timeout_minutes} must be positive")
        if self.start_wait_seconds < 0:
            errors.append(f"start_wait_seconds={self.start_wait_seconds} must be >= 0")
        if self.peer_timeout_seconds <= 0:
            errors.append(f"peer_timeout_seconds={self.peer_timeout_seconds} must be positive")
        if self.group_sizes:  # the slots are the groups listed (_group_sizes_errors checks the rest)
            slots = len(self.unequal_sizes[0]) if not self._group_sizes_list_error() else None
            if slots is not None and self.group_id is not None and not 0 <= self.group_id < slots:
                errors.append(f"group_id={self.group_id} is not a group of group_sizes={self.group_sizes!r} "
                              f"(0 .. {slots - 1})")
            elif slots is not None and self.min_groups > slots:
                errors.append(f"min_groups={self.min_groups} exceeds the {slots} groups of group_sizes")
        elif self.num_groups is None:
            errors.append("elastic mode needs num_groups (--fl-num-groups: the number of group slots; each job "
                          "is one group, so the launcher's world is one group)")
        elif self.group_id is not None and not 0 <= self.group_id < self.num_groups:
            errors.append(f"group_id={self.group_id} is not a slot of num_groups={self.num_groups} "
                          f"(0 .. {self.num_groups - 1})")
        elif self.min_groups > self.num_groups:
            errors.append(f"min_groups={self.min_groups} exceeds num_groups={self.num_groups}")
        if not self.syncing:
            errors.append("elastic mode syncs the groups: sync_interval must be > 0 and syncing enabled")
        if self.dbench_metrics:
            errors.append("elastic mode does not measure DBench metrics (dbench_metrics) yet: their table is reduced "
                          "across groups after the exchange, where a sync that may be voted down keeps to its group")
        if self.gossip:
            errors.append(f"elastic mode needs topology complete, not {self.topology}: after a gossip round the "
                          "groups differ, so the ranks of a healing group could heal from different states")
        return errors

    def _fragment_errors(self) -> list[str]:
        """Problems of --fl-fragments with the interval, the overlap and the other sync options."""
        if not 1 <= self.fragments <= MAX_FRAGMENTS:
            return [f"fragments={self.fragments} must lie in [1, {MAX_FRAGMENTS}]"]
        errors = []
        if self.syncing and self.sync_interval % self.fragments:
            errors.append(f"fragments={self.fragments} must divide sync_interval={self.sync_interval} (a fragment "
                          "syncs every H/N steps)")
        elif self.overlap_steps and self.syncing and self.overlap_steps >= self.fragment_interval:
            between = (f"sync_interval / fragments = {self.fragment_interval}" if self.fragments > 1
                       else f"sync_interval={self.sync_interval}")
            errors.append(f"overlap_steps={self.overlap_steps} must be smaller than {between} "
                          "(a sync lands before the next one starts)")
        if self.fragments > 1 and self.topology != "complete":
            errors.append(f"fragments={self.fragments} works with topology complete only (a gossip round mixes "
                          "whole shards)")
        if self.fragments > 1 and self.inner_state == "reset":
            errors.append(f"inner_state reset restarts every moment at every sync: with fragments={self.fragments} "
                          "that is N times per interval; use keep or average")
        return errors

    def _gossip_errors(self) -> list[str]:
        """Problems of the topology settings that do not depend on the number of groups."""
        if self.topology not in TOPOLOGIES:
            return [f"topology={self.topology!r} is not one of {', '.join(TOPOLOGIES)}"]
        errors = []
        if self.consensus_samples < 0:
            errors.append(f"consensus_samples={self.consensus_samples} must be >= 0 (0: every element)")
        if self.global_average_interval < 0:
            errors.append(f"global_average_interval={self.global_average_interval} must be >= 0 (0: never)")
        if self.gossip and not (self.outer_optimizer == "fedavg" and self.resolved_outer_lr == 1.0
                                and self.sync_dtype == "fp32" and self.overlap_steps == 0):
            errors.append(f"topology={self.topology} mixes fp32 parameters directly: it needs the plain average "
                          "(outer_optimizer fedavg with outer_lr 1, sync_dtype fp32, no overlap_steps); outer "
                          "optimizers, compression and overlap work with topology complete")
        if self.topology == "ada":
            unknown = [g for g in self.ada_ladder if g not in ADA_LEVELS]
            if unknown or len(self.ada_ladder) < 2:
                errors.append(f"ada_graphs={self.ada_graphs!r} must list at least two of {', '.join(ADA_LEVELS)}, "
                              f"sparse to dense" + (f" ({', '.join(unknown)} unknown)" if unknown else ""))
            if not 1 <= self.ada_low < self.ada_high:
                errors.append(f"ada_low={self.ada_low} and ada_high={self.ada_high} must satisfy 1 <= low < high "
                              "(a band around the drift of one interval)")
            if self.ada_hold < 1 or self.ada_warmup < 0:
                errors.append(f"ada_hold={self.ada_hold} must be >= 1 and ada_warmup={self.ada_warmup} >= 0")
        return errors


def _int_list(name: str, text: str) -> list[int]:
    """`text` as comma-separated positive integers; ValueError naming `name` otherwise."""
    values = []
    for piece in text.split(","):
        piece = piece.strip()
        if not piece.isdigit() or int(piece) < 1:
            raise ValueError(f"{name}={text!r} must be positive integers separated by commas (e.g. 8,4); "
                             f"{piece!r} is not one")
        values.append(int(piece))
    return values
