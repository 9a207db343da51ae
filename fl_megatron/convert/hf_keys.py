"""Our parameter names <-> Hugging Face tensor names, as data, with one streaming loop each way.

Our names and HF names are templates where "{i}" is the layer index. Several of our tensors
mapping to one HF name are concatenated along our dim 0 in table order (GPT-2's fused q|k|v).
HF names in a TRANSPOSED set are stored as [in, out] (GPT-2 Conv1D), the transpose of ours.
"""

import dataclasses
import functools
import re
from collections.abc import Callable, Iterator

import torch

from ..config.model import ModelConfig
from ..models import build_model

LLAMA_KEYS: dict[str, str] = {
    "embed.weight": "model.embed_tokens.weight",
    "layers.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.attn.q_proj.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.attn.k_proj.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.attn.v_proj.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.attn.o_proj.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.mlp_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.mlp.gate_proj.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.mlp.up_proj.weight": "model.layers.{i}.mlp.up_proj.weight",
    "layers.{i}.mlp.down_proj.weight": "model.layers.{i}.mlp.down_proj.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

GPT_KEYS: dict[str, str] = {
    "embed.weight": "transformer.wte.weight",
    "pos_embed.weight": "transformer.wpe.weight",
    "layers.{i}.attn_norm.weight": "transformer.h.{i}.ln_1.weight",
    "layers.{i}.attn_norm.bias": "transformer.h.{i}.ln_1.bias",
    "layers.{i}.attn.q_proj.weight": "transformer.h.{i}.attn.c_attn.weight",
    "layers.{i}.attn.k_proj.weight": "transformer.h.{i}.attn.c_attn.weight",
    "layers.{i}.attn.v_proj.weight": "transformer.h.{i}.attn.c_attn.weight",
    "layers.{i}.attn.q_proj.bias": "transformer.h.{i}.attn.c_attn.bias",
    "layers.{i}.attn.k_proj.bias": "transformer.h.{i}.attn.c_attn.bias",
    "layers.{i}.attn.v_proj.bias": "transformer.h.{i}.attn.c_attn.bias",
    "layers.{i}.attn.o_proj.weight": "transformer.h.{i}.attn.c_proj.weight",
    "layers.{i}.attn.o_proj.bias": "transformer.h.{i}.attn.c_proj.bias",
    "layers.{i}.mlp_norm.weight": "transformer.h.{i}.ln_2.weight",
    "layers.{i}.mlp_norm.bias": "transformer.h.{i}.ln_2.bias",
    "layers.{i}.mlp.fc_in.weight": "transformer.h.{i}.mlp.c_fc.weight",
    "layers.{i}.mlp.fc_in.bias": "transformer.h.{i}.mlp.c_fc.bias",
    "layers.{i}.mlp.fc_out.weight": "transformer.h.{i}.mlp.c_proj.weight",
    "layers.{i}.mlp.fc_out.bias": "transformer.h.{i}.mlp.c_proj.bias",
    "norm.weight": "transformer.ln_f.weight",
    "norm.bias": "transformer.ln_f.bias",
    "output.weight": "lm_head.weight",
}

GPT_TRANSPOSED: frozenset[str] = frozenset({
    "transformer.h.{i}.attn.c_attn.weight", "transformer.h.{i}.attn.c_proj.weight",
    "transformer.h.{i}.mlp.c_fc.weight", "transformer.h.{i}.mlp.c_proj.weight"})

KEYS = {"llama": LLAMA_KEYS, "gpt": GPT_KEYS}
TRANSPOSED = {"llama": frozenset(), "gpt": GPT_TRANSPOSED}
TIED_OUTPUT = "output.weight"  # absent from our model and from HF files when embeddings are tied

_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)")


def _keys(cfg: ModelConfig) -> dict[str, str]:
    keys = KEYS[cfg.arch]
    return {k: v for k, v in keys.items() if not (cfg.tie_embeddings and k == TIED_OUTPUT)}


def our_names(cfg: ModelConfig) -> list[str]:
    """Our parameter names in conversion order: root tensors before the layers, layers, the rest."""
    keys = _keys(cfg)
    layer = [t for t in keys if "{i}" in t]
    first = list(keys).index(layer[0])
    head = [t for t in list(keys)[:first] if "{i}" not in t]
    tail = [t for t in list(keys)[first:] if "{i}" not in t]
    return head + [t.format(i=i) for i in range(cfg.num_layers) for t in layer] + tail


def _plan(cfg: ModelConfig) -> dict[str, list[str]]:
    """HF name -> our names concatenated into it, in conversion order."""
    keys, plan = _keys(cfg), {}
    for name in our_names(cfg):
        template, i = _template(name)
        plan.setdefault(keys[template].format(i=i), []).append(name)
    return plan


