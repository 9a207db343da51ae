"""PyTorch FSDP2 (`fully_shard`) inside each federation group; HSDP on a 2-D mesh."""

from concurrent.futures import Future
from pathlib import Path
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from ..config.resolved import ResolvedRun
from ..federation.groups import ProcessGroups
from ..models import build_model
from .common import InitialValues, wrap_blocks_for_recompute
from .pickle_guard import GuardedPlanner, GuardedReader
from .optimizer import (build_optimizer, forget_state, has_state, load_transfer_state_tensors, set_learning_rate,
                        split_transfer_state, state_tensors, step_at_zero_lr, transfer_state_tensors)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly DTensor) parameter or optimizer state tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _shard_count(param: DTensor) -> int:
    """Ranks the parameter's dim 0 is split over (the mesh's last, shard, dimension)."""
    return param.device_mesh.size(param.device_mesh.ndim - 1)


def host_copy(state):
    """A copy of a (nested) state dict in host memory, DTensors kept as DTensors over the same
    mesh: what a background write may read while training changes the originals."""
    if isinstance(state, dict):
        return {k: host_copy(v) for k, v in state.items()}
    if isinstance(state, list):
        return [host_copy(v) for v in state]
    if isinstance(state, DTensor):
        # the same spec around a host copy of the local shard (DTensor.from_local would move it
        # back to the mesh's device: a second copy of the state on the GPU); torch's own
        # _create_cpu_state_dict swaps the local tensor the same way
        local = state.to_local().detach().to("cpu", copy=True)
        return DTensor(local, state._spec, requires_grad=False)
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    return state


