"""Pieces of the Megatron-LM integration tests: megatron-core set up the way Megatron-LM does it
(parallel_state with N distributed-optimizer instances, GPTModel, DDP, get_megatron_optimizer)
on CPU ranks, a recorder of which process groups the collectives use, and a fake args object."""

import argparse

import torch
import torch.distributed as dist

from fl_megatron.backends.megatron_cpu import cpu_compat, install_cpu_rng_tracker
from fl_megatron.federation.ledger import CollectiveCounter

VOCAB, SEQ, BATCH = 64, 16, 2


class GroupRecorder(CollectiveCounter):
    """CollectiveCounter that also records (operator, ranks of its process group, payload bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(func, "namespace", "") == "c10d":
            before = self.total_bytes
            out = super().__torch_dispatch__(func, types, args, kwargs)
            for a in args:
                if isinstance(a, torch.ScriptObject):
                    try:
                        ranks = tuple(dist.get_process_group_ranks(dist.ProcessGroup.unbox(a)))
                    except RuntimeError:
                        continue  # a ReduceOp
                    self.ops.append((func._schema.name.split("::")[-1], ranks, self.total_bytes - before))
            return out
        return super().__torch_dispatch__(func, types, args, kwargs)


def build(n: int, *, bf16: bool, overlap: bool, average_in_collective: bool = False, seed: int = 1234):
    """(DDP-wrapped GPTModel, megatron optimizer) with N instances; parallel_state initialised."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1, num_distributed_optimizer_instances=n)
    with cpu_compat():
        torch.manual_seed(seed)
        install_cpu_rng_tracker(seed)
        dtype = torch.bfloat16 if bf16 else torch.float32
        config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                                   use_cpu_initialization=True, bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype,
                                   hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False,
                                   bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False)
        model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB, max_sequence_length=SEQ,
                         position_embedding_type="rope")
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                                   overlap_grad_reduce=overlap, overlap_param_gather=overlap,
                                                   num_distributed_optimizer_instances=n,
                                                   average_in_collective=average_in_collective)
        ddp = DistributedDataParallel(config, ddp_config, model)
        opt_config = OptimizerConfig(optimizer="adam", lr=1e-2, bf16=bf16, params_dtype=dtype, clip_grad=1.0,
                                     use_distributed_optimizer=True)
        optimizer = get_megatron_optimizer(opt_config, [ddp])
    return ddp, optimizer


def batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)


def forward_backward(ddp, tokens: torch.Tensor) -> None:
    with cpu_compat():
        ddp.zero_grad_buffer()
        positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
        loss = ddp(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean()
        loss.backward()


def finish(ddp) -> None:
    with cpu_compat():
        ddp.finish_grad_sync()


def step(optimizer) -> None:
    with cpu_compat():
        ok, _, _ = optimizer.step()
        assert ok
        optimizer.zero_grad()


def train_step(ddp, optimizer, tokens: torch.Tensor) -> None:
    forward_backward(ddp, tokens)
    finish(ddp)
    step(optimizer)


def _buckets(ddp) -> list:
    return [bucket for buffer in ddp.buffers for bucket in buffer.buckets]


def grad_buffers(ddp) -> torch.Tensor:
    return torch.cat([b.grad_data.reshape(-1) for b in _buckets(ddp)])


def own_grad_mask(ddp) -> torch.Tensor:
    """Which elements of `grad_buffers` this rank's reduce-scatter result lands in."""
    group = ddp.intra_dp_cp_group
    masks = []
    for b in _buckets(ddp):
        mask = torch.zeros(b.grad_data.numel(), dtype=torch.bool)
        part = b.grad_data.numel() // group.size()
        mask[group.rank() * part:(group.rank() + 1) * part] = True
        masks.append(mask)
    return torch.cat(masks)


def params_flat(ddp) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in ddp.module.parameters()])


def gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def megatron_args(**overrides) -> argparse.Namespace:
    """Megatron-LM's args as validate_federation_args reads them (after its validate_args)."""
    values = dict(world_size=16, rank=1, tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                  context_parallel_size=1, num_distributed_optimizer_instances=4, use_distributed_optimizer=True,
                  use_precision_aware_optimizer=False, overlap_param_gather=False,
                  overlap_param_gather_with_optimizer_step=False, ddp_average_in_collective=False,
                  calculate_per_token_loss=False, check_weight_hash_across_dp_replicas_interval=None,
                  save=None, save_interval=None, non_persistent_save_interval=None, num_experts=None,
                  use_torch_fsdp2=False, use_megatron_fsdp=False, use_tp_pp_dp_mapping=False, train_iters=100,
                  fl_num_groups=None, fl_sync_interval=None, fl_disable_sync=None, fl_bucket_mb=None,
                  fl_replica_split=None)
    values.update(overrides)
    return argparse.Namespace(**values)
