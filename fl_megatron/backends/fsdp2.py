"""PyTorch FSDP2 (`fully_shard`) inside each federation group; HSDP on a 2-D mesh."""

from typing import Iterable, Optional

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from ..config.model import ModelConfig
from ..federation.groups import ProcessGroups
from ..models import build_model, initial_rows


class FSDP2Backend:
    """A model built on the meta device, sharded per transformer block and at the root over the
    group's shard mesh, its shards materialised directly from the seeded initialisation.

    FSDP2 keeps the sharded parameters in fp32 and casts to bf16 when it gathers them
    (MixedPrecisionPolicy), so the local shards ARE the fp32 master values and there is no
    derived low-precision copy to refresh after a sync.
    """

    name = "fsdp2"

    def __init__(self, model_cfg: ModelConfig, groups: ProcessGroups, device: torch.device,
                 seed: int, bf16: bool = False) -> None:
        self.model_cfg = model_cfg
        self.groups = groups
        self.device = device
        self.compute_dtype = torch.bfloat16 if bf16 else torch.float32
        model = build_model(model_cfg, device="meta")
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
            else MixedPrecisionPolicy()
        mesh = groups.shard_mesh
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        model.to_empty(device=device)
        self._materialise(model, seed)
        self.model = model

    @torch.no_grad()
    def _materialise(self, model: nn.Module, seed: int) -> None:
        """Fill each local shard with its rows of the sharding-independent initial value."""
        for name, param in model.named_parameters():
            if not isinstance(param, DTensor):
                raise TypeError(f"parameter {name} is not sharded by FSDP2")
            local = param.to_local()
            shard_dim_size = param.shape[0]
            placement = param.placements[-1]
            if not (isinstance(placement, Shard) and placement.dim == 0):
                raise TypeError(f"parameter {name} has placements {param.placements}; expected Shard(0)")
            shard_count = param.device_mesh.size(param.device_mesh.ndim - 1)
            shard_index = param.device_mesh.get_local_rank(param.device_mesh.ndim - 1)
            rows = -(-shard_dim_size // shard_count)  # torch.chunk semantics, as FSDP2 uses
            start = min(shard_index * rows, shard_dim_size)
            stop = min(start + rows, shard_dim_size)
            if local.shape[0] != stop - start:
                raise RuntimeError(f"FSDP2 gave {name} {local.shape[0]} local rows; expected {stop - start}")
            if stop > start:
                local.copy_(initial_rows(self.model_cfg, name, param.shape, seed, start, stop))

    # --- the engine's contract -------------------------------------------------------------
    def local_shards(self) -> list[torch.Tensor]:
        """This rank's fp32 shard of every parameter (contiguous views FSDP2 updates in place)."""
        return [p.to_local() for p in self.model.parameters()]

    def refresh_after_sync(self) -> None:
        """Nothing to refresh: FSDP2 derives bf16 copies from the fp32 shards at each all-gather."""

    # --- what the trainer needs ------------------------------------------------------------
    def parameters(self) -> Iterable[nn.Parameter]:
        return self.model.parameters()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def set_gradient_sync(self, enabled: bool) -> None:
        """Skip (False) or do (True) the gradient reduce-scatter, for gradient accumulation."""
        self.model.set_requires_gradient_sync(enabled)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global L2 gradient norm over the group; gradients are scaled to max_norm if it is > 0.

        Returns a plain 0-dim tensor (no host synchronisation until the caller reads it).
        """
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(grads, max_norm, norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters gathered on every rank (small models and tests only)."""
        return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
                for name, p in self.model.named_parameters()}

    def optimizer_state_bytes(self, optimizer: Optional[torch.optim.Optimizer]) -> int:
        """Bytes of optimizer state held by this rank."""
        if optimizer is None:
            return 0
        total = 0
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    local = value.to_local() if isinstance(value, DTensor) else value
                    total += local.numel() * local.element_size()
        return total