class _AlreadyStaged:
    """DCP's AsyncStager for a state dict that `host_copy` staged already."""

    should_synchronize_after_execute = False  # what async_save reads

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class FSDP2Backend:
    """A model built on the meta device, sharded per transformer block and at the root over the
    group's shard mesh, its shards materialised directly from the seeded initialisation.

    FSDP2 keeps the sharded parameters in fp32 and casts to bf16 when it gathers them
    (MixedPrecisionPolicy), so the local shards ARE the fp32 master values and there is no
    derived low-precision copy to refresh after a sync; only parameters left gathered are dropped.
    """

    def __init__(self, run: ResolvedRun, groups: ProcessGroups, device: torch.device,
                 initial: InitialValues) -> None:
        t = run.cfg.training
        self.groups = groups
        self.device = device
        self.compute_dtype = torch.bfloat16 if t.bf16 else torch.float32
        model = build_model(run.cfg.model, device="meta")
        reduce_dtype = torch.bfloat16 if t.grad_reduce_dtype == "bf16" else torch.float32
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype) if t.bf16 \
            else MixedPrecisionPolicy()
        mesh = groups.shard_mesh
        if t.recompute_activations:
            wrap_blocks_for_recompute(model)
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        self._flat, self._shard_list = self._allocate(model, device)
        self._materialise(model, initial)
        self.model = model
        self.optimizer = build_optimizer(model.named_parameters(), t)
        # the sharded parameters the optimizer holds: after a forward without a backward (an
        # evaluation) FSDP2 leaves the root module's parameters unsharded, and model.parameters()
        # then yields those instead (no optimizer state, the whole tensor as "local")
        self._sharded = list(model.named_parameters())
        self.clip_grad = t.clip_grad

    @staticmethod
    def _allocate(model: nn.Module, device: torch.device) -> tuple[torch.Tensor, list]:
        """Materialise the meta shards; evenly split ones as adjacent views of one flat buffer.

        FSDP2 keeps a shard's storage as given when its size equals the padded shard size (the
        parameter's rows divide evenly by the shard count), so those shards can share one flat
        fp32 buffer: the federation average then moves them with one collective and no copy.
        Unevenly split shards get their own storage (FSDP2 pads them). Which parameters are
        even depends only on shapes and shard count, so every peer rank has the same layout.
        """
        params = list(model.parameters())
        even = [p for p in params if p.to_local().shape[0] * _shard_count(p) == p.shape[0]]
        flat = torch.empty(sum(p.to_local().numel() for p in even), device=device)
        offsets, offset = {}, 0
        for p in even:
            offsets[id(p)] = offset
            offset += p.to_local().numel()

        def relocate(t: torch.Tensor) -> torch.Tensor:
            if isinstance(t, DTensor) and id(t) in offsets:
                local = t.to_local()
                view = flat.narrow(0, offsets[id(t)], local.numel()).view(local.shape)
                return DTensor.from_local(view, t.device_mesh, t.placements, run_check=False,
                                          shape=t.shape, stride=t.stride())
            return torch.empty_like(t, device=device)

        model._apply(relocate)
        # One entry per run of adjacent flat shards, and one per separately stored shard.
        shard_list, run_start, run_len = [], None, 0
        for p in model.parameters():
            local = p.to_local()
            in_flat = id(p) in offsets and local.numel() > 0 and \
                local.data_ptr() == flat.data_ptr() + offsets[id(p)] * flat.element_size()
            if id(p) in offsets and local.numel() > 0 and not in_flat:
                raise RuntimeError("FSDP2 did not keep the shard storage it was given; "
                                   "this torch version is not supported by the flat layout")
            if in_flat and run_start is not None and offsets[id(p)] == run_start + run_len:
                run_len += local.numel()
                continue
            if run_start is not None:
                shard_list.append(("flat", run_start, run_len))
                run_start, run_len = None, 0
            if in_flat:
                run_start, run_len = offsets[id(p)], local.numel()
            elif local.numel() > 0:
                shard_list.append(("param", p, None))
        if run_start is not None:
            shard_list.append(("flat", run_start, run_len))
        return flat, shard_list

    @torch.no_grad()
    def _materialise(self, model: nn.Module, initial: InitialValues) -> None:
        """Fill each local shard with its rows of the sharding-independent initial value."""
        for name, param in model.named_parameters():
            if not isinstance(param, DTensor):
                raise TypeError(f"parameter {name} is not sharded by FSDP2")
            local = param.to_local()
            shard_dim_size = param.shape[0]
            placement = param.placements[-1]
            if not (isinstance(placement, Shard) and placement.dim == 0):
                raise TypeError(f"parameter {name} has placements {param.placements}; expected Shard(0)")
            shard_count = _shard_count(param)
            shard_index = param.device_mesh.get_local_rank(param.device_mesh.ndim - 1)
            rows = -(-shard_dim_size // shard_count)  # torch.chunk semantics, as FSDP2 uses
            start = min(shard_index * rows, shard_dim_size)
            stop = min(start + rows, shard_dim_size)
            if local.shape[0] != stop - start:
                raise RuntimeError(f"FSDP2 gave {name} {local.shape[0]} local rows; expected {stop - start}")
            if stop > start:
                local.copy_(initial.rows(name, tuple(param.shape), start, stop))

    def atom_cut(self) -> tuple[str, list[tuple]]:
        """How `named_shards` cut every parameter across a group, for groups of unequal size
        (atom_plan): FSDP2's row rule and each parameter's full shape, in the model's order."""
        return "fsdp2", [tuple(p.shape) for _, p in self._sharded]

    def atom_shards(self) -> list[torch.Tensor]:
        """Every parameter's local shard, flat (detached views of the fp32 storage FSDP2 updates),
        in `atom_cut`'s order."""
        return [t.detach() for _, t in self.named_shards()]

    # --- the engine's contract -------------------------------------------------------------
    def local_shards(self) -> list[torch.Tensor]:
        """This rank's fp32 shards: runs of adjacent shards in the flat buffer as one tensor each,
        the separately stored (unevenly split) ones on their own. FSDP2 updates them in place."""
        return [self._flat.narrow(0, a, b) if kind == "flat" else a.to_local()
                for kind, a, b in self._shard_list]

    def named_shards(self) -> list[tuple[str, torch.Tensor]]:
        """Every parameter's name with this rank's fp32 shard of it (possibly empty), in the
        model's order (the same on every rank): per-tensor consensus metrics."""
        return [(name, p.to_local().reshape(-1)) for name, p in self._sharded]

    def inner_state_shards(self) -> list[torch.Tensor]:
        """AdamW moments / SGD momentum of every parameter's local shard, parameter by parameter."""
        return state_tensors(self.optimizer, [p for _, p in self._sharded], _local)

    def reset_optimizer_state(self) -> None:
        """Forget the inner optimizer's state, step counts included (a sick group restarts its
        moments at the next step)."""
        forget_state(self.optimizer)

    def optimizer_transfer_state(self) -> list[torch.Tensor]:
        """This rank's whole inner optimizer state (moments and step counts) for a healing peer."""
        return transfer_state_tensors(self.optimizer, [p for _, p in self._sharded], _local)

    def load_optimizer_transfer_state(self, tensors: list[torch.Tensor]) -> None:
        """Take a peer rank's `optimizer_transfer_state` (a group healing in elastic mode)."""
        load_transfer_state_tensors(self.optimizer, [p for _, p in self._sharded],
                                    [t.to(self.device) for t in tensors], _local)

    def atom_optimizer_state(self, make: bool = False) -> tuple[list, list]:
        """The inner optimizer's state for a heal between groups of unequal size: its moments as
        streams in `atom_cut`'s order, re-cut atom by atom, and the rest (step counts) whole
        (optimizer.split_transfer_state); both empty before the first step. `make`: a receiver
        without state makes it first, by a step at learning rate 0 that leaves the parameters as
        they are, so that it holds the sender's keys."""
        params = [p for _, p in self._sharded]
        if make and not has_state(self.optimizer, params):
            step_at_zero_lr(self.optimizer, params)
        return split_transfer_state(self.optimizer, params, _local)

    def refresh_after_sync(self) -> None:
        """Drop the parameters FSDP2 holds gathered, so that the next forward gathers them from the
        changed shards: after a forward without a backward (an evaluation) the root module's stay
        gathered, and would be used as they were. (bf16 copies are made at each all-gather.)"""
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    # --- what the trainer needs ------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def backward(self, loss: torch.Tensor, accumulation: int, last: bool) -> None:
        """Backward of one micro-batch's mean loss; gradients are reduced on the last one."""
        self.set_gradient_sync(last)
        (loss / accumulation).backward()

    def optimizer_step(self, lr: float) -> tuple[torch.Tensor, float]:
        """Clip, step at learning rate `lr`, clear gradients. Returns (gradient norm, lr used)."""
        set_learning_rate(self.optimizer, lr)
        norm = self.clip_grad_norm(self.clip_grad)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm, lr

    def set_gradient_sync(self, enabled: bool) -> None:
        """Skip (False) or do (True) the gradient reduce-scatter, for gradient accumulation."""
        self.model.set_requires_gradient_sync(enabled)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global L2 gradient norm over the group; gradients are scaled to max_norm if it is > 0.

        Returns a plain 0-dim tensor (no host synchronisation until the caller reads it).
        """
        params = [p for p in self.model.parameters() if p.grad is not None]
        if max_norm > 0:
            # (get_total_norm + clip_grads_with_norm_ on DTensor gradients computes the norm but
            # leaves the gradients unscaled in torch 2.13; clip_grad_norm_ scales them)
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=2.0)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters gathered on every rank (small models and tests only): copies, never
        the live parameters (with one shard per rank, a CPU "gather" would alias them)."""
        return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().to("cpu", copy=True)
                for name, p in self.model.named_parameters()}

    # --- checkpoints ------------------------------------------------------------------------
    def save_state(self, directory: Path, write: bool) -> None:
        """torch.distributed.checkpoint over the federation group: every rank writes its own
        shards in parallel (HSDP replicas are written once); DCP reshards them on load."""
        if not write:
            return
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(directory),
                 process_group=self.groups.federation)

    def save_state_async(self, directory: Path, write: bool) -> Optional[Future]:
        """`save_state` in the background (--async-save): the state is copied to host memory
        before this returns, then written by DCP's thread, which plans over the gloo group kept
        for it (never a communicator the training thread uses). None when this rank writes nothing."""
        if not write:
            return None
        if self.groups.checkpoint is None:
            raise ValueError("--async-save needs the checkpoint process group: "
                             "build_process_groups(..., async_checkpoint=True)")
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        staged = host_copy({"model": model_state, "optim": optim_state})
        # staged here (DCP's own stager copies whole storages, and FSDP2's parameters share one
        # flat storage per group: it fails on it), so DCP's stager has nothing left to do
        return dcp.async_save(staged, checkpoint_id=str(directory), process_group=self.groups.checkpoint,
                              async_stager=_AlreadyStaged())

    def load_state(self, directory: Path, load_optimizer: bool) -> None:
        """Read this group's shards (any number of ranks per group) from a `save_state` directory,
        in place (the flat buffer the engine averages stays the parameters' storage)."""
        storage = self._storage()
        if load_optimizer:
            model_state, optim_state = get_state_dict(self.model, self.optimizer)
            state = {"model": model_state, "optim": optim_state}
        else:
            state = {"model": get_model_state_dict(self.model)}
        dcp.load(state, storage_reader=GuardedReader(str(directory)), planner=GuardedPlanner(),
                 process_group=self.groups.federation)
        if load_optimizer:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        else:
            set_model_state_dict(self.model, state["model"])
        if self._storage() != storage:
            raise RuntimeError("loading the checkpoint replaced FSDP2's shard storage; this torch version "
                               "is not supported")

    def _storage(self) -> list[int]:
        return [p.to_local().data_ptr() for p in self.model.parameters()]
