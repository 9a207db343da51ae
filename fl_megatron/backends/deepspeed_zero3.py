"""DeepSpeed ZeRO-3 inside each federation group; FL+HSDP as ZeRO-3 over the shard group with
the gradient partitions averaged across the group's replicas before each optimizer step.

ZeRO-3 keeps, per optimizer sub-group, one flat fp32 master partition
(`fp32_partitioned_groups_flat`) and one flat working partition in the compute dtype
(`fp16_partitioned_groups_flat`, of which every `param.ds_tensor` is a view). Parameters
smaller than `stage3_param_persistence_threshold` also stay gathered in full ("persistent").
The engine averages the fp32 masters in place (the optimizer state is keyed by those tensor
objects), then `refresh_after_sync` re-derives the working partitions and the persistent
parameters the way `step()` does.
"""

import logging
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from ..config.deepspeed_json import engine_config
from ..config.resolved import ResolvedRun
from ..federation.groups import ProcessGroups
from ..models import build_model
from ..torch_version import all_gather_flat
from .common import InitialValues, SavesInTheForeground, flat_elements, own_singleton_group, wrap_blocks_for_recompute
from .deepspeed_checks import within_group
from .deepspeed_layout import CHECKPOINT_TAG
from .pickle_guard import check_deepspeed_dir
from .optimizer import (build_optimizer, forget_state, has_state, load_transfer_state_tensors, parameter_groups,
                        set_learning_rate, split_transfer_state, state_tensors, step_at_zero_lr,
                        transfer_state_tensors)

MIN_VERSION = (0, 19, 8)


def _import_deepspeed():
    try:
        import deepspeed
    except ImportError as e:
        raise ImportError("the deepspeed backend needs DeepSpeed: pip install 'fl-megatron[deepspeed]' "
                          f"(or pip install deepspeed>=0.19.8) ({e})") from None
    version = tuple(int(x) for x in deepspeed.__version__.split("+")[0].split(".")[:3] if x.isdigit())
    if version < MIN_VERSION:
        raise ImportError(f"DeepSpeed {deepspeed.__version__} is too old; the deepspeed backend needs "
                          f">= {'.'.join(map(str, MIN_VERSION))}")
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)  # fl-megatron prints its own progress
    # DeepSpeed 0.19 calls collectives that torch 2.13 deprecates, once per call: not the user's concern
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")
    return deepspeed


