"""The federation's own state beside Megatron-LM's checkpoints, so that a resumed run continues
exactly: each rank's outer-optimizer anchors and state, error-feedback residuals, the gossip
schedule, and (with --fl-inner-state keep) its own Adam moments.

Megatron-LM's distributed checkpoint stores one copy of every shard across data-parallel
replicas: the weights are the same in every group at a save (the loop syncs first), but the
moments are each group's own, so Megatron-LM alone would give every group one group's moments.

Layout: SAVE/fl_megatron/iter_0000008/rank_00003-of-00016.safetensors, one file per rank,
written (to a temporary name, then renamed) before Megatron-LM writes its checkpoint of that
iteration, so that its tracker file never names an iteration whose state is missing here.
"""

import json
import os
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open

from ..file_modes import save_safetensors

FORMAT = "fl-megatron megatron-lm federation state v1"
META_KEY = "fl_megatron_state"
# settings whose change makes the saved outer state meaningless (it then restarts from the weights)
OUTER_SETTINGS = ("outer_optimizer", "outer_lr", "outer_momentum", "sync_dtype", "error_feedback", "fragments",
                  "overlap_steps")


def state_dir(root: str, iteration: int) -> Path:
    return Path(root) / "fl_megatron" / f"iter_{iteration:07d}"


def rank_file(root: str, iteration: int, rank: int, world: int) -> Path:
    return state_dir(root, iteration) / f"rank_{rank:05d}-of-{world:05d}.safetensors"


def save_state(path: Path, engine, inner: Optional[list], settings: dict) -> None:
    """Write this rank's engine state (and `inner` moments, if given) to `path` atomically."""
    tensors = {f"engine.{k}": v.detach().to("cpu", copy=True).contiguous() for k, v in engine.state_tensors().items()}
    for i, t in enumerate(inner or []):
        tensors[f"inner.{i}"] = t.detach().to("cpu", copy=True).contiguous()
    meta = {"format": FORMAT, "last_synced_step": engine.last_synced_step, "schedule": engine.schedule.state(),
            "settings": settings, "shards": [s.numel() for s in engine.backend.local_shards()],
            "inner": inner is not None}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    save_safetensors(tensors, partial, metadata={META_KEY: json.dumps(meta)})
    os.replace(partial, path)


def load_state(path: Path, engine, settings: dict, load_inner: bool, say) -> None:
    """Restore what `save_state` wrote into `engine` (and the backend's inner state); changed
    outer settings restart the outer state from the loaded weights (said through `say`)."""
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get(META_KEY, "{}"))
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path} is not fl-megatron's federation state ({meta.get('format')!r})")
        shards = [s.numel() for s in engine.backend.local_shards()]
        if meta["shards"] != shards:
            raise ValueError(f"{path} holds state for shards of {sum(meta['shards'])} elements in {len(meta['shards'])} "
                             f"tensors, this rank has {sum(shards)} in {len(shards)}: resume with the layout that "
                             "saved it (world size, TP/PP, instances, --fl-num-groups)")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    engine.last_synced_step = meta["last_synced_step"]
    saved = meta["settings"]
    if all(saved.get(k) == settings.get(k) for k in OUTER_SETTINGS):
        engine.load_state_tensors({k[len("engine."):]: v for k, v in tensors.items() if k.startswith("engine.")})
    else:
        changed = ", ".join(f"{k} {saved.get(k)!r} -> {settings.get(k)!r}" for k in OUTER_SETTINGS
                            if saved.get(k) != settings.get(k))
        say(f"fl-megatron: the checkpoint's sync settings differ ({changed}): the outer state restarts from the "
            "loaded weights")
        engine.restart_outer_state()
    if (saved.get("topology"), saved.get("ada_graphs")) == (settings.get("topology"), settings.get("ada_graphs")):
        engine.schedule.load_state(meta["schedule"])
    if load_inner and meta["inner"]:
        _copy_inner(engine.backend.inner_state_shards(), tensors, path)


@torch.no_grad()
def _copy_inner(mine: list, tensors: dict, path: Path) -> None:
    saved = [tensors[f"inner.{i}"] for i in range(sum(k.startswith("inner.") for k in tensors))]
    if [t.shape for t in saved] != [t.shape for t in mine]:
        raise ValueError(f"{path}: the saved inner optimizer state ({len(saved)} tensors) does not match this "
                         f"rank's ({len(mine)} tensors) after loading Megatron-LM's checkpoint")
    for dst, src in zip(mine, saved):
        dst.copy_(src)


def prune(root: str, keep: int) -> None:
    """Remove our state of iterations whose Megatron-LM checkpoint is gone (retention), except `keep`."""
    ours = Path(root) / "fl_megatron"
    if not ours.is_dir():
        return
    for d in ours.glob("iter_*"):
        if d.name != f"iter_{keep:07d}" and not (Path(root) / d.name).exists():
            shutil.rmtree(d, ignore_errors=True)