def hf_names_for(cfg: ModelConfig) -> list[str]:
    """HF tensor names of `cfg`'s checkpoint, in the order export_tensors yields them."""
    return list(_plan(cfg))


@functools.lru_cache(maxsize=16)
def _shapes(key: tuple) -> dict[str, tuple[int, ...]]:
    model = build_model(ModelConfig(*key), "meta")
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def our_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter name -> shape (from a meta-device build, cached per config)."""
    return dict(_shapes(dataclasses.astuple(cfg)))


def hf_tensor_specs(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, HF shape) for every tensor of `cfg`'s checkpoint, in export order."""
    shapes, specs = our_shapes(cfg), []
    transposed = TRANSPOSED[cfg.arch]
    for hf_name, parts in _plan(cfg).items():
        shape = list(shapes[parts[0]])
        shape[0] = sum(shapes[p][0] for p in parts)
        if _hf_template(hf_name) in transposed:
            shape.reverse()
        specs.append((hf_name, tuple(shape)))
    return specs


def _template(our_name: str) -> tuple[str, int | None]:
    match = _LAYER_NAME.fullmatch(our_name)
    return ("layers.{i}." + match[2], int(match[1])) if match else (our_name, None)


def _hf_template(hf_name: str) -> str:
    return re.sub(r"\.\d+\.", ".{i}.", hf_name, count=1)


def export_tensors(cfg: ModelConfig, get: Callable[[str], torch.Tensor]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, contiguous HF tensor) one at a time, calling `get(our_name)` once per name.

    Tensors keep the dtype and device `get` returns them in.
    """
    transposed = TRANSPOSED[cfg.arch]
    for hf_name, parts in _plan(cfg).items():
        tensors = [get(name).detach() for name in parts]
        tensor = torch.cat(tensors, dim=0) if len(tensors) > 1 else tensors[0]
        if _hf_template(hf_name) in transposed:
            tensor = tensor.T
        yield hf_name, tensor.contiguous()


@dataclasses.dataclass(frozen=True)
class Location:
    """Where our tensor lives in the HF checkpoint: rows [offset, offset + rows) of the HF tensor
    along `dim` (1 for transposed Conv1D weights, whose columns are our rows)."""
    hf_name: str
    dim: int
    offset: int
    rows: int
    shape: tuple[int, ...]


def locate(cfg: ModelConfig, our_name: str) -> Location:
    """The HF tensor and range holding our parameter `our_name`; ValueError for unknown names."""
    shapes = our_shapes(cfg)
    if our_name not in shapes:
        raise ValueError(f"{our_name!r} is not a parameter of this {cfg.arch} model")
    keys = _keys(cfg)
    template, i = _template(our_name)
    hf_template = keys[template]
    siblings = [t.format(i=i) for t in keys if keys[t] == hf_template]
    offset = sum(shapes[s][0] for s in siblings[:siblings.index(our_name)])
    dim = 1 if hf_template in TRANSPOSED[cfg.arch] else 0
    return Location(hf_template.format(i=i), dim, offset, shapes[our_name][0], shapes[our_name])


def _check(our_name: str, tensor: torch.Tensor, shape: tuple[int, ...], loc: Location) -> torch.Tensor:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{our_name!r} from HF tensor {loc.hf_name!r}: expected shape {shape}, "
                         f"found {tuple(tensor.shape)}")
    return tensor.contiguous()


def import_tensor(cfg: ModelConfig, our_name: str, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """Our full tensor `our_name`, built from `read(hf_name)` (which returns a whole HF tensor)."""
    loc = locate(cfg, our_name)
    tensor = read(loc.hf_name)
    if loc.dim == 1:
        tensor = tensor.T
    return _check(our_name, tensor[loc.offset:loc.offset + loc.rows], loc.shape, loc)


ReadSlice = Callable[[str, int, int, int], torch.Tensor]
"""read_slice(hf_name, dim, start, stop): elements [start, stop) of the HF tensor along dim 0 or 1."""


def import_rows(cfg: ModelConfig, our_name: str, start: int, stop: int, read_slice: ReadSlice
                ) -> torch.Tensor:
    """Rows [start, stop) of our tensor `our_name`, reading only those rows (or columns) from HF."""
    loc = locate(cfg, our_name)
    if not 0 <= start <= stop <= loc.rows:
        raise ValueError(f"rows [{start}, {stop}) are outside {our_name!r} of shape {loc.shape}")
    tensor = read_slice(loc.hf_name, loc.dim, loc.offset + start, loc.offset + stop)
    if loc.dim == 1:
        tensor = tensor.T
    return _check(our_name, tensor, (stop - start,) + loc.shape[1:], loc)
