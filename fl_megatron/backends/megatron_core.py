"""megatron-core's DistributedDataParallel and DistributedOptimizer inside each federation group.

The data-parallel group megatron-core sees is the federation group: its gradients are
reduce-scattered there and its optimizer state and fp32 main parameters are sharded there, while
every rank keeps the whole model (megatron's distributed optimizer: ZeRO-1 with reduce-scattered gradients). FL+HSDP
uses megatron's own partial distributed optimizer: the optimizer is sharded over the shard group
and each step all-reduces the gradient shards over the replicas (`inter_dist_opt` group). A sync
averages the fp32 main shards across groups in place, then copies them into the model parameters
and all-gathers those (`refresh_after_sync`).

Groups reach megatron-core through a `ProcessGroupCollection` (no `parallel_state` globals);
tensor and pipeline parallelism are 1. On CPU every call into megatron-core runs inside
`megatron_cpu.cpu_compat()`.
"""

from pathlib import Path

import torch
import torch.distributed as dist

from ..config.resolved import ResolvedRun
from ..federation.groups import ProcessGroups
from ..models import build_model
from ..topology import MESH_DIM_NAMES
from .common import InitialValues, SavesInTheForeground, own_singleton_group
from .megatron_cpu import compat_method, ensure_memory_buffer, install_cpu_rng_tracker
from .megatron_model import build_gpt_model, quiet_import_megatron
from .megatron_names import megatron_layout, megatron_tensor, our_sources, our_tensor
from .megatron_shards import MegatronMainShards
from .megatron_state import MegatronShardFiles

_SINGLETON_FIELDS = ("tp", "pp", "mp", "cp", "tp_cp", "ep", "expt_tp", "tp_ep", "tp_ep_pp", "embd", "pos_embd",
                     "expt_dp", "intra_expt_dp")


