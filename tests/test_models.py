"""Tests for fl_megatron.models: parameter counts, parity with Hugging Face, init, meta builds."""

import dataclasses
import math

import pytest
import torch


from fl_megatron.config import ModelConfig  # noqa: E402
from fl_megatron.models import (PRESETS, build_model, count_parameters, get_preset,  # noqa: E402
                                init_model_, initial_value)

transformers = pytest.importorskip("transformers")


# ---------------------------------------------------------------- parameter counts

@pytest.mark.parametrize("name,expected", [
    ("llama3.1-8b", 8_030_261_248),
    ("llama3.1-70b", 70_553_706_496),
    ("llama3.2-1b", 1_235_814_400),
    ("gpt2-small", 124_439_808),
    ("gpt3-1.3b", 1_315_723_264),
    ("gpt3-6.7b", 6_658_404_352),
])
def test_preset_parameter_counts(name, expected):
    assert count_parameters(get_preset(name)) == expected


def test_tiny_counts_match_closed_form():
    c = get_preset("llama-tiny")
    h, f, v, n, kv = c.hidden_size, c.ffn_hidden_size, c.vocab_size, c.num_layers, c.kv_heads
    kv_dim = kv * (h // c.num_attention_heads)
    per_block = 2 * h * h + 2 * h * kv_dim + 3 * h * f + 2 * h
    assert (h, f, v, n, kv) == (256, 704, 4096, 4, 2)
    assert count_parameters(c) == 2 * v * h + n * per_block + h

    g = get_preset("gpt-tiny")
    h, f, v, n, p = g.hidden_size, g.ffn_hidden_size, g.vocab_size, g.num_layers, g.max_position_embeddings
    per_block = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
    assert count_parameters(g) == v * h + p * h + n * per_block + 2 * h


def test_presets_are_fresh_copies_and_unknown_name_lists_valid():
    cfg = get_preset("llama-tiny")
    cfg.num_layers = 99
    assert get_preset("llama-tiny").num_layers == 4
    PRESETS["gpt-tiny"].num_layers = 99
    assert PRESETS["gpt-tiny"].num_layers == 4
    with pytest.raises(ValueError, match="llama3.1-8b"):
        get_preset("no-such-model")


def test_tied_output_is_not_a_separate_parameter():
    for name, tied in [("llama3.2-1b", True), ("gpt2-small", True), ("llama-tiny", False)]:
        names = [n for n, _ in build_model(get_preset(name)).named_parameters()]
        assert len(names) == len(set(names))
        assert ("output.weight" in names) == (not tied)
        assert "embed.weight" in names


def test_blocks_hold_no_root_parameters():
    model = build_model(get_preset("llama-tiny"))
    assert isinstance(model.layers, torch.nn.ModuleList) and len(model.layers) == 4
    block_params = {id(p) for blk in model.layers for p in blk.parameters()}
    assert id(model.embed.weight) not in block_params
    assert id(model.norm.weight) not in block_params


# ---------------------------------------------------------------- Llama parity with HF

def _randomise_(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name and name.endswith("weight") else 0.2 * noise)


def _llama_cfg(scaled: bool, tied: bool) -> ModelConfig:
    extra = dict(rope_scaling_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                 rope_original_max_position=32) if scaled else {}
    return ModelConfig(arch="llama", num_layers=2, hidden_size=64, ffn_hidden_size=96,
                       num_attention_heads=4, num_query_groups=2, vocab_size=128,
                       max_position_embeddings=256, rope_theta=10000.0, norm_eps=1e-5,
                       tie_embeddings=tied, **extra)


def _hf_llama(cfg: ModelConfig):
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling_factor is not None:
        rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": cfg.rope_scaling_factor,
                "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor,
                "original_max_position_embeddings": cfg.rope_original_max_position}
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.norm_eps, rope_parameters=rope, tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False, mlp_bias=False)
    hf_cfg._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(hf_cfg).eval()


