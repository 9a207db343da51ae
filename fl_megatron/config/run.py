"""The whole run's configuration: sections, cross-section checks, the resolved layout."""

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from ..graph_fit import topology_problem
from ..group_layout import GroupLayout, make_group_layout
from ..topology import Layout, make_layout
from .checkpoint import CheckpointConfig
from .cluster import ClusterConfig
from .data import DataConfig
from .deepspeed_json import train_batch_problem
from .finite import nonfinite_fields, nonfinite_in_json
from .model import ModelConfig
from .parallel import FederationConfig, ParallelConfig
from .training import TrainingConfig
from .unequal_groups import per_group_steps_problems, unequal_group_problems

SECTIONS = ("model", "parallel", "federation", "training", "data", "checkpoint", "cluster")


def layout_group_size(layout: Layout | GroupLayout) -> Optional[int]:
    """G of a layout of equal groups; None when the groups differ in size."""
    return None if isinstance(layout, GroupLayout) else layout.group_size


@dataclass
class RunConfig:
    """Everything one training run needs, grouped by section (the JSON config has the same sections)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    federation: FederationConfig = field(default_factory=FederationConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    preset: Optional[str] = None
    # The DeepSpeed config minus what became settings above (its 'federation' block); the
    # DeepSpeed backend passes it to the engine. None when no DeepSpeed config was given.
    deepspeed: Optional[dict] = None

    def to_dict(self) -> dict:
        """Plain-JSON form; loading it back gives the same configuration."""
        out = {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}
        out["model"]["preset"] = self.preset
        if self.deepspeed is not None:
            # inline, so that the file is self-contained
            out["parallel"]["deepspeed_config"] = None
            out["deepspeed"] = self.deepspeed
        return out

    def layout(self, world_size: int, local_world_size: Optional[int] = None) -> Layout | GroupLayout:
        """Resolve and validate the rank layout for `world_size` ranks: a `GroupLayout` for groups
        of unequal size (--fl-group-sizes), today's `Layout` when they are equal."""
        ranks_per_node = self.parallel.ranks_per_node or local_world_size
        unequal = self.federation.unequal_sizes
        if unequal is not None:
            sizes, shards, nodes = unequal
            if self.federation.elastic and not nodes:  # each group its own job: this job's node size for all
                nodes = [min(ranks_per_node or size, size) for size in sizes]
            if sum(sizes) != world_size:
                raise ValueError(f"group_sizes={self.federation.group_sizes!r} holds {sum(sizes)} ranks but the job "
                                 f"has {world_size}")
            layout = make_group_layout(sizes, ranks_per_node, shards, nodes)
            return layout.as_equal_layout() if layout.is_equal else layout
        return make_layout(world_size, ranks_per_node=ranks_per_node,
                           group_size=self.federation.group_size, num_groups=self.federation.num_groups,
                           shard_size=self.federation.hsdp_shard_size)

    def accumulation_steps(self, world_size: int, group_size: Optional[int] = None) -> int:
        """Micro-batches per optimizer step, from --global-batch-size or --gradient-accumulation-steps;
        without either, from a DeepSpeed JSON's train_batch_size as DeepSpeed derives it, the
        federation group (`group_size` ranks) being DeepSpeed's world."""
        t = self.training
        per_micro = t.micro_batch_size * world_size
        if t.global_batch_size is None:
            if t.gradient_accumulation_steps is None and group_size and "train_batch_size" in (self.deepspeed or {}):
                return self._deepspeed_accumulation(group_size)
            return t.gradient_accumulation_steps or 1
        if t.global_batch_size % per_micro:
            raise ValueError(
                f"global_batch_size={t.global_batch_size} is not a multiple of micro_batch_size "
                f"({t.micro_batch_size}) x world size ({world_size}) = {per_micro}; valid values are "
                f"{per_micro}, {2 * per_micro}, {3 * per_micro}, ...")
        steps = t.global_batch_size // per_micro
        if t.gradient_accumulation_steps is not None and t.gradient_accumulation_steps != steps:
            raise ValueError(
                f"global_batch_size={t.global_batch_size} means {steps} accumulation steps with "
                f"micro_batch_size={t.micro_batch_size} on {world_size} ranks, but "
                f"gradient_accumulation_steps={t.gradient_accumulation_steps} was given")
        return steps

    def _deepspeed_accumulation(self, group_size: int) -> int:
        """train_batch_size / (micro-batch x group size), as DeepSpeed fills in a missing
        gradient_accumulation_steps."""
        batch, micro = self.deepspeed["train_batch_size"], self.training.micro_batch_size
        per_step = micro * group_size
        if not isinstance(batch, int) or batch < per_step or batch % per_step:
            raise ValueError(f"DeepSpeed train_batch_size={batch!r} is not a multiple of micro-batch {micro} x "
                             f"group size {group_size} = {per_step}: without gradient_accumulation_steps it must "
                             f"be one (DeepSpeed derives the accumulation from it, the federation group being its "
                             f"world); valid values are {per_step}, {2 * per_step}, {3 * per_step}, ...")
        return batch // per_step

    def validate(self, world_size: int, local_world_size: Optional[int] = None) -> Layout:
        """Check every section and their combination for `world_size` ranks; return the layout."""
        nonfinite = nonfinite_fields({name: getattr(self, name) for name in SECTIONS})
        nonfinite += list(nonfinite_in_json(self.deepspeed or {}, "deepspeed"))
        if nonfinite:
            raise ValueError(f"not a finite number: {', '.join(nonfinite)} (every number in flags, --config "
                             "and the DeepSpeed JSON must be finite)")
        for name in SECTIONS:
            getattr(self, name).validate()
        layout = self.layout(world_size, local_world_size)
        if isinstance(layout, GroupLayout):
            problems = unequal_group_problems(self.parallel.backend, self.federation, self.checkpoint,
                                              self.deepspeed)
            if problems:
                raise ValueError(f"groups of unequal size ({self.federation.group_sizes}) cannot run this "
                                 "configuration yet: " + "; ".join(problems))
        problems = per_group_steps_problems(self.federation, layout.num_groups)
        if problems:
            raise ValueError("per-group step counts (--fl-group-intervals, --fl-balance-steps) cannot run this "
                             "configuration yet: " + "; ".join(problems))
        group_size = layout_group_size(layout)
        accumulation = self.accumulation_steps(world_size, group_size)
        if self.deepspeed is not None and self.parallel.backend != "deepspeed":
            raise ValueError(f"a DeepSpeed config was given but backend={self.parallel.backend!r}; "
                             "drop --backend or use --backend deepspeed")
        problem = train_batch_problem(self.deepspeed, self.training.micro_batch_size, accumulation, group_size)
        if problem:
            raise ValueError(problem)
        hpz = ((self.deepspeed or {}).get("zero_optimization") or {}).get("zero_hpz_partition_size", 1)
        shard_sizes = layout.shard_sizes if isinstance(layout, GroupLayout) else (layout.shard_size,)
        if not isinstance(hpz, int) or hpz < 1 or any(s % hpz for s in shard_sizes):
            raise ValueError(f"zero_optimization.zero_hpz_partition_size={hpz!r} must divide the ZeRO-3 "
                             f"group ({'/'.join(map(str, shard_sizes))} ranks: the federation group, or the HSDP "
                             "shard group), so that ZeRO++'s secondary copies stay inside it")
        t, m = self.training, self.model
        if self.checkpoint.async_save and self.parallel.backend != "fsdp2":
            raise ValueError(f"async_save writes with torch.distributed.checkpoint: it is for the fsdp2 backend, "
                             f"not {self.parallel.backend}")
        if self.parallel.backend == "deepspeed" and t.grad_reduce_dtype is not None:
            raise ValueError(f"grad_reduce_dtype={t.grad_reduce_dtype!r} is for the fsdp2 and megatron backends; "
                             "DeepSpeed reduces gradients in its communication_data_type (set it in its JSON)")
        if self.parallel.backend == "megatron" and m.megatron_problems():
            raise ValueError("--backend megatron cannot build this model: " + "; ".join(m.megatron_problems()))
        if t.seq_length > m.max_position_embeddings:
            raise ValueError(f"seq_length={t.seq_length} exceeds the model's max_position_embeddings="
                             f"{m.max_position_embeddings}")
        if self.data.source == "demo" and m.vocab_size < self.data.tokenizer_vocab_size:
            raise ValueError(f"vocab_size={m.vocab_size} is smaller than the tokenizer's "
                             f"tokenizer_vocab_size={self.data.tokenizer_vocab_size}: token ids would "
                             f"fall outside the embedding")
        fed = self.federation
        for name in [fed.topology] + (fed.ada_ladder if fed.topology == "ada" else []):
            problem = topology_problem(name, layout.num_groups) if name != "none" else None
            if problem and fed.syncing:
                raise ValueError(problem)
        if fed.elastic:
            self._check_elastic()
        return layout

    def _check_elastic(self) -> None:
        """What elastic mode does not do yet, named (the federation section checked the rest)."""
        problems = []
        if (self.deepspeed or {}).get("scheduler") is not None:
            problems.append("a DeepSpeed 'scheduler' block: its state does not travel to a healing group, which "
                            "would then train at another learning rate; drop the block (fl-megatron's own "
                            "schedule, from the flags, depends only on the step)")
        c, h = self.checkpoint, self.federation.sync_interval
        for name in ("save_interval", "exit_interval"):
            every = getattr(c, name)
            if c.save and every and every % h:
                problems.append(f"--{name.replace('_', '-')} {every}: elastic checkpoints are taken right after a "
                                f"sync, so it must be a multiple of --fl-sync-interval {h}")
        wait, timeout = self.federation.start_wait_seconds, self.parallel.distributed_timeout_minutes * 60
        if wait >= timeout:
            problems.append(f"--fl-start-wait-seconds {wait:g}: a group's other ranks wait for its first rank's wait "
                            f"in a collective, which --distributed-timeout-minutes "
                            f"{self.parallel.distributed_timeout_minutes:g} ({timeout:g} s) would end first")
        if c.save and c.ckpt_mode == "compact":
            problems.append("--ckpt-mode compact: each elastic group saves its own state in its own directory")
        if problems:
            raise ValueError("elastic mode (--fl-elastic) cannot run this configuration: " + "; ".join(problems))
