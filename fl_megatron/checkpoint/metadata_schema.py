"""The shape metadata.json must have before anything reads its fields: a damaged or hand-edited
file is named with every wrong field, never met later as a KeyError or TypeError."""

import dataclasses

from ..config.checkpoint import CHECKPOINT_MODES
from ..config.model import ModelConfig
from ..config.parallel import BACKENDS

_INT, _BOOL, _DICT, _LIST, _STR = "an integer", "true or false", "an object", "a list", "a string"
_FIELDS = {  # path -> what it must be
    ("iteration",): _INT, ("consumed_samples",): _INT, ("backend",): _STR, ("mode",): _STR,
    ("layout",): _DICT, ("layout", "world_size"): _INT, ("layout", "ranks_per_node"): _INT,
    ("layout", "group_size"): _INT, ("layout", "num_groups"): _INT, ("layout", "hsdp_shard_size"): _INT,
    ("groups_saved",): _LIST, ("model",): _DICT, ("federation",): _DICT,
    ("federation", "last_synced_step"): _INT, ("federation", "synced_at_save"): _BOOL,
    ("federation", "steps_since_sync"): _INT, ("config",): _DICT, ("config", "federation"): _DICT,
    ("manifest",): _DICT,
}
_CHECKS = {_INT: lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
           _BOOL: lambda v: isinstance(v, bool), _DICT: lambda v: isinstance(v, dict),
           _LIST: lambda v: isinstance(v, list), _STR: lambda v: isinstance(v, str)}
_MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}


_MISSING = object()


def _lookup(meta: dict, path: tuple):
    value = meta
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return _MISSING
        value = value[key]
    return value


def _group_list_problems(layout: dict) -> list[str]:
    """Problems of the per-group lists a layout may record (groups of unequal size): a positive
    integer per group, or (`group_ranks_per_node`) none at all."""
    problems = []
    for key in ("group_sizes", "hsdp_shard_sizes", "group_ranks_per_node"):
        value = layout.get(key)
        if value is None or (key == "group_ranks_per_node" and value == []):
            continue
        if not isinstance(value, list) or len(value) != layout["num_groups"] or \
                not all(_CHECKS[_INT](v) and v > 0 for v in value):
            problems.append(f"layout.{key} is {value!r}, not a positive integer for each of the "
                            f"{layout['num_groups']} groups")
    return problems


def metadata_problems(meta: dict) -> list[str]:
    """Every field of `meta` that is missing or of the wrong kind (empty: usable)."""
    problems = []
    for path, kind in _FIELDS.items():
        value = _lookup(meta, path)
        name = ".".join(path)
        if value is _MISSING:
            problems.append(f"{name} is missing")
        elif not _CHECKS[kind](value):
            problems.append(f"{name} is {value!r}, not {kind}" + (" (0 or more)" if kind == _INT else ""))
    if problems:
        return problems
    if meta["backend"] not in BACKENDS:
        problems.append(f"backend {meta['backend']!r} is not one of {', '.join(BACKENDS)}")
    if meta["mode"] not in CHECKPOINT_MODES:
        problems.append(f"mode {meta['mode']!r} is not one of {', '.join(CHECKPOINT_MODES)}")
    groups = meta["groups_saved"]
    if not groups or not all(_CHECKS[_INT](g) and g < max(meta["layout"]["num_groups"], 1) for g in groups):
        problems.append(f"groups_saved {groups!r} is not a list of group numbers below layout.num_groups")
    if meta["layout"]["num_groups"] < 1 or meta["layout"]["world_size"] < 1:
        problems.append("layout has no ranks or no groups")
    problems += _group_list_problems(meta["layout"])
    unknown = sorted(set(meta["model"]) - _MODEL_FIELDS)
    if unknown or not all(isinstance(v, (int, float, str, bool, type(None))) for v in meta["model"].values()):
        problems.append(f"model is not a model description (unknown or non-scalar fields {unknown or ''})")
    if not all(isinstance(k, str) and _CHECKS[_INT](v) for k, v in meta["manifest"].items()):
        problems.append("manifest does not map file names to sizes")
    return problems