def _llama_key_map(cfg: ModelConfig) -> dict:
    """Our parameter name -> HF LlamaForCausalLM parameter name."""
    keys = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        keys["output.weight"] = "lm_head.weight"
    for i in range(cfg.num_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        keys[ours + "attn_norm.weight"] = hf + "input_layernorm.weight"
        keys[ours + "mlp_norm.weight"] = hf + "post_attention_layernorm.weight"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            keys[f"{ours}attn.{proj}.weight"] = f"{hf}self_attn.{proj}.weight"
        for proj in ("gate_proj", "up_proj", "down_proj"):
            keys[f"{ours}mlp.{proj}.weight"] = f"{hf}mlp.{proj}.weight"
    return keys


def _llama_logits(cfg, ids):
    ours = build_model(cfg, device="cpu").eval()
    _randomise_(ours, seed=1)
    hf = _hf_llama(cfg)
    ours_params = dict(ours.named_parameters())
    key_map = _llama_key_map(cfg)
    assert set(key_map) == set(ours_params)
    hf_params = dict(hf.named_parameters())
    with torch.no_grad():
        for k, hk in key_map.items():
            hf_params[hk].copy_(ours_params[k])
        if cfg.tie_embeddings:
            assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
        return ours(ids), hf(input_ids=ids).logits


@pytest.mark.parametrize("tied", [False, True])
def test_llama_matches_hf(tied):
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 48))  # longer than rope_original_max_position=32
    results = {}
    for scaled in (False, True):
        ours, theirs = _llama_logits(_llama_cfg(scaled, tied), ids)
        assert ours.shape == (2, 48, 128) and ours.dtype == torch.float32
        assert (ours - theirs).abs().max().item() <= 1e-4
        results[scaled] = ours
    assert (results[True] - results[False]).abs().max().item() > 1e-3


# ---------------------------------------------------------------- GPT parity with HF

def test_gpt_matches_hf_gpt2():
    cfg = ModelConfig(arch="gpt", num_layers=2, hidden_size=64, ffn_hidden_size=256,
                      num_attention_heads=4, vocab_size=128, max_position_embeddings=64,
                      norm_eps=1e-5, tie_embeddings=True)
    ours = build_model(cfg, device="cpu").eval()
    _randomise_(ours, seed=2)
    hf_cfg = transformers.GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.max_position_embeddings, n_embd=cfg.hidden_size,
        n_layer=cfg.num_layers, n_head=cfg.num_attention_heads, n_inner=cfg.ffn_hidden_size,
        activation_function="gelu_new", layer_norm_epsilon=cfg.norm_eps, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    hf_cfg._attn_implementation = "eager"
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    p = dict(ours.named_parameters())
    hp = dict(hf.named_parameters())
    copied = set()

    def put(hf_name, value, *ours_names):
        hp[hf_name].copy_(value)
        copied.update(ours_names)

    with torch.no_grad():
        put("transformer.wte.weight", p["embed.weight"], "embed.weight")
        put("transformer.wpe.weight", p["pos_embed.weight"], "pos_embed.weight")
        for part in ("weight", "bias"):
            put(f"transformer.ln_f.{part}", p[f"norm.{part}"], f"norm.{part}")
        for i in range(cfg.num_layers):
            o, h = f"layers.{i}.", f"transformer.h.{i}."
            for part in ("weight", "bias"):
                put(h + f"ln_1.{part}", p[o + f"attn_norm.{part}"], o + f"attn_norm.{part}")
                put(h + f"ln_2.{part}", p[o + f"mlp_norm.{part}"], o + f"mlp_norm.{part}")
            qkv = [o + f"attn.{x}_proj" for x in "qkv"]
            put(h + "attn.c_attn.weight", torch.cat([p[n + ".weight"].T for n in qkv], dim=1),
                *[n + ".weight" for n in qkv])
            put(h + "attn.c_attn.bias", torch.cat([p[n + ".bias"] for n in qkv]), *[n + ".bias" for n in qkv])
            # HF Conv1D stores weights as [in, out]: transpose ours.
            for hf_mod, our_mod in (("attn.c_proj", "attn.o_proj"), ("mlp.c_fc", "mlp.fc_in"),
                                    ("mlp.c_proj", "mlp.fc_out")):
                put(h + hf_mod + ".weight", p[o + our_mod + ".weight"].T, o + our_mod + ".weight")
                put(h + hf_mod + ".bias", p[o + our_mod + ".bias"], o + our_mod + ".bias")
        assert copied == set(p)
        ids = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(3))
        ours_logits, hf_logits = ours(ids), hf(input_ids=ids).logits
    assert ours_logits.shape == (2, 40, 128)
    assert (ours_logits - hf_logits).abs().max().item() <= 1e-4


# ---------------------------------------------------------------- initialisation

