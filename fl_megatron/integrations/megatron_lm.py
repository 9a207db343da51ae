"""The federated outer loop for Megatron-LM (patches/megatron-lm/ calls into this module).

Megatron-LM trains each federation group as usual (its distributed optimizer sharded over an
instance, gradients all-reduced over the P instances of the group). After every iteration
`FederatedOuterLoop.after_iteration` hands the step to fl-megatron's `FederationEngine`, the one
`fl_megatron.pretrain` uses: every --fl-* option (outer optimizers, compressed syncs with error
feedback, overlap, fragments, gossip and Ada, DBench metrics, inner-state policies, groups with
NaN/Inf shards left out) acts on the distributed optimizer's fp32 main shards, shard by shard,
never gathering the model. A refresh copies the shards into the model parameters and gathers
those (`MegatronMainShards`).

Checkpoint rule: a checkpoint only ever holds synced weights. `before_save` lands a sync in
flight and averages every fragment over every group first, unless that was done at this very
iteration, because Megatron-LM stores one copy of each shard across the data-parallel replicas.
The rest of the federation's state (outer optimizer, residuals, schedule, each group's own Adam
moments) is written beside the checkpoint (`megatron_lm_state`) and read back on resume.
"""

import math
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from ..backends.megatron_cpu import cpu_compat
from ..backends.megatron_shards import MegatronMainShards
from ..federation.engine import FederationEngine
from ..federation.result import SyncResult
from . import megatron_lm_state as saved_state
from .megatron_lm_args import add_federation_args, compose_args_providers, federation_config, validate_federation_args
from .megatron_lm_groups import MegatronLMGroups, build_federation_groups, gate_gradient_reduction

