"""ModelConfig <-> Hugging Face config.json (LlamaForCausalLM, GPT2LMHeadModel)."""

from typing import Any

from ..config.model import ModelConfig

# Values transformers uses when a config.json leaves a field out (LlamaConfig / GPT2Config).
_LLAMA_DEFAULTS = {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                   "tie_word_embeddings": False, "initializer_range": 0.02}
_GPT2_DEFAULTS = {"n_positions": 1024, "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True,
                  "initializer_range": 0.02, "activation_function": "gelu_new"}
_GPT2_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def hf_config(cfg: ModelConfig, torch_dtype: str) -> dict[str, Any]:
    """config.json contents for `cfg`, with weights stored as `torch_dtype` (e.g. "bfloat16")."""
    cfg.validate()
    common = {"initializer_range": cfg.init_std, "tie_word_embeddings": cfg.tie_embeddings,
              "vocab_size": cfg.vocab_size, "bos_token_id": None, "eos_token_id": None,
              "pad_token_id": None, "use_cache": True,
              "torch_dtype": torch_dtype, "dtype": torch_dtype}  # transformers 4.x / 5.x spelling
    if cfg.arch == "gpt":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers, "n_head": cfg.num_attention_heads,
                "n_inner": cfg.ffn_hidden_size, "n_positions": cfg.max_position_embeddings,
                "layer_norm_epsilon": cfg.norm_eps, "activation_function": "gelu_new",
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                "reorder_and_upcast_attn": False, **common}
    scaling = None
    if cfg.rope_scaling_factor is not None:
        scaling = {"rope_type": "llama3", "factor": cfg.rope_scaling_factor,
                   "low_freq_factor": cfg.rope_low_freq_factor,
                   "high_freq_factor": cfg.rope_high_freq_factor,
                   "original_max_position_embeddings": cfg.rope_original_max_position}
    # 4.x reads rope_theta + rope_scaling; 5.x reads rope_parameters (and still accepts the 4.x pair)
    parameters = {"rope_type": "default", **(scaling or {}), "rope_theta": cfg.rope_theta}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta, "rope_scaling": scaling, "rope_parameters": parameters,
            "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
            **common}


def generation_config(cfg: ModelConfig) -> dict[str, Any]:
    """generation_config.json contents: greedy decoding, no known special tokens."""
    cfg.validate()
    return {"do_sample": False, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}


def _unsupported(field: str, value, why: str) -> ValueError:
    return ValueError(f"unsupported Hugging Face config: {field}={value!r} ({why})")


def _required(hf: dict, field: str):
    if hf.get(field) is None:
        raise ValueError(f"Hugging Face config has no {field!r}")
    return hf[field]


def _get(hf: dict, field: str, defaults: dict):
    value = hf.get(field)
    return defaults[field] if value is None else value


def _check_architecture(hf: dict, expected: str) -> None:
    archs = hf.get("architectures")
    if archs is not None and list(archs) != [expected]:
        raise _unsupported("architectures", archs, f"only {expected} is supported")


def _llama_rope(hf: dict) -> dict[str, Any]:
    """rope_theta and our rope_* fields from the 4.x (rope_theta + rope_scaling) or 5.x form."""
    # transformers gives rope_scaling priority over rope_parameters
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = hf.get(field) or {}
    if not isinstance(rope, dict):
        raise _unsupported(field, rope, "expected a JSON object")
    if rope and all(isinstance(v, dict) for v in rope.values()):
        raise _unsupported(field, rope, "per-layer-type RoPE parameters")
    theta = rope.get("rope_theta", _get(hf, "rope_theta", _LLAMA_DEFAULTS))
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise _unsupported("partial_rotary_factor", partial, "RoPE must cover the whole head")
    kind = rope.get("rope_type", rope.get("type", "default"))
    out = {"rope_theta": float(theta)}
    if kind == "default":
        return out
    if kind != "llama3":
        raise _unsupported(f"{field}.rope_type", kind, "only 'default' and 'llama3' are supported")
    values = {key: rope.get(key) for key in _LLAMA3_ROPE_KEYS}
    if values["original_max_position_embeddings"] is None:  # transformers' default
        values["original_max_position_embeddings"] = _get(hf, "max_position_embeddings", _LLAMA_DEFAULTS)
    for key, value in values.items():
        if value is None:
            raise ValueError(f"Hugging Face config: {field} of rope_type 'llama3' has no {key!r}")
    out.update(rope_scaling_factor=float(values["factor"]),
               rope_low_freq_factor=float(values["low_freq_factor"]),
               rope_high_freq_factor=float(values["high_freq_factor"]),
               rope_original_max_position=int(values["original_max_position_embeddings"]))
    return out


