"""Hugging Face conversion (fl_megatron.convert) checked against transformers, single process."""

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from fl_megatron.config import ModelConfig  # noqa: E402
from fl_megatron.convert import (SafetensorsDir, export_tensors, generation_config,  # noqa: E402
                                 hf_config, hf_names_for, hf_tensor_specs, import_rows, import_tensor,
                                 model_config_from_hf, our_names, write_hf_dir)
from fl_megatron.models import build_model, init_model_  # noqa: E402

pytestmark = pytest.mark.timeout(600)

_TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, init_std=0.05)
CASES = {
    "llama-gqa": ModelConfig(arch="llama", ffn_hidden_size=96, num_query_groups=2,
                             max_position_embeddings=256, rope_theta=10000.0, tie_embeddings=False, **_TINY),
    # wavelengths of head_dim 16 at theta 1e4 span 6..2e4, so original length 64 scales most of them
    "llama-tied-rope31": ModelConfig(arch="llama", ffn_hidden_size=96, max_position_embeddings=256,
                                     rope_theta=10000.0, rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
                                     rope_high_freq_factor=4.0, rope_original_max_position=64,
                                     norm_eps=1e-6, tie_embeddings=True, **_TINY),
    "gpt-untied": ModelConfig(arch="gpt", ffn_hidden_size=256, max_position_embeddings=128,
                              tie_embeddings=False, **_TINY),
    "gpt-tied": ModelConfig(arch="gpt", ffn_hidden_size=192, max_position_embeddings=128, norm_eps=1e-6,
                            tie_embeddings=True, **_TINY),
}
SEQ = 64