def _process_group_collection(groups: ProcessGroups):
    """megatron-core's groups for this rank: data parallel = the federation group; for HSDP the
    optimizer is sharded over the shard group and gradients all-reduced over the replicas."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    own = own_singleton_group()
    pgc = ProcessGroupCollection()
    for name in _SINGLETON_FIELDS:
        setattr(pgc, name, own)
    shard = groups.mesh.get_group(MESH_DIM_NAMES[2])
    pgc.dp = pgc.dp_cp = groups.federation
    pgc.intra_dp_cp = pgc.intra_dist_opt = shard
    if groups.layout.is_hsdp:
        pgc.inter_dist_opt = groups.replica
    return pgc


def _sgd_over(param_groups: list[dict], lr: float, momentum: float) -> torch.optim.SGD:
    """torch SGD stepping megatron's parameter groups as they are (their main shards are views,
    which torch refuses as parameters: megatron itself sets them after constructing Adam)."""
    sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr, momentum=momentum)
    for group in param_groups:
        group.update(momentum=momentum, dampening=0.0, nesterov=False)
        for key, value in sgd.defaults.items():
            group.setdefault(key, value)
    sgd.param_groups = param_groups
    return sgd


class MegatronBackend(SavesInTheForeground):
    """GPTModel + DDP + DistributedOptimizer over one federation group (see the module doc)."""

    @compat_method
    def __init__(self, run: ResolvedRun, groups: ProcessGroups, device: torch.device,
                 initial: InitialValues) -> None:
        quiet_import_megatron()
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        t = run.cfg.training
        self.model_cfg, self.groups, self.device = run.cfg.model, groups, device
        if device.type == "cpu":
            install_cpu_rng_tracker(t.seed)
        ensure_memory_buffer()
        pgc = _process_group_collection(groups)
        self.shard_group = pgc.intra_dp_cp
        # on a GPU megatron creates the parameters there directly: no whole-model copy in host memory
        config, model = build_gpt_model(run.cfg.model, t, pgc, on_cpu=device.type == "cpu")
        self.gpt = model
        self.layout = megatron_layout(run.cfg.model)
        self._sources = our_sources(self.layout)
        names = {name for name, _ in model.named_parameters()}
        if names != set(self.layout):
            raise RuntimeError("megatron-core's GPTModel has parameters "
                               f"{sorted(names ^ set(self.layout))} that the name map does not expect")
        shapes = {name: tuple(p.shape) for name, p in build_model(run.cfg.model, "meta").named_parameters()}

        def initial_tensor(name: str) -> torch.Tensor:
            """The fp32 initial value of megatron parameter `name`, stacked from our rows."""
            return megatron_tensor(self.layout[name], lambda n, a, b: initial.rows(n, shapes[n], a, b))

        with torch.no_grad():
            for name, param in model.named_parameters():  # one tensor at a time
                param.copy_(initial_tensor(name))
        if t.bf16:  # as Megatron-LM does: every parameter in bf16, logits returned in fp32
            from megatron.core.transformer.module import Float16Module
            model = Float16Module(config, model)
        model.to(device)
        replicas = groups.layout.replicas if groups.layout.is_hsdp else 1
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=t.grad_reduce_dtype != "bf16",
            overlap_grad_reduce=False,
            overlap_param_gather=False, num_distributed_optimizer_instances=replicas)
        self.ddp = DistributedDataParallel(config, ddp_config, model, pg_collection=pgc)
        self.model = self.ddp
        self.optimizer = self._build_optimizer(t, config.params_dtype, pgc)
        self._dist_opts = [o for o in getattr(self.optimizer, "chained_optimizers", [self.optimizer])
                           if not getattr(o, "is_stub_optimizer", False)]
        if t.optimizer == "sgd":
            # megatron's DistributedOptimizer accepts only Adam (for its own checkpoint format, which
            # this backend does not use): SGD steps the same fp32 main shards in the same groups
            for opt in self._dist_opts:
                opt.optimizer = _sgd_over(opt.optimizer.param_groups, t.lr, t.sgd_momentum)
        self.shards = MegatronMainShards(self._dist_opts, [self.ddp], self._param_names())
        if t.bf16:  # the main shards were cloned from bf16 parameters: give them the exact fp32 values
            self._set_main_from_full(initial_tensor)
        self.files = MegatronShardFiles(self._dist_opts, self._param_names())

    def _build_optimizer(self, t, params_dtype: torch.dtype, pgc):
        """megatron's distributed optimizer (Adam) with our hyper-parameters and its no-decay rule."""
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config = OptimizerConfig(
            optimizer="adam", lr=t.lr, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
            adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, clip_grad=t.clip_grad, bf16=t.bf16,
            params_dtype=params_dtype, use_distributed_optimizer=True)
        optimizer = get_megatron_optimizer(config, [self.ddp], use_gloo_process_groups=False, pg_collection=pgc)
        for group in optimizer.param_groups:
            # what megatron's OptimizerParamScheduler does: no decay for norms and biases (wd_mult 0)
            group["weight_decay"] = t.weight_decay * group.get("wd_mult", 1.0)
        return optimizer

    def _param_names(self) -> dict[int, str]:
        return {id(p): name for name, p in self.gpt.named_parameters()}

    # --- the fp32 main shards: the engine's contract, served by MegatronMainShards --------------
    def _main_pairs(self):
        """(model parameter, its fp32 main shard, the shard's range in the flattened parameter)."""
        return self.shards.entries()

    @torch.no_grad()
    def _set_main_from_full(self, full) -> None:
        """Fill every main shard from whole fp32 megatron tensors (`full(name)`, called once per
        parameter this rank holds a shard of), then refresh the model."""
        names = self._param_names()
        for param, main, start, stop in self._main_pairs():
            main.copy_(full(names[id(param)]).reshape(-1)[start:stop])
        self.refresh_after_sync()

    def atom_cut(self) -> tuple[str, list[tuple]]:
        return self.shards.atom_cut()

    def atom_ranges(self) -> list:
        return self.shards.atom_ranges()

    def atom_shards(self) -> list[torch.Tensor]:
        return self.shards.atom_shards()

    def atom_optimizer_state(self, make: bool = False) -> tuple[list, list]:
        return self.shards.atom_optimizer_state(make)

    def local_shards(self) -> list[torch.Tensor]:
        return self.shards.local_shards()

    def named_shards(self) -> list[tuple[str, torch.Tensor]]:
        return self.shards.named_shards()

    def inner_state_shards(self) -> list[torch.Tensor]:
        return self.shards.inner_state_shards()

    def reset_optimizer_state(self) -> None:
        self.shards.reset_optimizer_state()

    def optimizer_transfer_state(self) -> list[torch.Tensor]:
        return self.shards.optimizer_transfer_state()

    def load_optimizer_transfer_state(self, tensors: list[torch.Tensor]) -> None:
        self.shards.load_optimizer_transfer_state(tensors)

    def refresh_after_sync(self) -> None:
        self.shards.refresh_after_sync()

    # --- what the trainer needs -----------------------------------------------------------------
    @compat_method
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)
        return self.ddp(input_ids, positions, None)

    @compat_method
    def backward(self, loss: torch.Tensor, accumulation: int, last: bool) -> None:
        """Gradients accumulate in megatron's fp32 buffer; the last micro-batch reduces them."""
        (loss / accumulation).backward()
        if last:
            self.ddp.finish_grad_sync()

    @compat_method
    def optimizer_step(self, lr: float) -> tuple[torch.Tensor, float]:
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
        ok, norm, _ = self.optimizer.step()
        if not ok:
            raise FloatingPointError("megatron-core's optimizer skipped the step (non-finite gradients)")
        if not self.optimizer.config.clip_grad > 0:  # megatron-core reports 0.0 when it does not clip
            norm = self.optimizer.get_grad_norm()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        # on the rank's device, like the loss it is reduced with (a float from megatron-core)
        return torch.tensor(float("nan") if norm is None else float(norm), device=self.device), lr

    @compat_method
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Our parameters in fp32 on every rank, from the main shards (small models and tests only)."""
        full = {}
        names = self._param_names()
        for param, main, start, stop in self._main_pairs():
            flat = full.setdefault(names[id(param)], torch.zeros(param.numel(), dtype=torch.float32,
                                                                 device=main.device))
            flat[start:stop] = main
        for name, param in self.gpt.named_parameters():
            flat = full.setdefault(name, torch.zeros(param.numel(), dtype=torch.float32, device=self.device))
            dist.all_reduce(flat, group=self.shard_group)
            full[name] = flat.view(param.shape).cpu()
        return {ours: our_tensor(sources, full.__getitem__) for ours, sources in self._sources.items()}

    # --- checkpoints ----------------------------------------------------------------------------
    @compat_method
    def save_state(self, directory: Path, write: bool) -> None:
        """Each rank of the shard group writes its main shards and optimizer state (safetensors)."""
        if write:
            self.files.save(directory, self.shard_group)

    @compat_method
    def load_state(self, directory: Path, load_optimizer: bool) -> None:
        """Read this rank's shard file (same shard-group size as saved), then re-gather the model."""
        self.files.load(directory, self.shard_group, load_optimizer)
        self.refresh_after_sync()
