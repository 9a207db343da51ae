"""megatron-core's GPTModel built from our model flags (Llama 3 / 3.1 and GPT-2 shapes)."""

import importlib.util
import warnings

import torch
import torch.nn.functional as F

from ..config.model import ModelConfig
from ..config.training import TrainingConfig


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's GELU (tanh approximation), as our GPT model computes it."""
    return F.gelu(x, approximate="tanh")


def quiet_import_megatron():
    """Import megatron-core, hiding its notices that Transformer Engine and Apex are absent (it
    falls back to torch then; with NVIDIA Apex installed it uses Apex's fused kernels itself)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed.*")
        warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer import TransformerConfig
    return GPTModel, get_gpt_layer_local_spec, TransformerConfig


def softmax_fusion() -> bool:
    """Whether megatron-core may use Megatron-LM's fused softmax kernels: on CUDA, and only where
    those compiled modules are installed (a Megatron-LM build; the megatron-core wheel lacks them,
    and its bf16 attention would import them at the first forward and fail)."""
    return torch.cuda.is_available() and all(
        importlib.util.find_spec(name) is not None
        for name in ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda", "scaled_softmax_cuda"))


def transformer_config(cfg: ModelConfig, training: TrainingConfig, on_cpu: bool = True):
    """megatron-core's TransformerConfig for our model (no dropout, weights filled by us;
    parameters created on the CPU or on the current CUDA device)."""
    _, _, TransformerConfig = quiet_import_megatron()
    llama = cfg.arch == "llama"
    dtype = torch.bfloat16 if training.bf16 else torch.float32
    extra = {}
    if training.recompute_activations:
        extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")
        return TransformerConfig(
            num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
            num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.kv_heads, kv_channels=cfg.head_dim,
            normalization="RMSNorm" if llama else "LayerNorm", layernorm_epsilon=cfg.norm_eps,
            gated_linear_unit=llama, activation_func=F.silu if llama else gelu_tanh, add_bias_linear=not llama,
            hidden_dropout=0.0, attention_dropout=0.0, bf16=training.bf16, params_dtype=dtype,
            pipeline_dtype=dtype, attention_softmax_in_fp32=True, use_cpu_initialization=on_cpu,
            perform_initialization=False, masked_softmax_fusion=softmax_fusion(),
            bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False, **extra)


def build_gpt_model(cfg: ModelConfig, training: TrainingConfig, pg_collection, on_cpu: bool = True):
    """GPTModel with the local (megatron-core only) layer spec, weights unset."""
    problems = cfg.megatron_problems()
    if problems:
        raise ValueError("--backend megatron cannot build this model: " + "; ".join(problems))
    GPTModel, get_gpt_layer_local_spec, _ = quiet_import_megatron()
    llama = cfg.arch == "llama"
    config = transformer_config(cfg, training, on_cpu)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
        spec = get_gpt_layer_local_spec(normalization=config.normalization)
    rope = dict(position_embedding_type="rope", rotary_base=cfg.rope_theta,
                rope_scaling=cfg.rope_scaling_factor is not None,
                rope_scaling_factor=cfg.rope_scaling_factor or 8.0) if llama else \
        dict(position_embedding_type="learned_absolute")
    model = GPTModel(config, spec, vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings,
                     share_embeddings_and_output_weights=cfg.tie_embeddings, pg_collection=pg_collection, **rope)
    return config, model
