"""Megatron-style command-line flags generated from the config dataclasses, and JSON loading.

Precedence (lowest first): dataclass defaults < --model preset < --config FILE.json < flags.
"""

import argparse
import dataclasses
import json
import typing
from typing import Any, Optional, Sequence

from .deepspeed_json import check_against_flags, load_deepspeed_json, split_deepspeed_json
from .json_file import read_json_object
from .keys import unknown_keys_problem
from .run import SECTIONS, RunConfig

# Flags whose names differ from "--" + field name with dashes.
FLAG_NAMES = {
    ("model", "norm_eps"): "--norm-epsilon",
    ("parallel", "world_size"): "--world-size",
    ("parallel", "deepspeed_config"): "--deepspeed_config",  # DeepSpeed's own spelling
    ("data", "data_cache_dir"): "--data-cache-path",  # Megatron's name
}
SECTION_PREFIX = {"federation": "fl-"}


def flag_name(section: str, name: str) -> str:
    """The command-line flag of one config field."""
    return FLAG_NAMES.get((section, name), "--" + SECTION_PREFIX.get(section, "") + name.replace("_", "-"))


def _field_type(cls, f: dataclasses.Field):
    """The scalar type of a field (Optional[int] -> int)."""
    hint = typing.get_type_hints(cls)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _optional(cls, f: dataclasses.Field) -> bool:
    """Whether a field may be None (Optional[...] or a None default)."""
    return type(None) in typing.get_args(typing.get_type_hints(cls)[f.name]) or f.default is None