def _our_model(cfg: ModelConfig, seed: int = 0) -> torch.nn.Module:
    """Random init, plus random norm weights and biases so that no tensor is all ones or zeros."""
    model = build_model(cfg, "cpu").eval()
    init_model_(model, cfg, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
    return model


def _export(cfg, model, out_dir, **kwargs) -> dict[str, str]:
    params = dict(model.named_parameters())
    return write_hf_dir(out_dir, hf_config(cfg, "float32"), generation_config(cfg),
                        export_tensors(cfg, params.__getitem__), **kwargs)


def _load_hf(path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # every weight came from the files, none left random
    return model.eval()


def _files_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            out.update((name, f.get_tensor(name)) for name in f.keys())
    return out


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    cfg = CASES[request.param]
    model = _our_model(cfg)
    path = tmp_path_factory.mktemp(request.param) / "hf"
    _export(cfg, model, path)
    return SimpleNamespace(name=request.param, cfg=cfg, model=model, path=path, hf=_load_hf(path))


def _ids(cfg, shape, seed=0):
    return torch.randint(0, cfg.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- parity with transformers

@torch.no_grad()
def test_logits_match_transformers(case):
    ids = _ids(case.cfg, (2, SEQ))
    ours, theirs = case.model(ids), case.hf(input_ids=ids).logits
    assert theirs.shape == ours.shape == (2, SEQ, case.cfg.vocab_size)
    assert (ours - theirs).abs().max().item() <= 1e-4
    if case.cfg.rope_scaling_factor is not None:  # the scaling matters at this length
        unscaled = build_model(dataclasses.replace(case.cfg, rope_scaling_factor=None), "cpu")
        unscaled.load_state_dict(case.model.state_dict())
        assert (unscaled(ids) - theirs).abs().max().item() > 1e-3


@torch.no_grad()
def test_greedy_generation_matches_transformers(case):
    prompt = _ids(case.cfg, (2, SEQ - 20), seed=1)
    theirs = case.hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                              max_new_tokens=20)
    ours = prompt
    for _ in range(20):
        ours = torch.cat([ours, case.model(ours)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert theirs.shape == (2, SEQ)
    assert torch.equal(ours, theirs)


# ---------------------------------------------------------------- streaming and round trips

def test_export_pulls_each_tensor_once_lazily_in_order(case):
    params = dict(case.model.named_parameters())
    calls = []

    def get(name):
        calls.append(name)
        return params[name]

    stream = export_tensors(case.cfg, get)
    assert calls == []
    first_name, first = next(stream)
    assert (first_name, calls) == (hf_names_for(case.cfg)[0], ["embed.weight"])
    rest = list(stream)
    assert all(t.is_contiguous() for _, t in rest)
    names = [first_name] + [name for name, _ in rest]
    assert names == hf_names_for(case.cfg) == [n for n, _ in hf_tensor_specs(case.cfg)]
    assert calls == our_names(case.cfg) and sorted(calls) == sorted(params)
    assert ("lm_head.weight" in names) == (not case.cfg.tie_embeddings)


def test_round_trip_is_bit_identical(case, tmp_path):
    with SafetensorsDir(case.path) as src:
        src.check()
        cfg = src.model_config
        assert cfg == case.cfg
        state = {name: import_tensor(cfg, name, src.read) for name in our_names(cfg)}
    original = dict(case.model.named_parameters())
    assert state.keys() == original.keys()
    assert all(torch.equal(state[n], original[n]) and state[n].is_contiguous() for n in state)
    rebuilt = build_model(cfg, "cpu")
    rebuilt.load_state_dict(state, strict=True)
    _export(cfg, rebuilt, tmp_path / "again")
    first, second = _files_tensors(case.path), _files_tensors(tmp_path / "again")
    assert first.keys() == second.keys() == set(hf_names_for(cfg))
    for name in first:
        assert first[name].dtype == second[name].dtype == torch.float32
        assert torch.equal(first[name], second[name]), name
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == hf_config(cfg, "float32")


ROW_RANGES = {
    "llama": [("layers.1.attn.k_proj.weight", 3, 20), ("embed.weight", 7, 90),
              ("layers.0.mlp.down_proj.weight", 0, 64), ("layers.1.mlp_norm.weight", 10, 11)],
    "gpt": [("layers.1.attn.k_proj.weight", 5, 37), ("layers.0.attn.v_proj.bias", 0, 64),
            ("layers.0.mlp.fc_out.weight", 10, 50), ("layers.1.mlp.fc_in.weight", 100, 256),
            ("pos_embed.weight", 3, 4)],
}


@pytest.mark.parametrize("case", ["llama-gqa", "gpt-untied"], indirect=True)
def test_import_rows_reads_only_those_rows(case):
    cfg = case.cfg
    original = dict(case.model.named_parameters())
    with SafetensorsDir(case.path) as src:
        for name, start, stop in ROW_RANGES[cfg.arch]:
            reads = []

            def read_slice(hf_name, dim, a, b, reads=reads):
                reads.append(b - a)
                return src.read_slice(hf_name, dim, a, b)

            rows = import_rows(cfg, name, start, stop, read_slice)
            assert reads == [stop - start]
            assert torch.equal(rows, import_tensor(cfg, name, src.read)[start:stop])
            assert torch.equal(rows, original[name][start:stop])
        with pytest.raises(ValueError, match=r"rows \[0, 65\) are outside 'layers.0.attn.o_proj.weight'"):
            import_rows(cfg, "layers.0.attn.o_proj.weight", 0, 65, src.read_slice)
        with pytest.raises(ValueError, match="'layers.2.attn.q_proj.weight' is not a parameter"):
            import_tensor(cfg, "layers.2.attn.q_proj.weight", src.read)


# ---------------------------------------------------------------- configs

def test_config_round_trip(case):
    cfg = case.cfg
    written = hf_config(cfg, "float32")
    assert model_config_from_hf(json.loads(json.dumps(written))) == cfg
    # transformers 5 form: rope_theta only inside rope_parameters
    parsed = transformers.AutoConfig.from_pretrained(case.path).to_dict()
    assert "rope_theta" not in parsed
    assert model_config_from_hf(parsed) == cfg
    if cfg.arch == "llama":  # transformers 4.x form: rope_theta + rope_scaling (legacy "type" key)
        legacy = {k: v for k, v in written.items() if k != "rope_parameters"}
        if legacy["rope_scaling"]:
            legacy["rope_scaling"] = {("type" if k == "rope_type" else k): v
                                      for k, v in legacy["rope_scaling"].items()}
        assert model_config_from_hf(legacy) == cfg


def test_config_fields_hf_cannot_carry_are_reset():
    gpt = dataclasses.replace(CASES["gpt-tied"], rope_theta=1234.0)
    assert model_config_from_hf(hf_config(gpt, "float32")) == CASES["gpt-tied"]
    mha = dataclasses.replace(CASES["llama-gqa"], num_query_groups=4, rope_low_freq_factor=2.0)
    back = model_config_from_hf(hf_config(mha, "bfloat16"))
    assert back == dataclasses.replace(mha, num_query_groups=None, rope_low_freq_factor=1.0)


@pytest.mark.parametrize("case_name,patch,match", [
    ("llama-gqa", {"model_type": "mistral"}, "model_type='mistral'"),
    ("llama-gqa", {"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
    ("llama-gqa", {"attention_bias": True}, "attention_bias=True"),
    ("llama-gqa", {"mlp_bias": True}, "mlp_bias=True"),
    ("llama-gqa", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("llama-gqa", {"head_dim": 32}, "head_dim=32"),
    ("llama-gqa", {"hidden_size": None}, "no 'hidden_size'"),
    ("llama-tied-rope31", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
    ("llama-tied-rope31", {"rope_scaling": None, "rope_parameters": {"rope_type": "dynamic"}},
     r"rope_parameters.rope_type='dynamic'"),
    ("llama-tied-rope31", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "'low_freq_factor'"),
    ("gpt-tied", {"activation_function": "relu"}, "activation_function='relu'"),
    ("gpt-tied", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
    ("gpt-tied", {"add_cross_attention": True}, "add_cross_attention=True"),
])
def test_unsupported_config_is_named(case_name, patch, match):
    hf = {**hf_config(CASES[case_name], "float32"), **patch}
    with pytest.raises(ValueError, match=match):
        model_config_from_hf(hf)


# ---------------------------------------------------------------- sharding

@torch.no_grad()
def test_sharded_write_loads_in_transformers(tmp_path):
    cfg = CASES["llama-gqa"]
    model = _our_model(cfg, seed=3)
    path = tmp_path / "sharded"
    max_bytes = 40_000  # the 32 KiB embedding alone, then a few 16 KiB projections per shard
    weight_map = _export(cfg, model, path, max_shard_bytes=max_bytes)
    files = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(files) > 3 and "model.safetensors" not in files
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == weight_map and set(weight_map.values()) == set(files)
    sizes = {n: t.numel() * t.element_size() for n, t in _files_tensors(path).items()}
    assert index["metadata"]["total_size"] == sum(sizes.values())
    for file in files:
        assert sum(sizes[n] for n, f in weight_map.items() if f == file) <= max_bytes
    ids = _ids(cfg, (1, SEQ))
    assert (model(ids) - _load_hf(path)(input_ids=ids).logits).abs().max().item() <= 1e-4
    with SafetensorsDir(path) as src:
        assert all(torch.equal(import_tensor(cfg, n, src.read), p) for n, p in model.named_parameters())


# ---------------------------------------------------------------- bad input

def _write_tensors(path, cfg, tensors):
    write_hf_dir(path, hf_config(cfg, "float32"), None, tensors)


def test_missing_tensor_is_named(tmp_path):
    cfg = CASES["llama-gqa"]
    params = dict(_our_model(cfg).named_parameters())
    gone = "model.layers.1.mlp.up_proj.weight"
    _write_tensors(tmp_path / "hf", cfg, ((n, t) for n, t in export_tensors(cfg, params.__getitem__)
                                          if n != gone))
    with SafetensorsDir(tmp_path / "hf") as src:
        with pytest.raises(ValueError, match=f"tensor '{gone}' is missing from"):
            src.check()
        with pytest.raises(ValueError, match=f"tensor '{gone}' is missing"):
            import_tensor(cfg, "layers.1.mlp.up_proj.weight", src.read)


def test_wrong_shape_is_named(tmp_path):
    cfg = CASES["gpt-untied"]
    params = dict(_our_model(cfg).named_parameters())
    bad = "transformer.h.0.attn.c_attn.weight"
    _write_tensors(tmp_path / "hf", cfg, ((n, t[:, :96] if n == bad else t)
                                          for n, t in export_tensors(cfg, params.__getitem__)))
    with SafetensorsDir(tmp_path / "hf") as src:
        with pytest.raises(ValueError, match=rf"tensor '{bad}' .* has shape \(64, 96\), "
                                             r"expected \(64, 192\)"):
            import_rows(cfg, "layers.0.attn.q_proj.weight", 0, 8, src.read_slice)
        with pytest.raises(ValueError, match="expected"):
            src.check()


def test_missing_files_are_named(tmp_path):
    cfg = CASES["llama-gqa"]
    with pytest.raises(ValueError, match="directory .* does not exist"):
        SafetensorsDir(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config file .*config.json does not exist"):
        SafetensorsDir(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text(json.dumps(hf_config(cfg, "float32")))
    with pytest.raises(ValueError, match="has neither model.safetensors nor model.safetensors.index.json"):
        SafetensorsDir(tmp_path / "empty")
    _export(cfg, _our_model(cfg), tmp_path / "sharded", max_shard_bytes=40_000)
    second = sorted((tmp_path / "sharded").glob("model-00002-of-*.safetensors"))[0]
    second.unlink()
    with pytest.raises(ValueError, match=f"shard {second.name} named in"):
        SafetensorsDir(tmp_path / "sharded")


def test_unsupported_model_type_in_directory(tmp_path):
    cfg = CASES["gpt-tied"]
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**hf_config(cfg, "float32"),
                                                             "model_type": "gpt_neox"}))
    save_file({"x": torch.zeros(1)}, tmp_path / "hf" / "model.safetensors")
    with pytest.raises(ValueError, match="model_type='gpt_neox'"):
        SafetensorsDir(tmp_path / "hf")


def test_non_empty_output_dir_is_refused(tmp_path):
    cfg = CASES["gpt-tied"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="output directory .*out exists and is not empty"):
        _export(cfg, _our_model(cfg), out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_failed_write_leaves_nothing(tmp_path):
    cfg = CASES["llama-gqa"]
    params = dict(_our_model(cfg).named_parameters())
    stream = list(export_tensors(cfg, params.__getitem__))
    with pytest.raises(ValueError, match="tensor 'model.norm.weight' is given twice"):
        _write_tensors(tmp_path / "out", cfg, stream + [stream[-2]])

    def get(name):  # fails after a few shards have been written
        if name == "layers.1.mlp.down_proj.weight":
            raise RuntimeError("read error")
        return params[name]

    with pytest.raises(RuntimeError, match="read error"):
        write_hf_dir(tmp_path / "out", hf_config(cfg, "float32"), None, export_tensors(cfg, get),
                     max_shard_bytes=40_000)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "out").mkdir()  # an existing empty directory is fine and gets replaced
    _write_tensors(tmp_path / "out", cfg, stream)
    assert SafetensorsDir(tmp_path / "out").model_config == cfg
