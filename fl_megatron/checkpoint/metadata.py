"""What a checkpoint says about itself (metadata.json), checks that it is complete, and checks
that it fits the run that wants to load it, naming every difference."""

import dataclasses
import json
from pathlib import Path

from ..config.resolved import ResolvedRun
from ..config.sync_mode import SyncMode
from ..group_layout import GroupLayout, group_sizes_of, layout_record, recorded_group_sizes
from .metadata_schema import metadata_problems
from .paths import METADATA, TRACKER, iteration_dir, published_iterations, read_tracker

FORMAT = "fl-megatron-checkpoint"
FORMAT_VERSION = 1


def build_metadata(run: ResolvedRun, iteration: int, last_synced_step: int, synced_now: bool,
                   mode: str, groups_saved: list[int], sync_mode: SyncMode) -> dict:
    """The metadata.json of a checkpoint (the manifest is added when the files are complete). Its
    `config` is the run's, in the sync mode it had at this step (--fl-tune may have switched it)."""
    lay = run.layout
    config = run.cfg.to_dict()
    config["federation"].update(sync_mode.fields())
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "iteration": iteration,
        "consumed_samples": iteration * run.cfg.training.micro_batch_size * run.accumulation * lay.world_size,
        "backend": run.cfg.parallel.backend,
        "mode": mode,
        "layout": layout_record(lay),
        "groups_saved": groups_saved,
        "model": dataclasses.asdict(run.cfg.model),
        "federation": {"last_synced_step": last_synced_step, "synced_at_save": synced_now,
                       "steps_since_sync": iteration - last_synced_step, "mode": sync_mode.fields()},
        "config": config,
    }


def saved_mode(meta: dict) -> SyncMode:
    """The sync mode a checkpoint's run was in (older checkpoints: the mode fields of its config)."""
    return SyncMode.from_fields(meta["federation"].get("mode") or meta["config"]["federation"])


def manifest(checkpoint: Path) -> dict[str, int]:
    """Every file under `checkpoint` (relative path -> size in bytes), metadata.json excepted."""
    return {str(p.relative_to(checkpoint)): p.stat().st_size for p in sorted(checkpoint.rglob("*"))
            if p.is_file() and p.name != METADATA}


def find_checkpoint(root: Path, iteration: int | None = None) -> tuple[Path, dict]:
    """(directory, metadata) of the checkpoint at `iteration` (default: the tracker's), checked
    to be complete: every file of its manifest present with its recorded size."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"checkpoint directory {root} does not exist")
    if iteration is None:
        iteration = read_tracker(root)
        if iteration is None:
            raise ValueError(f"{root} is not a checkpoint directory: it has no {TRACKER}")
    path = iteration_dir(root, iteration)
    if not path.is_dir():
        have = published_iterations(root)
        raise ValueError(f"{root} has no checkpoint of iteration {iteration}; it has "
                         f"{', '.join(map(str, have)) if have else 'none'}")
    meta_path = path / METADATA
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} is not a checkpoint: it has no {METADATA}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{meta_path} is damaged ({e.msg} at line {e.lineno})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{meta_path} is not an fl-megatron checkpoint's metadata")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path} has checkpoint format version {meta.get('format_version')}; this "
                         f"fl-megatron reads version {FORMAT_VERSION}")
    problems = metadata_problems(meta)
    if problems:
        raise ValueError(f"{meta_path} is damaged: " + "; ".join(problems[:8]))
    for name, size in meta.get("manifest", {}).items():
        f = path / name
        if not f.is_file():
            problems.append(f"{name} is missing")
        elif f.stat().st_size != size:
            problems.append(f"{name} has {f.stat().st_size} bytes, {size} were written (truncated or changed)")
    if not meta.get("manifest"):
        problems.append("its manifest lists no files")
    if problems:
        shown = problems[:8] + ([f"... and {len(problems) - 8} more"] if len(problems) > 8 else [])
        raise ValueError(f"checkpoint {path} is incomplete: " + "; ".join(shown))
    return path, meta


def _same_unequal_groups(meta: dict, run: ResolvedRun, problems: list[str]) -> tuple[list[int], list[str]]:
    """Groups of unequal size resume only into the same groups (each group its own saved state;
    outer state and residuals are per rank, in its atoms' layout), besides `problems` found already."""
    saved, here = recorded_group_sizes(meta["layout"]), group_sizes_of(run.layout)
    if saved != here or meta["mode"] == "compact":
        show = lambda sizes: f"groups {'+'.join(map(str, sizes[0]))} sharded {'+'.join(map(str, sizes[1]))}"  # noqa: E731
        problems.append(f"{show(saved)} ({meta['mode']} checkpoint) vs {show(here)} (run): groups of unequal size "
                        "resume only into the same groups from an exact checkpoint (re-cutting the per-rank outer "
                        "state is not supported yet)")
    if problems:
        raise ValueError(f"checkpoint {meta.get('iteration')} does not fit this run: " + "; ".join(problems))
    return list(range(len(here[0]))), []


def source_groups(meta: dict, run: ResolvedRun) -> tuple[list[int], list[str]]:
    """Which saved group each of the run's groups loads, and notes on what that means.

    Raises ValueError naming every difference that makes the checkpoint unusable for this run."""
    problems = [f"model {d}" for d in run.cfg.model.differences(meta["model"], "checkpoint")]
    backend = run.cfg.parallel.backend
    if meta["backend"] != backend:
        problems.append(f"backend {meta['backend']} (checkpoint) vs {backend} (run): a checkpoint loads "
                        "into the backend that wrote it (export to Hugging Face and use --init-from-hf to switch)")
    saved, lay = meta["layout"], run.layout
    if isinstance(lay, GroupLayout) or len(set(recorded_group_sizes(saved)[0])) > 1:
        return _same_unequal_groups(meta, run, problems)
    fixed_shards = {"deepspeed": ("ZeRO-3", "DeepSpeed"), "megatron": ("distributed-optimizer", "megatron")}
    if backend in fixed_shards and saved["hsdp_shard_size"] != lay.shard_size:
        what, who = fixed_shards[backend]
        problems.append(f"{what} group of {saved['hsdp_shard_size']} ranks (checkpoint) vs {lay.shard_size} (run): "
                        f"{who} checkpoints load only into {what} groups of the same size "
                        "(FSDP2 checkpoints reshard)")
    notes: list[str] = []
    old, new = saved["num_groups"], lay.num_groups
    if meta["mode"] == "compact":
        notes.append("compact checkpoint: every group starts from its single model and group 0's optimizer state")
        sources = [0] * new
    elif old == new:
        sources = list(range(new))
    elif not meta["federation"]["synced_at_save"]:
        problems.append(f"{old} federation groups (checkpoint) vs {new} (run): changing the number of groups "
                        f"needs a checkpoint taken right after a sync (this one is "
                        f"{meta['federation']['steps_since_sync']} steps past one); resume with {old} groups")
        sources = []
    else:
        sources = [g % old for g in range(new)]
        notes.append(f"{old} groups saved, {new} in this run: the groups' models are identical (saved right after "
                     f"a sync); group g takes the optimizer state of saved group g mod {old}")
    if problems:
        raise ValueError(f"checkpoint {meta.get('iteration')} does not fit this run: " + "; ".join(problems))
    if (saved["group_size"], saved["world_size"]) != (lay.group_size, lay.world_size) and backend == "fsdp2":
        notes.append(f"groups of {saved['group_size']} ranks saved, {lay.group_size} here: shards are resharded")
    return sources, notes
