"""Checkpoint files of the megatron backend: one safetensors file per rank of the shard group.

Each file holds that rank's fp32 main shards and the inner optimizer's state for them (with the
step counts a fused Adam keeps in its parameter groups, `group_step.{optimizer}.{group}`), plus an
index (in the safetensors metadata) naming the megatron parameter and the element range of the
flattened parameter each shard covers. Ranks write in parallel; nothing is pickled. A group's
parameters are re-assembled from its files one tensor at a time (`ShardFileReader`).

These checkpoints load into shard groups of the same size with the same model (the shard
ranges follow megatron's bucket layout); a different layout is refused with the reason.
megatron's own `dist_checkpointing` is not used: with the federation group as a
`ProcessGroupCollection` its validation sees every group's replica of the optimizer state.
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from ..file_modes import save_safetensors

INDEX_KEY = "fl_megatron_index"
FORMAT = "fl-megatron megatron-core shards v1"


def shard_file(directory: Path, rank: int, size: int) -> Path:
    return Path(directory) / f"megatron-shard-{rank:05d}-of-{size:05d}.safetensors"


def main_shard_entries(dist_opts: list):
    """(distributed optimizer, model parameter, its fp32 main shard, start, stop) for every main
    shard of this rank, in megatron's order (the same on every rank of a peer group); [start,
    stop) is the shard's range in the flattened parameter."""
    for opt in dist_opts:
        for model_groups, main_groups in ((opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                                          (opt.model_fp32_groups, opt.shard_fp32_groups)):
            for model_group, main_group in zip(model_groups, main_groups):
                for param, main in zip(model_group, main_group):
                    rng = opt._get_model_param_range_map(param)["param"]
                    yield opt, param, main, rng.start, rng.end


class MegatronShardFiles:
    """Saves and loads the main shards and optimizer state of megatron DistributedOptimizers."""

    def __init__(self, dist_opts: list, names: dict[int, str]) -> None:
        self.dist_opts, self.names = dist_opts, names

    def _entries(self):
        """(inner optimizer, model parameter name, main shard, start, stop) in a fixed order."""
        for opt, param, main, start, stop in main_shard_entries(self.dist_opts):
            yield opt.optimizer, self.names[id(param)], main, start, stop

    def _index(self) -> list[dict]:
        return [{"name": name, "start": start, "stop": stop} for _, name, _, start, stop in self._entries()]

    def save(self, directory: Path, shard_group) -> None:
        rank, size = dist.get_rank(shard_group), dist.get_world_size(shard_group)
        tensors = {}
        for k, (inner, _, main, _, _) in enumerate(self._entries()):
            tensors[f"main.{k}"] = main.detach().to("cpu", copy=True).contiguous()
            for key, value in inner.state.get(main, {}).items():
                if torch.is_tensor(value):
                    tensors[f"state.{k}.{key}"] = value.detach().to("cpu", copy=True).contiguous()
        for key, group in self._step_groups():
            if "step" in group:
                tensors[key] = torch.tensor(int(group["step"]), dtype=torch.int64)
        Path(directory).mkdir(parents=True, exist_ok=True)
        meta = {INDEX_KEY: json.dumps({"format": FORMAT, "shards": self._index()})}
        save_safetensors(tensors, shard_file(directory, rank, size), metadata=meta)

    @torch.no_grad()
    def load(self, directory: Path, shard_group, load_optimizer: bool) -> None:
        rank, size = dist.get_rank(shard_group), dist.get_world_size(shard_group)
        path = shard_file(directory, rank, size)
        if not path.is_file():
            found = sorted(p.name for p in Path(directory).glob("megatron-shard-*.safetensors"))
            raise ValueError(f"{path} is missing: the megatron checkpoint in {directory} holds "
                             f"{', '.join(found) or 'no shard files'}; it loads only into shard groups of "
                             "the size that saved it")
        saved = read_index(path)
        mine = self._index()
        if saved != mine:
            raise ValueError(f"{path} covers other parameter ranges than this run's distributed optimizer "
                             "(another model, shard-group size or bucket layout); megatron checkpoints load "
                             "only into the layout that saved them")
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            for k, (inner, _, main, _, _) in enumerate(self._entries()):
                main.copy_(f.get_tensor(f"main.{k}"))
                if load_optimizer:
                    prefix = f"state.{k}."
                    state = {key[len(prefix):]: f.get_tensor(key).to(main.device)
                             for key in keys if key.startswith(prefix)}
                    if state:
                        inner.state[main] = state
                    else:
                        inner.state.pop(main, None)
            if load_optimizer:
                for key, group in self._step_groups():
                    if key not in keys:
                        group.pop("step", None)
                    elif torch.is_tensor(group.get("step")):  # a capturable fused Adam's
                        group["step"].fill_(int(f.get_tensor(key)))
                    else:
                        group["step"] = int(f.get_tensor(key))

    def _step_groups(self):
        """(file key, parameter group) for every non-empty parameter group of the inner optimizers:
        where Transformer Engine's and Apex's FusedAdam keep their step counts."""
        for o, opt in enumerate(self.dist_opts):
            for g, group in enumerate(opt.optimizer.param_groups):
                if group["params"]:
                    yield f"group_step.{o}.{g}", group


def read_index(path: Path) -> list[dict]:
    """The shard index of one file; ValueError if it is not one of ours."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    try:
        index = json.loads(meta[INDEX_KEY])
    except (KeyError, ValueError) as exc:
        raise ValueError(f"{path} is not a megatron shard file of fl-megatron (no valid index)") from exc
    if index.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown format {index.get('format')!r} (expected {FORMAT!r})")
    return index["shards"]


class ShardFileReader:
    """Full fp32 megatron parameters of one saved group, assembled from its shard files."""

    def __init__(self, directory: Path, shapes: dict[str, tuple]) -> None:
        self.files = sorted(Path(directory).glob("megatron-shard-*.safetensors"))
        if not self.files:
            raise ValueError(f"{directory} holds no megatron shard files")
        self.shapes = shapes
        self.where: dict[str, list] = {}
        for path in self.files:
            for k, entry in enumerate(read_index(path)):
                self.where.setdefault(entry["name"], []).append((path, k, entry["start"], entry["stop"]))

    def __call__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        numel = int(torch.Size(shape).numel())
        flat = torch.empty(numel, dtype=torch.float32)
        covered = 0
        for path, k, start, stop in self.where.get(name, []):
            with safe_open(str(path), framework="pt") as f:
                flat[start:stop] = f.get_tensor(f"main.{k}")
            covered += stop - start
        if covered != numel:
            raise ValueError(f"the megatron checkpoint's shard files cover {covered} of the {numel} elements "
                             f"of {name}: files are missing or truncated")
        return flat.view(shape)
