"""The workload of a configured run: parameter counts, dtypes, batch and compute time per step."""

from typing import Optional

from ..config import ResolvedRun
from ..costs import working_bytes
from ..models import build_model
from .flops import compute_seconds as flops_seconds
from .timing import Workload

# DeepSpeed's default stage3_max_live_parameters: parameters kept gathered between forward and backward
DEEPSPEED_MAX_LIVE_PARAMETERS = 1_000_000_000


def parameter_counts(model_cfg) -> tuple[int, int, int]:
    """(all parameters, those outside the transformer blocks, number of blocks) on the meta device."""
    model = build_model(model_cfg, "meta")
    total = sum(p.numel() for p in model.parameters())
    blocks = sum(p.numel() for block in model.layers for p in block.parameters())
    return total, total - blocks, len(model.layers)


def gradient_bytes(cfg) -> int:
    """Bytes per gradient element reduced in a step: FSDP2 and megatron reduce (megatron also
    accumulates) in fp32 unless --grad-reduce-dtype bf16; DeepSpeed in the model dtype."""
    param_bytes = working_bytes(cfg.training.bf16)
    if cfg.parallel.backend == "deepspeed" or cfg.training.grad_reduce_dtype == "bf16":
        return param_bytes
    return 4


def regathered_params(backend: str, num_params: int, root_params: int, deepspeed: Optional[dict]) -> int:
    """Parameters the backward pass gathers again: FSDP2 keeps the root module (embeddings, final
    norm, output layer) gathered from forward to backward; DeepSpeed keeps up to
    stage3_max_live_parameters gathered."""
    if backend == "deepspeed":
        zero = (deepspeed or {}).get("zero_optimization") or {}
        live = zero.get("stage3_max_live_parameters", DEEPSPEED_MAX_LIVE_PARAMETERS)
        return max(0, num_params - int(live))
    return num_params - root_params


def workload_for(run: ResolvedRun, compute_seconds: Optional[float] = None,
                 counts: Optional[tuple[int, int, int]] = None, peak_tflops: Optional[float] = None) -> Workload:
    """The run's workload; compute time from --compute-seconds, else from FLOPs at --mfu of
    `peak_tflops` (a rate measured on the device), else of --peak-tflops."""
    cfg, t, c = run.cfg, run.cfg.training, run.cfg.cluster
    total, root, blocks = counts or parameter_counts(cfg.model)
    tokens_per_rank = t.micro_batch_size * run.accumulation * t.seq_length
    if compute_seconds is None:
        compute_seconds = c.compute_seconds
    if compute_seconds is None:
        compute_seconds = flops_seconds(total, cfg.model, t.seq_length, tokens_per_rank,
                                        peak_tflops or c.peak_tflops, c.mfu,
                                        t.recompute_activations)
    param_bytes = working_bytes(t.bf16)
    grad_bytes = gradient_bytes(cfg)
    return Workload(num_params=total, regathered_params=regathered_params(cfg.parallel.backend, total, root,
                                                                          cfg.deepspeed),
                    units=blocks + 1, param_bytes=param_bytes, grad_bytes=grad_bytes,
                    micro_batches=run.accumulation, tokens_per_step=run.tokens_per_step,
                    compute_seconds=compute_seconds, eval_forwards=t.eval_iters,
                    master_bytes=cfg.federation.sync_bytes_per_element,
                    sync_gathered=bool(cfg.federation.topk_density),
                    gathered_once=cfg.parallel.backend == "megatron")
