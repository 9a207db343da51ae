"""The federated outer loop for Megatron-LM (patches/megatron-lm/ calls into this module).

Megatron-LM trains each federation group as usual (its distributed optimizer sharded over an
instance, gradients all-reduced over the P instances of the group); every H iterations
`FederatedOuterLoop.after_iteration` averages the distributed optimizer's fp32 main shards
across the F groups (FedAvg, shard by shard, never gathering the model), copies them into the
model parameters and re-gathers those.

Checkpoint rule: a checkpoint only ever holds synced state. `before_save` syncs first unless the
last sync was at this very iteration; the weights (fp32 main and model parameters) in a
checkpoint are therefore the same in every group. The Adam moments are not averaged: with
Megatron-LM's torch_dist format each shard's moments come from one of the groups.
"""

import time
from typing import Optional

import torch
import torch.distributed as dist

from ..backends.megatron_cpu import cpu_compat
from ..backends.megatron_state import main_shard_entries
from ..federation.averaging import ShardAverager
from ..federation.schedule import sync_due
from .megatron_lm_args import add_federation_args, compose_args_providers, validate_federation_args
from .megatron_lm_groups import FederationGroups, build_federation_groups, gate_gradient_reduction

__all__ = ["FederatedOuterLoop", "FederationGroups", "add_federation_args", "build_federation_groups",
           "compose_args_providers", "distributed_optimizers", "gate_gradient_reduction",
           "validate_federation_args"]


def distributed_optimizers(optimizer) -> list:
    """The DistributedOptimizers inside megatron's (possibly chained) optimizer."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    found = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "is_stub_optimizer", False):
            continue
        if not isinstance(opt, DistributedOptimizer):
            raise ValueError("the federated outer loop needs megatron's DistributedOptimizer, "
                             f"got {type(opt).__name__}")
        if getattr(opt.config, "use_precision_aware_optimizer", False):
            raise ValueError("use_precision_aware_optimizer keeps the main parameters inside the fused optimizer")
        found.append(opt)
    return found


class FederatedOuterLoop:
    """FedAvg of megatron's fp32 main shards across federation groups, every H iterations."""

    def __init__(self, model_chunks: list, optimizer, *, num_groups: int, sync_interval: int,
                 train_iters: Optional[int] = None, disable_sync: bool = False, replica_split: bool = True,
                 bucket_mb: float = 32.0, overlap_param_gather: bool = False, start_iteration: int = 0,
                 log=None) -> None:
        with cpu_compat():
            self.model_chunks = list(model_chunks)
            self.groups = build_federation_groups(num_groups)
            gate_gradient_reduction(self.model_chunks, self.groups)
            self.dist_opts = distributed_optimizers(optimizer)
        g = self.groups
        self.interval, self.syncing = sync_interval, sync_interval > 0 and not disable_sync
        self.train_iters, self.overlap_param_gather = train_iters, overlap_param_gather
        self.averager = ShardAverager(g.peer_group, g.num_groups, replica_group=g.replica_group,
                                      replicas=g.replicas, replica_index=g.replica_index,
                                      replica_split=replica_split, bucket_bytes=int(bucket_mb * (1 << 20)))
        self.last_sync = start_iteration  # initial and loaded states are synced (the checkpoint rule)
        self.syncs = 0
        self.log = log if log is not None else (lambda line: print(line, flush=True))
        self._say(f"fl-megatron: {g.num_groups} federation groups x {g.replicas} replica(s), sync every "
                  f"{sync_interval if self.syncing else 'never'}; peer group {g.peer_ranks}, "
                  f"replica group {g.replica_ranks}")

    @classmethod
    def from_megatron_args(cls, args, model_chunks: list, optimizer) -> Optional["FederatedOuterLoop"]:
        """Build from Megatron-LM's args after setup_model_and_optimizer; None when F = 1."""
        if not hasattr(args, "fl_enabled"):  # validate_args (patch 0002) has not resolved them
            validate_federation_args(args)
        if not args.fl_enabled:
            return None
        return cls(model_chunks, optimizer, num_groups=args.fl_num_groups, sync_interval=args.fl_sync_interval,
                   train_iters=args.train_iters, disable_sync=args.fl_disable_sync,
                   replica_split=args.fl_replica_split, bucket_mb=args.fl_bucket_mb,
                   overlap_param_gather=bool(getattr(args, "overlap_param_gather", False)),
                   start_iteration=int(getattr(args, "iteration", 0) or 0))

    def _say(self, line: str) -> None:
        if dist.get_rank() == 0:
            self.log(line)

    def main_shards(self) -> list[torch.Tensor]:
        """This rank's fp32 main shards, in megatron's order (the same on every peer)."""
        return [main for _, _, main, _, _ in main_shard_entries(self.dist_opts)]

    @torch.no_grad()
    def sync(self, iteration: int, regather: bool = True) -> str:
        """Average the main shards across the federation groups, copy them into the model
        parameters and (if `regather`) all-gather those inside each instance."""
        start = time.perf_counter()
        with cpu_compat():
            stats = self.averager.average(self.main_shards())
            for opt in self.dist_opts:
                opt._copy_main_params_to_model_params()
            if regather:
                for chunk in self.model_chunks:
                    chunk.start_param_sync(force_sync=True)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        self.last_sync, self.syncs = iteration, self.syncs + 1
        rel = (stats.sq_dev_sum / stats.sq_mean_sum) ** 0.5 if stats.sq_mean_sum > 0 else 0.0
        line = (f"fl-megatron: sync {self.syncs} at iteration {iteration}: "
                f"{stats.inter_group_bytes / 1e6:.2f} MB/rank across {self.groups.num_groups} groups"
                + (f" + {stats.intra_group_bytes / 1e6:.2f} MB/rank replica gather" if stats.intra_group_bytes else "")
                + f", {seconds:.3f} s, group spread {rel:.2e} (rank 0's shard)")
        self._say(line)
        return line

    def after_iteration(self, iteration: int) -> Optional[str]:
        """Call right after `iteration += 1` in train(); syncs every H iterations and at the last."""
        last = self.train_iters is not None and iteration >= self.train_iters
        if not sync_due(iteration, self.interval, last, federated=self.syncing):
            return None
        # with --overlap-param-gather the next forward's pre-hooks all-gather the copied shards
        return self.sync(iteration, regather=not self.overlap_param_gather)

    def before_save(self, iteration: int) -> Optional[str]:
        """Call before every save_checkpoint: syncs unless the last sync was at this iteration."""
        if not self.syncing or self.last_sync == iteration:
            return None
        return self.sync(iteration, regather=True)

    def hash_check_allowed(self, iteration: int) -> bool:
        """Whether all data-parallel replicas hold the same weights now (synced at `iteration`)."""
        return self.last_sync == iteration