def _skip_cpu_shm_build(deepspeed) -> None:
    """On CPU, DeepSpeed compiles a shared-memory all-reduce kernel (about a minute) when its
    communication layer starts; it serves only inference all-reduces, which training never
    calls, so mark it unavailable and let collectives go through torch.distributed."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        import deepspeed.ops as ops

        ops.__compatible_ops__["deepspeed_shm_comm"] = False


class GroupMpu:
    """What `deepspeed.initialize(mpu=...)` asks: ZeRO-3's data-parallel group is the given
    group (the federation group, or the HSDP shard group), and there is no model parallelism."""

    def __init__(self, data_parallel_group: dist.ProcessGroup, model_parallel_group: dist.ProcessGroup):
        self._dp, self._mp = data_parallel_group, model_parallel_group

    def get_data_parallel_group(self):
        return self._dp

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self._dp)

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self._dp)

    def get_model_parallel_group(self):
        return self._mp

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank


class DeepSpeedBackend(SavesInTheForeground):
    """A DeepSpeed engine (ZeRO stage 3) over this rank's shard group, initialised from the
    sharding-independent seeded weights; FL+HSDP adds a replica all-reduce of the gradients."""

    def __init__(self, run: ResolvedRun, groups: ProcessGroups, device: torch.device,
                 initial: InitialValues) -> None:
        deepspeed = _import_deepspeed()
        _skip_cpu_shm_build(deepspeed)
        # DeepSpeed's communication layer wraps the process group torch.distributed already has
        deepspeed.comm.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)
        cfg, layout, t = run.cfg, groups.layout, run.cfg.training
        self.groups, self.device = groups, device
        self.shard_group = groups.mesh.get_group("shard")
        self.replica_group = groups.replica if layout.is_hsdp else None
        mpu = GroupMpu(self.shard_group, own_singleton_group())
        ds_config = engine_config(cfg.deepspeed, t, layout.shard_size, t.train_iters, run.accumulation)
        client_optimizer = None
        if device.type == "cpu":
            ds_config["optimizer"]["params"].setdefault("torch_adam", True)  # no FusedAdam build on CPU
        if t.optimizer == "sgd":  # DeepSpeed has no built-in SGD: hand it torch's
            ds_config.pop("optimizer")
            ds_config["zero_allow_untested_optimizer"] = True
        self.ds_config = ds_config

        with deepspeed.zero.Init(data_parallel_group=self.shard_group, config_dict_or_path=ds_config, mpu=mpu):
            model = build_model(cfg.model, device=device)
        if t.recompute_activations:
            wrap_blocks_for_recompute(model)
        if t.optimizer == "sgd":
            client_optimizer = build_optimizer(model.named_parameters(), t)
            params = None
        else:
            params = parameter_groups(model.named_parameters(), t.weight_decay)
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=model, model_parameters=params, optimizer=client_optimizer, config=ds_config,
            mpu=mpu, dist_init_required=False)
        self.engine, self.optimizer, self.scheduler = engine, optimizer, scheduler
        self.model = engine.module
        self._check_internals()
        self._names = {id(p): name for name, p in self.model.named_parameters()}
        self._dp_rank = dist.get_rank(self.shard_group)
        self._dp_size = dist.get_world_size(self.shard_group)
        self._share_fp32_working_partitions()
        self._materialise(initial)

    def _check_internals(self) -> None:
        """Fail clearly if this DeepSpeed keeps its partitions somewhere else."""
        opt = self.optimizer
        missing = [a for a in ("fp16_groups", "fp16_partitioned_groups_flat", "fp32_partitioned_groups_flat",
                               "grad_partitions_flat_buffer", "persistent_parameters", "sub_group_to_group_id",
                               "_reassign_or_swap_out_partitioned_parameters", "invalidate_secondary_tensor")
                   if not hasattr(opt, a)]
        if missing:
            raise RuntimeError(f"DeepSpeed's ZeRO-3 optimizer ({type(opt).__name__}) lacks {', '.join(missing)}; "
                               "this DeepSpeed version is not supported by federated averaging")
        if any(flat is None for flat in opt.fp16_partitioned_groups_flat):
            raise RuntimeError("ZeRO-3 partitions are swapped out (NVMe offload): not supported")

    def _param_spans(self):
        """(sub-group, param, offset in the flat partition, partition size, valid elements) for
        every parameter: rank r of the shard group holds elements [r*size, (r+1)*size) of the
        flattened parameter; the tail past the parameter's end is padding."""
        opt = self.optimizer
        for i, params in enumerate(opt.fp16_groups):
            flat = opt.fp16_partitioned_groups_flat[i]
            for p in params:
                size = p.ds_tensor.ds_numel
                offset = (p.ds_tensor.data_ptr() - flat.data_ptr()) // flat.element_size()
                if not 0 <= offset <= flat.numel() - size:
                    raise RuntimeError(f"parameter {self._names.get(id(p))} is not inside its flat partition")
                valid = max(0, min(size, p.ds_numel - self._dp_rank * size))
                yield i, p, offset, size, valid

    @torch.no_grad()
    def _share_fp32_working_partitions(self) -> None:
        """In fp32 training DeepSpeed 0.19.8 keeps the working partition as a second copy of
        the fp32 master (on CPU at least). Make the working partition the master itself, as
        DeepSpeed does when it finds them alike: one copy less of the shard in memory, and the
        master-to-working copies after each step and each sync become no-ops (a tensor copied
        onto itself). The parameters' `ds_tensor` views are re-pointed into the master."""
        opt = self.optimizer
        for i, (working, master) in enumerate(zip(opt.fp16_partitioned_groups_flat, opt.fp32_partitioned_groups_flat)):
            if working.dtype != master.dtype or working.device != master.device or \
                    working.numel() != master.numel() or working.data_ptr() == master.data_ptr():
                continue
            master.copy_(working)
            opt.fp16_partitioned_groups_flat[i] = master
            opt._unflatten_partitioned_parameters(i)

    @torch.no_grad()
    def _materialise(self, initial: InitialValues) -> None:
        """Write each rank's piece of the initial weights into the fp32 masters, zero all
        padding (DeepSpeed leaves it uninitialised, and it differs between groups), then derive
        the working partitions and persistent parameters from the masters."""
        masters = self.optimizer.fp32_partitioned_groups_flat
        used = [torch.zeros(m.numel(), dtype=torch.bool) for m in masters]
        for i, p, offset, size, valid in self._param_spans():
            if not valid:
                continue
            values = flat_elements(initial, self._names[id(p)], tuple(p.ds_shape), self._dp_rank * size, valid)
            masters[i][offset:offset + valid].copy_(values)
            used[i][offset:offset + valid] = True
        for master, working, mask in zip(masters, self.optimizer.fp16_partitioned_groups_flat, used):
            master[~mask.to(master.device)] = 0
            working[~mask.to(working.device)] = 0
        self.refresh_after_sync()

    def atom_cut(self) -> tuple[str, list[tuple]]:
        """How `atom_shards` cut every parameter across a group, for groups of unequal size
        (atom_plan): ZeRO-3's flat rule (ceil(n / S) elements per rank, the tail padded) and each
        parameter's full shape, in the optimizer's order."""
        return "flat", [tuple(p.ds_shape) for _, p, *_ in self._param_spans()]

    def atom_shards(self) -> list[torch.Tensor]:
        """Every parameter's valid elements in this rank's fp32 master partition (views, possibly
        empty; the padding left out), in `atom_cut`'s order."""
        masters = self.optimizer.fp32_partitioned_groups_flat
        return [masters[i].narrow(0, offset, valid) for i, _, offset, _, valid in self._param_spans()]

    # --- the engine's contract -------------------------------------------------------------
    def local_shards(self) -> list[torch.Tensor]:
        """The flat fp32 master partitions, one per optimizer sub-group (updated in place)."""
        return list(self.optimizer.fp32_partitioned_groups_flat)

    def named_shards(self) -> list[tuple[str, torch.Tensor]]:
        """The flat fp32 master partitions, named by optimizer sub-group (ZeRO-3 flattens the
        parameters of a sub-group into one partition, so per-tensor metrics are per sub-group)."""
        return [(f"sub_group.{i}", t) for i, t in enumerate(self.optimizer.fp32_partitioned_groups_flat)]

    def inner_state_shards(self) -> list[torch.Tensor]:
        """Adam moments of the flat fp32 master partitions."""
        return state_tensors(self.optimizer.optimizer, list(self.optimizer.fp32_partitioned_groups_flat))

    def reset_optimizer_state(self) -> None:
        """Forget the inner optimizer's state, step counts included (a sick group restarts its
        moments at the next step)."""
        forget_state(self.optimizer.optimizer)

    def optimizer_transfer_state(self) -> list[torch.Tensor]:
        """The inner optimizer's whole state of this rank's fp32 master partitions, step counts
        included (what a healing group's rank receives in elastic mode)."""
        return transfer_state_tensors(self.optimizer.optimizer, list(self.optimizer.fp32_partitioned_groups_flat))

    def load_optimizer_transfer_state(self, tensors: list[torch.Tensor]) -> None:
        """Take a peer rank's `optimizer_transfer_state` (a group healing in elastic mode)."""
        masters = list(self.optimizer.fp32_partitioned_groups_flat)
        load_transfer_state_tensors(self.optimizer.optimizer, masters, [t.to(masters[0].device) for t in tensors],
                                    materialise=self._materialise_optimizer_state)

    def atom_optimizer_state(self, make: bool = False) -> tuple[list, list]:
        """The inner optimizer's state for a heal between groups of unequal size (as FSDP2's): its
        moments as streams of every parameter's valid elements in `atom_cut`'s order (views into
        the moments of the flat partitions, cut as `atom_shards` cuts the masters), and the rest
        (step counts) whole; both empty before the first step. `make`: a receiver without state
        makes it first, as DeepSpeed steps it, at learning rate 0."""
        inner, masters = self.optimizer.optimizer, list(self.optimizer.fp32_partitioned_groups_flat)
        if make and not has_state(inner, masters):
            self._materialise_optimizer_state()
        flats, rest = split_transfer_state(inner, masters)
        spans = [(i, offset, valid) for i, _, offset, _, valid in self._param_spans()]
        return [[flat[i].narrow(0, offset, valid) for i, offset, valid in spans] for flat in flats], rest

    @torch.no_grad()
    def _materialise_optimizer_state(self) -> None:
        """A fresh inner optimizer's state, made as DeepSpeed steps it: each sub-group's master
        put in its parameter group for the step only (at learning rate 0 from zero gradients)."""
        opt = self.optimizer
        inner = opt.optimizer
        for i, master in enumerate(opt.fp32_partitioned_groups_flat):
            group = inner.param_groups[opt.sub_group_to_group_id[i]]
            held = group["params"]
            group["params"] = [master]
            try:
                step_at_zero_lr(inner, [master])
            finally:
                group["params"] = held

    @torch.no_grad()
    def refresh_after_sync(self) -> None:
        """Copy masters into the working partitions, re-gather the persistent parameters
        (partition first: a bare all-gather skips parameters it thinks are up to date) and drop
        ZeRO++ hpZ's secondary copies, as `step()` does after an update."""
        opt = self.optimizer
        for i in range(len(opt.fp16_groups)):
            opt._reassign_or_swap_out_partitioned_parameters(i)
        self._regather_persistent(opt.persistent_parameters)
        opt.invalidate_secondary_tensor()

    @torch.no_grad()
    def _regather_persistent(self, params) -> None:
        """Rebuild the full (persistent) parameters from their refreshed partitions with one
        all-gather over the shard group. DeepSpeed's own route (partition, then all_gather)
        issues a collective per parameter, which dominated the refresh for models with many
        small norm weights; the result is the same concatenation of partitions."""
        if not params:
            return
        if any(p.data.numel() != p.ds_numel for p in params):  # not all gathered: DeepSpeed's way
            params[0].partition(params)
            params[0].all_gather(params)
            return
        sizes = [p.ds_tensor.ds_numel for p in params]
        mine = torch.cat([p.ds_tensor.reshape(-1) for p in params])
        gathered = mine.new_empty(self._dp_size * mine.numel())
        if self._dp_size == 1:
            gathered.copy_(mine)
        else:
            all_gather_flat(gathered, mine, group=self.shard_group)
        rows = gathered.view(self._dp_size, mine.numel())
        offset = 0
        for p, size in zip(params, sizes):
            full = rows[:, offset:offset + size].reshape(-1)[:p.ds_numel]
            p.data.copy_(full.view(p.data.shape))
            offset += size

    # --- what the trainer needs ------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        with within_group(self.shard_group, self.device):
            return self.engine(input_ids)

    def backward(self, loss: torch.Tensor, accumulation: int, last: bool) -> None:
        """Backward of one micro-batch's mean loss (DeepSpeed divides by the accumulation steps
        and reduce-scatters over the shard group). Under HSDP, on the last micro-batch, the
        accumulated gradient partitions are averaged over the replicas, before the optimizer
        step computes the norm it clips with."""
        if self.engine.is_gradient_accumulation_boundary() != last:
            raise RuntimeError("DeepSpeed's micro-step counter disagrees with the trainer's "
                               f"({accumulation} micro-batches per step)")
        with within_group(self.shard_group, self.device):
            self.engine.backward(loss)
        if not last:
            self.engine.step()  # only advances DeepSpeed's micro-step counter
        elif self.replica_group is not None:
            dist.all_reduce(self.optimizer.grad_partitions_flat_buffer, op=dist.ReduceOp.AVG,
                            group=self.replica_group)

    def optimizer_step(self, lr: float) -> tuple[torch.Tensor, float]:
        """DeepSpeed's step (clipping, update, persistent re-gather). The learning rate is `lr`
        unless the DeepSpeed config has a scheduler, which then sets it. Returns (norm, lr used)."""
        if self.scheduler is None:
            set_learning_rate(self.optimizer, lr)
        else:
            lr = self.engine.get_lr()[0]
        self.engine.step()
        norm = self.engine.get_global_grad_norm()  # ZeRO-3 keeps it as a tensor: no host sync here
        if not isinstance(norm, torch.Tensor):
            norm = torch.tensor(float("nan") if norm is None else float(norm))
        return norm.detach().to(self.device, torch.float32).reshape(()), lr

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 parameters rebuilt from the master partitions of the shard group (small
        models and tests only)."""
        masters = self.optimizer.fp32_partitioned_groups_flat
        out = {}
        for i, p, offset, size, _ in self._param_spans():
            piece = masters[i][offset:offset + size].contiguous()
            pieces = [torch.empty_like(piece) for _ in range(self._dp_size)]
            dist.all_gather(pieces, piece, group=self.shard_group)
            out[self._names[id(p)]] = torch.cat(pieces)[:p.ds_numel].view(tuple(p.ds_shape)).cpu()
        return {name: out[name] for name, _ in self.model.named_parameters()}

    # --- checkpoints ------------------------------------------------------------------------
    def save_state(self, directory: Path, write: bool) -> None:
        """DeepSpeed's own checkpoint of this group (`directory/zero3/`: one optimizer-state file
        per ZeRO-3 rank holding its fp32 master partition and moments, plus the module file).
        DeepSpeed synchronises over the whole job, so every rank calls it; ranks with
        `write=False` (the other HSDP replicas, whose state is identical) write nothing."""
        engine = self.engine
        flags = engine.save_non_zero_checkpoint, engine.save_zero_checkpoint
        if not write:
            engine.save_non_zero_checkpoint = engine.save_zero_checkpoint = False
        try:
            engine.save_checkpoint(str(directory), tag=CHECKPOINT_TAG, client_state={}, save_latest=False)
        finally:
            engine.save_non_zero_checkpoint, engine.save_zero_checkpoint = flags

    def load_state(self, directory: Path, load_optimizer: bool) -> None:
        """Restore the group's partitions (and moments and DeepSpeed's scheduler) from `save_state`,
        then re-derive working partitions and persistent parameters. Every file is opened with
        an allowlisting unpickler first: DeepSpeed's own reads would run code a pickle names."""
        check_deepspeed_dir(directory / CHECKPOINT_TAG)
        path, _ = self.engine.load_checkpoint(str(directory), tag=CHECKPOINT_TAG, load_optimizer_states=load_optimizer,
                                              load_lr_scheduler_states=load_optimizer, load_module_strict=True)
        if path is None:
            raise ValueError(f"DeepSpeed found no checkpoint in {directory / CHECKPOINT_TAG}")
        self.refresh_after_sync()
