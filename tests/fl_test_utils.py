"""Shared pieces of the multi-rank tests: a tiny configuration and a step-by-step trainer."""

import torch
import torch.distributed as dist

from fl_megatron.config import RunConfig, resolve
from fl_megatron.costs import SPARSE_CHUNK
from fl_megatron.models import get_preset
from fl_megatron.training.launch import read_launch_env
from fl_megatron.training.trainer import Trainer


def tiny_config(run_dir: str, cache_dir: str, *, group_size: int, shard_size=None, sync_interval: int = 1,
                optimizer: str = "sgd", steps: int = 3, replica_split: bool = True, lr: float = 0.5,
                bf16: bool = False, backend: str = "fsdp2", deepspeed=None) -> RunConfig:
    """A 2-layer Llama with GQA on the demo data; plain SGD (no momentum, decay or clipping)."""
    cfg = RunConfig()
    cfg.model = get_preset("llama-tiny")
    cfg.preset = "llama-tiny"
    m = cfg.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size = 2, 64, 96
    m.num_attention_heads, m.num_query_groups, m.vocab_size = 4, 2, 512
    cfg.data.tokenizer_vocab_size = 512
    cfg.data.data_cache_dir = cache_dir
    t = cfg.training
    t.seq_length, t.micro_batch_size, t.train_iters = 32, 2, steps
    t.optimizer, t.lr, t.min_lr, t.lr_decay_style = optimizer, lr, 0.0, "constant"
    t.weight_decay, t.clip_grad, t.sgd_momentum = 0.0, 0.0, 0.0
    t.eval_iters, t.log_interval, t.run_dir, t.bf16 = 0, 1, run_dir, bf16
    cfg.parallel.backend = backend
    if backend == "deepspeed":
        cfg.deepspeed = deepspeed or {}
    f = cfg.federation
    f.group_size, f.hsdp_shard_size, f.sync_interval, f.replica_split = group_size, shard_size, sync_interval, replica_split
    return cfg


def make_trainer(cfg: RunConfig) -> Trainer:
    env = read_launch_env()
    return Trainer(resolve(cfg, env.world_size, env.local_world_size), env)


def train_and_gather(cfg: RunConfig):
    """Train `cfg` to the end; return (trainer, full fp32 state dict)."""
    trainer = make_trainer(cfg)
    trainer.train()
    state = trainer.backend.full_state_dict()
    trainer.close()
    return trainer, state


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def peers_identical(trainer, tensors=None) -> bool:
    """Whether this rank's shards (or `tensors`) equal, bit for bit, those of every peer in the
    other groups, on every rank."""
    same = True
    for shard in (trainer.backend.local_shards() if tensors is None else tensors):
        gathered = [torch.empty_like(shard) for _ in range(trainer.layout.num_groups)]
        dist.all_gather(gathered, shard.contiguous(), group=trainer.groups.peer)
        same &= all(torch.equal(g, gathered[0]) for g in gathered)
    flag = torch.tensor([1.0 if same else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def direct_variance(trainer) -> float:
    """Mean over parameter elements of the population variance across groups, from gathered shards."""
    sq, count = torch.zeros((), dtype=torch.float64), 0
    for shard in trainer.backend.local_shards():
        gathered = [torch.empty_like(shard) for _ in range(trainer.layout.num_groups)]
        dist.all_gather(gathered, shard.contiguous(), group=trainer.groups.peer)
        stacked = torch.stack(gathered).double()
        sq += stacked.var(dim=0, unbiased=False).sum()
        count += shard.numel()
    totals = torch.tensor([float(sq), float(count)], dtype=torch.float64)
    dist.all_reduce(totals)  # every group's rank holds the same values: the ratio is unchanged
    return float(totals[0] / totals[1])


def sync_outcome(trainer, results: list) -> dict:
    """What a run with a sick group ended with: the sick groups of each sync, whether the groups'
    shards agree bit for bit and are finite, and the error-feedback residuals' total magnitude."""
    return {"sick": [list(r.sick_groups) for r in results if r is not None],
            "identical": peers_identical(trainer),
            "finite": all(bool(torch.isfinite(s).all()) for s in trainer.backend.local_shards()),
            "residuals": sum(float(v.abs().sum()) for k, v in trainer.engine.state_tensors().items()
                             if "residual." in k)}


def sparse_sent(codec, carried: torch.Tensor) -> torch.Tensor:
    """What a SparseCodec sends of `carried` (one region, padded to whole chunks), decoded."""
    padded = torch.nn.functional.pad(carried, (0, -carried.numel() % SPARSE_CHUNK))
    _, indices, decoded = codec.encode(padded)
    return torch.zeros_like(padded).view(-1, SPARSE_CHUNK).scatter_(1, indices, decoded).view(-1)[:carried.numel()]