def test_initial_value_deterministic_and_keyed():
    cfg = get_preset("llama-tiny")
    a = initial_value(cfg, "layers.0.attn.q_proj.weight", (64, 32), seed=7)
    assert a.dtype == torch.float32 and a.device.type == "cpu"
    assert torch.equal(a, initial_value(cfg, "layers.0.attn.q_proj.weight", (64, 32), seed=7))
    assert not torch.equal(a, initial_value(cfg, "layers.0.attn.k_proj.weight", (64, 32), seed=7))
    assert not torch.equal(a, initial_value(cfg, "layers.0.attn.q_proj.weight", (64, 32), seed=8))
    wrapped = "layers.0._fsdp_wrapped_module.attn.q_proj.weight"
    assert torch.equal(a, initial_value(cfg, wrapped, (64, 32), seed=7))


def test_initial_value_std_and_kinds():
    cfg = dataclasses.replace(get_preset("llama-tiny"), init_std=0.02, num_layers=8)
    shape = (512, 512)
    w = initial_value(cfg, "layers.3.mlp.up_proj.weight", shape, seed=0)
    assert w.std().item() == pytest.approx(0.02, rel=0.02)
    assert w.mean().abs().item() < 1e-3
    scaled = 0.02 / math.sqrt(2 * 8)
    for name in ("layers.3.attn.o_proj.weight", "layers.3.mlp.down_proj.weight",
                 "layers.3.mlp.fc_out.weight", "layers.3.attn.out_proj.weight"):
        assert initial_value(cfg, name, shape, seed=0).std().item() == pytest.approx(scaled, rel=0.02)
    assert torch.equal(initial_value(cfg, "layers.0.attn_norm.weight", (16,), 0), torch.ones(16))
    assert torch.equal(initial_value(cfg, "norm.weight", (16,), 0), torch.ones(16))
    assert torch.equal(initial_value(cfg, "layers.0.mlp.fc_in.bias", (16,), 0), torch.zeros(16))
    assert initial_value(cfg, "embed.weight", (4096, 64), 0).std().item() == pytest.approx(0.02, rel=0.02)


def test_meta_build_allocates_nothing():
    model = build_model(get_preset("llama3.1-70b"), device="meta")  # ~280 GB if allocated
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())


@pytest.mark.parametrize("preset", ["llama-tiny", "gpt-tiny"])
def test_meta_then_to_empty_matches_direct_build(preset):
    cfg = dataclasses.replace(get_preset(preset), num_layers=2)
    if cfg.arch == "llama":
        cfg.rope_scaling_factor, cfg.rope_original_max_position = 8.0, 16
    direct = init_model_(build_model(cfg, device="cpu"), cfg, seed=5)
    late = build_model(cfg, device="meta").to_empty(device="cpu")
    init_model_(late, cfg, seed=5)
    for (n1, p1), (n2, p2) in zip(direct.named_parameters(), late.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    ids = torch.randint(0, cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(direct(ids), late(ids))
        other = init_model_(build_model(cfg, device="cpu"), cfg, seed=6)
        assert not torch.equal(direct(ids), other(ids))


def test_init_model_rejects_meta():
    model = build_model(get_preset("gpt-tiny"), device="meta")
    with pytest.raises(ValueError, match="meta"):
        init_model_(model, get_preset("gpt-tiny"), seed=0)


def test_bf16_logits_dtype():
    cfg = dataclasses.replace(get_preset("llama-tiny"), num_layers=1)
    model = init_model_(build_model(cfg, device="cpu"), cfg, seed=0).to(torch.bfloat16)
    with torch.no_grad():
        assert model(torch.randint(0, 4096, (1, 8))).dtype == torch.bfloat16


# ---------------------------------------------------------------- validation

@pytest.mark.parametrize("changes,numbers", [
    (dict(hidden_size=250, num_attention_heads=4), ("250", "4")),
    (dict(num_attention_heads=4, num_query_groups=3), ("num_query_groups=3", "num_attention_heads=4")),
    (dict(arch="gpt", num_query_groups=2), ("num_query_groups=2",)),
    (dict(arch="bert"), ("bert",)),
    (dict(vocab_size=0), ("vocab_size=0",)),
])
def test_invalid_configs_raise(changes, numbers):
    cfg = dataclasses.replace(get_preset("llama-tiny"), **changes)
    with pytest.raises(ValueError) as err:
        build_model(cfg)
    for text in numbers:
        assert text in str(err.value)
    with pytest.raises(ValueError, match="invalid model: ") as again:
        count_parameters(cfg)
    assert str(again.value) == str(err.value)  # the same check, the same words