__all__ = ["FederatedOuterLoop", "MegatronLMGroups", "add_federation_args", "build_federation_groups",
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


def _parameter_names(model_chunks: list) -> dict[int, str]:
    """id(parameter) -> name, over every model chunk (virtual pipeline stages get a prefix)."""
    names = {}
    for i, chunk in enumerate(model_chunks):
        prefix = f"chunk{i}." if len(model_chunks) > 1 else ""
        names.update({id(p): prefix + name for name, p in chunk.named_parameters()})
    return names


class FederatedOuterLoop:
    """Runs fl-megatron's FederationEngine over megatron's distributed optimizer (see the module doc)."""

    def __init__(self, model_chunks: list, optimizer, config, *, train_iters: Optional[int] = None,
                 overlap_param_gather: bool = False, save_dir: Optional[str] = None, device_type: str = "cpu",
                 timeout: Optional[timedelta] = None, log=None) -> None:
        config.validate()
        with cpu_compat():
            self.model_chunks = list(model_chunks)
            self.groups = build_federation_groups(config.num_groups, exchange=config.overlap_steps > 0,
                                                  device_type=device_type, timeout=timeout)
            gate_gradient_reduction(self.model_chunks, self.groups)
            self.dist_opts = distributed_optimizers(optimizer)
            self.shards = MegatronMainShards(self.dist_opts, self.model_chunks, _parameter_names(self.model_chunks))
            self.engine = FederationEngine(self.shards, self.groups, config)
        self.config, self.train_iters, self.save_dir = config, train_iters, save_dir
        self.overlap_param_gather = overlap_param_gather
        self.syncs = 0
        self.log = log if log is not None else (lambda line: print(line, flush=True))
        g = self.groups
        self._say(f"fl-megatron: {g.num_groups} federation groups x {g.replicas} replica(s), sync every "
                  f"{config.sync_interval if config.syncing else 'never'} ({self._describe()}); peer group "
                  f"{g.peer_ranks}, replica group {g.replica_ranks}")

    @classmethod
    def from_megatron_args(cls, args, model_chunks: list, optimizer) -> Optional["FederatedOuterLoop"]:
        """Build from Megatron-LM's args after setup_model_and_optimizer (which loaded any
        checkpoint: the federation state saved beside it is read here); None when F = 1."""
        if not hasattr(args, "fl_enabled"):  # validate_args (patch 0002) has not resolved them
            validate_federation_args(args)
        if not args.fl_enabled:
            return None
        import torch

        timeout = getattr(args, "distributed_timeout_minutes", None)
        loop = cls(model_chunks, optimizer, federation_config(args), train_iters=args.train_iters,
                   overlap_param_gather=bool(getattr(args, "overlap_param_gather", False)),
                   save_dir=getattr(args, "save", None), device_type="cuda" if torch.cuda.is_available() else "cpu",
                   timeout=timedelta(minutes=timeout) if timeout else None)
        iteration = int(getattr(args, "iteration", 0) or 0)
        if iteration > 0 and getattr(args, "load", None) and not getattr(args, "finetune", False):
            loop.resume(args.load, iteration, load_inner=not getattr(args, "no_load_optim", False))
        return loop

    def _describe(self) -> str:
        c = self.config
        parts = [c.outer_optimizer if c.outer_optimizer != "fedavg" or c.resolved_outer_lr != 1.0 else "FedAvg",
                 c.sync_dtype + (" + error feedback" if c.error_feedback else "")]
        if c.overlap_steps:
            parts.append(f"overlapped {c.overlap_steps} step(s)")
        if c.fragments > 1:
            parts.append(f"{c.fragments} fragments")
        if c.gossip:
            parts.append(f"topology {c.topology}")
        return ", ".join(parts)

    def _say(self, line: str) -> None:
        if dist.get_rank() == 0:
            self.log(line)

    def main_shards(self) -> list:
        """This rank's fp32 main shards, in megatron's order (the same on every peer)."""
        return self.shards.local_shards()

    def _report(self, result: Optional[SyncResult], iteration: int) -> Optional[str]:
        if result is None:
            return None
        self.syncs += 1
        measured = result if result.variance is not None else result.carried  # carried: the previous sync's
        spread = None if measured is None else \
            (math.sqrt(measured.variance) / measured.param_rms if measured.param_rms > 0 else 0.0)
        when = f"at iteration {iteration}" if result.step == iteration else \
            f"of iteration {result.step} landed at iteration {iteration}"
        extra = [f"graph {result.graph}"] if result.graph != "complete" else []
        if result.fragments:
            extra.append(f"fragment(s) {', '.join(map(str, result.fragments))}")
        if result.sick_groups:
            extra.append(f"groups {', '.join(map(str, result.sick_groups))} left out (NaN/Inf) and reset")
        line = (f"fl-megatron: sync {self.syncs} {when}: {result.inter_group_bytes / 1e6:.2f} MB/rank across "
                f"{self.groups.num_groups} groups"
                + (f" + {result.intra_group_bytes / 1e6:.2f} MB/rank inside the group" if result.intra_group_bytes
                   else "")
                + f", {result.seconds:.3f} s"
                + ("" if spread is None else f", spread {spread:.2e}"
                   + ("" if measured is result else f" (sync of iteration {measured.step})"))
                + "".join(f", {e}" for e in extra))
        self._say(line)
        return line

    def after_iteration(self, iteration: int) -> Optional[str]:
        """Call right after `iteration += 1` in train(): the engine syncs (or launches, or lands a
        sync) when due, every H iterations (H/N with fragments) and at the last."""
        last = self.train_iters is not None and iteration >= self.train_iters
        # with --overlap-param-gather the next forward's pre-hooks all-gather the refreshed shards
        self.shards.regather = not self.overlap_param_gather or last
        with cpu_compat():
            result = self.engine.after_step(iteration, last=last)
        line = self._report(result, iteration)
        if last:
            self.engine.close()
        return line

    def before_save(self, iteration: int, persistent: bool = True) -> Optional[str]:
        """Call before every save_checkpoint: lands a sync in flight and averages every fragment
        over every group, unless that was done at this iteration; then writes the federation's
        state beside the checkpoint (persistent saves)."""
        if not self.config.syncing:
            return None
        line = None
        self.shards.regather = True
        with cpu_compat():
            if self.engine.flight is not None:
                line = self._report(self.engine.land(), iteration)
            if self.engine.last_synced_step != iteration:
                line = self._report(self.engine.sync(iteration, full=True), iteration)
        if persistent and self.save_dir:
            self._save_state(iteration)
        return line

    def hash_check_allowed(self, iteration: int) -> bool:
        """Whether all data-parallel replicas hold the same weights now: every fragment was
        averaged over every group at `iteration` and nothing is in flight."""
        return self.engine.last_synced_step == iteration and self.engine.flight is None

    # --- the federation's state beside Megatron-LM's checkpoints ---------------------------------
    def _settings(self) -> dict:
        c = self.config
        return {"outer_optimizer": c.outer_optimizer, "outer_lr": c.resolved_outer_lr,
                "outer_momentum": c.outer_momentum, "sync_dtype": c.sync_dtype, "error_feedback": c.error_feedback,
                "fragments": c.fragments, "overlap_steps": c.overlap_steps, "topology": c.topology,
                "ada_graphs": c.ada_graphs, "inner_state": c.inner_state}

    def _save_state(self, iteration: int) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        # each group's own moments: Megatron-LM keeps one group's (averaged or reset ones are equal)
        inner = self.shards.inner_state_shards() if self.config.inner_state == "keep" else None
        saved_state.save_state(saved_state.rank_file(self.save_dir, iteration, rank, world), self.engine, inner,
                               self._settings())
        if rank == 0:
            saved_state.prune(self.save_dir, iteration)

    def resume(self, load_dir: str, iteration: int, load_inner: bool = True) -> None:
        """Read the state saved beside Megatron-LM's checkpoint of `iteration`. Without it, the
        plain fp32 FedAvg goes on with a warning; any other sync refuses to resume."""
        path = saved_state.rank_file(load_dir, iteration, dist.get_rank(), dist.get_world_size())
        if not path.is_file():
            found = sorted(p.name for p in path.parent.glob("rank_*.safetensors")) if path.parent.is_dir() else []
            where = (f"was saved by another world size ({found[0]}, ...)" if found else
                     f"is not in {load_dir}/fl_megatron (a checkpoint of a run without the federated loop, of an "
                     "older fl-megatron, or a non-persistent one)")
            c = self.config
            if not c.plain_average or c.fragments > 1 or c.gossip:
                raise FileNotFoundError(
                    f"fl-megatron: {path} is missing: the federation state of iteration {iteration} {where}, and this "
                    f"run's sync ({self._describe()}) needs it to resume; to start the federation afresh from these "
                    "weights, load them with --finetune (or resume with the plain fp32 FedAvg)")
            self.engine.last_synced_step = iteration  # the weights of a checkpoint are synced
            self._say(f"fl-megatron: WARNING: {path} is missing: the federation state of iteration {iteration} "
                      f"{where}; the plain FedAvg goes on, "
                      + ("with every group's Adam moments taken from the group that Megatron-LM saved"
                         if c.inner_state == "keep" else "which needs nothing else"))
            return
        with cpu_compat():
            saved_state.load_state(path, self.engine, self._settings(), load_inner, self._say)
        self._say(f"fl-megatron: resumed the federation state of iteration {iteration} (last full average at "
                  f"{self.engine.last_synced_step})")