class _Parser(argparse.ArgumentParser):
    """Raises ValueError instead of printing and exiting, so that the entry point reports the
    error once per node like every other configuration error."""

    def error(self, message: str):
        raise ValueError(f"{message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    """All flags; every default is SUPPRESS so that only what the user typed reaches the config."""
    parser = _Parser(
        prog="fl_megatron.pretrain", argument_default=argparse.SUPPRESS, allow_abbrev=False,
        description="Pre-train a Llama/GPT model with federated sharded data parallelism "
                    "(FL+FSDP, FL+HSDP). Launch with torchrun; --dry-run plans without processes.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    run = parser.add_argument_group("run")
    run.add_argument("--config", metavar="FILE.json", help="load settings from a JSON file (flags override it)")
    run.add_argument("--model", metavar="PRESET", help="model preset, e.g. llama-tiny, llama3.1-8b, gpt2-small "
                                                         "(shape flags override it)")
    run.add_argument("--dry-run", action="store_true",
                     help="validate (flags, data files, the checkpoint to load), print the layout, parameter count, "
                          "memory and communication estimates, exit")
    run.add_argument("--deepspeed", dest="parallel.backend", action="store_const", const="deepspeed",
                     help="use the DeepSpeed ZeRO-3 backend (same as --backend deepspeed)")
    run.add_argument("--local_rank", "--local-rank", dest="launcher_local_rank", type=int, metavar="N",
                     help="accepted for the deepspeed launcher without --no_local_rank; the local rank "
                          "is read from the environment")
    defaults = RunConfig()
    for section in SECTIONS:
        cls = type(getattr(defaults, section))
        group = parser.add_argument_group(section, cls.__doc__)
        for f in dataclasses.fields(cls):
            ftype = _field_type(cls, f)
            help_text = f.metadata.get("help", "")
            if "default" not in help_text:
                help_text += f" (default: {getattr(getattr(defaults, section), f.name)})"
            help_text = help_text.replace("%", "%%")
            dest = f"{section}.{f.name}"
            name = flag_name(section, f.name)
            if ftype is bool:
                group.add_argument(name, dest=dest, action=argparse.BooleanOptionalAction, help=help_text)
            elif ftype is list:
                group.add_argument(name, dest=dest, nargs="+", metavar="VALUE", help=help_text)
            else:
                group.add_argument(name, dest=dest, type=ftype, metavar=ftype.__name__.upper(), help=help_text)
    return parser


def _apply(target, values: dict, where: str) -> None:
    """Set dataclass fields from a dict, rejecting unknown keys and wrong types."""
    cls = type(target)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    problem = unknown_keys_problem(values, fields, where)
    if problem:
        raise ValueError(problem)
    for key, value in values.items():
        ftype = _field_type(cls, fields[key])
        if ftype is list and isinstance(value, str):
            value = value.split()  # "0.3 /a 0.7 /b" in a JSON file
        if value is None and not _optional(cls, fields[key]):
            raise ValueError(f"{where}.{key}: expected {getattr(ftype, '__name__', ftype)}, got null")
        if value is not None:
            ok = isinstance(value, ftype) if ftype is not float else isinstance(value, (int, float))
            if isinstance(value, bool) and ftype is not bool:
                ok = False
            if not ok:
                raise ValueError(f"{where}.{key}: expected {ftype.__name__}, got {value!r}")
            if ftype is float:
                value = float(value)
        setattr(target, key, value)


def load_json(path: str) -> dict:
    """Read a JSON config file; errors name the file and position."""
    data = read_json_object(path, "config file", f"an object with sections {', '.join(SECTIONS)}")
    problem = unknown_keys_problem(data, [*SECTIONS, "deepspeed"], f"config file {path}", "section")
    if problem:
        raise ValueError(problem + " (deepspeed: an inline DeepSpeed config)")
    return data


def config_from_sources(json_data: Optional[dict], flags: dict, preset: Optional[str] = None,
                        where: str = "config") -> RunConfig:
    """Merge defaults, a preset, JSON sections and flag values (`section.field` keys) into a RunConfig."""
    from .presets import get_preset

    json_data = dict(json_data or {})
    model_json = dict(json_data.get("model") or {})
    preset = preset or model_json.pop("preset", None)
    model_json.pop("preset", None)
    cfg = RunConfig()
    if preset:
        cfg.model = get_preset(preset)
        cfg.preset = preset
    for section in SECTIONS:
        values = model_json if section == "model" else json_data.get(section) or {}
        if not isinstance(values, dict):
            raise ValueError(f"{where}: section {section!r} must be an object")
        _apply(getattr(cfg, section), values, f"{where}: {section}")
    _apply_deepspeed(cfg, json_data, flags, where)
    by_section: dict = {}
    for dest, value in flags.items():
        section, name = dest.split(".", 1)
        by_section.setdefault(section, {})[name] = value
    for section, values in by_section.items():
        _apply(getattr(cfg, section), values, "flags")
    if flags.get("federation.group_sizes"):  # the command line's groups replace a file's equal ones
        for name in ("group_size", "num_groups"):
            if f"federation.{name}" not in flags:
                setattr(cfg.federation, name, None)
    return cfg


def _apply_deepspeed(cfg: RunConfig, json_data: dict, flags: dict, where: str) -> None:
    """Merge a DeepSpeed config (file from --deepspeed_config, or inline 'deepspeed' section)."""
    path = flags.get("parallel.deepspeed_config") or cfg.parallel.deepspeed_config
    inline = json_data.get("deepspeed")
    if path and inline is not None:
        raise ValueError(f"{where}: both a 'deepspeed' section and deepspeed_config={path} were given; use one")
    if not path and inline is None:
        return
    if inline is not None and not isinstance(inline, dict):
        raise ValueError(f"{where}: section 'deepspeed' must be an object")
    ds_where = path or f"{where}: deepspeed"
    raw = load_deepspeed_json(path) if path else inline
    federation, training, passthrough = split_deepspeed_json(raw, ds_where)
    # values typed on the command line or set in the --config file must agree with it
    explicit = {f"training.{k}": v for k, v in (json_data.get("training") or {}).items()}
    check_against_flags(training, {**explicit, **flags}, "scheduler" in passthrough, ds_where)
    _apply(cfg.federation, federation, f"{ds_where}: federation")
    _apply(cfg.training, training, f"{ds_where}")
    cfg.deepspeed = passthrough
    backend = flags.get("parallel.backend")
    if backend not in (None, "deepspeed"):
        raise ValueError(f"--backend {backend} contradicts the DeepSpeed config {ds_where}; "
                         "drop one of them")
    cfg.parallel.backend = "deepspeed"


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple[RunConfig, argparse.Namespace]:
    """Parse the command line into a RunConfig (not yet validated against a world size).

    Raises ValueError naming the problem (unknown flag, bad value, bad config file)."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    given = vars(ns)
    flags = {k: v for k, v in given.items() if "." in k}
    json_data = load_json(given["config"]) if "config" in given else None
    cfg = config_from_sources(json_data, flags, preset=given.get("model"), where=given.get("config", "config"))
    return cfg, ns


def config_to_json(cfg: RunConfig, extra: Optional[dict] = None) -> str:
    """The resolved configuration as JSON text (what config.json in the run directory holds), with
    `extra` top-level entries (the run's link probe)."""
    return json.dumps({**cfg.to_dict(), **(extra or {})}, indent=2, sort_keys=False) + "\n"


def dump_flags(cfg: RunConfig) -> list[str]:
    """The flags that reproduce `cfg` (handy for launch scripts and tests)."""
    out: list[str] = []
    if cfg.preset:
        out += ["--model", cfg.preset]
    for section in SECTIONS:
        for f in dataclasses.fields(type(getattr(cfg, section))):
            value: Any = getattr(getattr(cfg, section), f.name)
            if value is None:
                continue
            name = flag_name(section, f.name)
            if isinstance(value, bool):
                out.append(name if value else "--no-" + name[2:])
            elif isinstance(value, list):
                out += [name, *map(str, value)]
            else:
                out += [name, str(value)]
    return out