def _llama_from_hf(hf: dict) -> ModelConfig:
    _check_architecture(hf, "LlamaForCausalLM")
    for field in ("attention_bias", "mlp_bias"):
        if hf.get(field):
            raise _unsupported(field, hf[field], "our Llama has no biases")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise _unsupported("hidden_act", act, "our Llama MLP uses silu")
    hidden, heads = _required(hf, "hidden_size"), _required(hf, "num_attention_heads")
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * heads != hidden:
        raise _unsupported("head_dim", head_dim, f"must be hidden_size/num_attention_heads = "
                                                 f"{hidden}/{heads}")
    kv = hf.get("num_key_value_heads") or heads
    return ModelConfig(
        arch="llama", num_layers=_required(hf, "num_hidden_layers"), hidden_size=hidden,
        ffn_hidden_size=_required(hf, "intermediate_size"), num_attention_heads=heads,
        num_query_groups=None if kv == heads else kv, vocab_size=_required(hf, "vocab_size"),
        max_position_embeddings=_get(hf, "max_position_embeddings", _LLAMA_DEFAULTS),
        norm_eps=float(_get(hf, "rms_norm_eps", _LLAMA_DEFAULTS)),
        tie_embeddings=bool(_get(hf, "tie_word_embeddings", _LLAMA_DEFAULTS)),
        init_std=float(_get(hf, "initializer_range", _LLAMA_DEFAULTS)), **_llama_rope(hf))


def _gpt2_from_hf(hf: dict) -> ModelConfig:
    _check_architecture(hf, "GPT2LMHeadModel")
    act = _get(hf, "activation_function", _GPT2_DEFAULTS)
    if act not in _GPT2_TANH_GELUS:
        raise _unsupported("activation_function", act,
                           f"our GPT MLP uses tanh GELU: one of {', '.join(_GPT2_TANH_GELUS)}")
    for field, allowed in (("scale_attn_by_inverse_layer_idx", False), ("add_cross_attention", False),
                           ("scale_attn_weights", True)):
        if field in hf and bool(hf[field]) != allowed:
            raise _unsupported(field, hf[field], f"only {str(allowed).lower()} is supported")
    hidden = _required(hf, "n_embd")
    return ModelConfig(
        arch="gpt", num_layers=_required(hf, "n_layer"), hidden_size=hidden,
        ffn_hidden_size=hf.get("n_inner") or 4 * hidden, num_attention_heads=_required(hf, "n_head"),
        vocab_size=_required(hf, "vocab_size"),
        max_position_embeddings=_get(hf, "n_positions", _GPT2_DEFAULTS),
        norm_eps=float(_get(hf, "layer_norm_epsilon", _GPT2_DEFAULTS)),
        tie_embeddings=bool(_get(hf, "tie_word_embeddings", _GPT2_DEFAULTS)),
        init_std=float(_get(hf, "initializer_range", _GPT2_DEFAULTS)))


def model_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig for a config.json dict; ValueError names any field we cannot represent.

    Not carried by Hugging Face, so reset to ModelConfig defaults: the rope_* fields of GPT
    models and of Llama models without RoPE scaling. num_query_groups equal to the head
    count comes back as None (the same model).
    """
    model_type = hf.get("model_type")
    if model_type == "llama":
        cfg = _llama_from_hf(hf)
    elif model_type == "gpt2":
        cfg = _gpt2_from_hf(hf)
    else:
        raise _unsupported("model_type", model_type, "supported: llama, gpt2")
    cfg.validate()
    return cfg
