"""Megatron-LM flags of the federated outer loop, and their validation (pure: no processes).

Layout arithmetic (Megatron-LM's own groups, nothing new): DP = world / (TP*PP*CP) data-parallel
ranks are cut into N = --num-distributed-optimizer-instances contiguous instances (megatron's
"partial distributed optimizer"). A federation group is P = N / F consecutive instances: inside
it gradients are reduce-scattered in each instance and all-reduced over its P replicas every step
(P = 1: FL+FSDP, P > 1: FL+HSDP); across the F groups only the fp32 main shards are synced, every
H iterations, by the same engine as `fl_megatron.pretrain`.

Every `--fl-*` flag of `fl_megatron.pretrain` exists here with the same name, help and default
(generated from `FederationConfig`); the few that cannot work inside one Megatron-LM job are
refused with the reason (`REFUSED`).
"""

import argparse
import dataclasses
import typing
from typing import Callable, Optional

from ..config.parallel import FederationConfig
from ..graph_fit import topology_problem

_DEFAULTS = FederationConfig()
_FIELDS = {f.name: f for f in dataclasses.fields(FederationConfig) if f.name != "num_groups"}
_TUNE = ("the link probe and --fl-tune run in fl_megatron.pretrain's trainer, which measures its own steps; in "
         "Megatron-LM choose --fl-sync-dtype, --fl-overlap-steps, --fl-fragments and H by hand (python -m "
         "fl_megatron.pretrain --dry-run --fl-tune with your link figures prints what it would choose)")
_ELASTIC = ("elastic federation groups (each group its own job, meeting over torchft's quorum) are built for "
            "fl_megatron.pretrain; in Megatron-LM every group is in one job, and a group that heals would need "
            "megatron's distributed optimizer state sent between jobs, which is not built")
_UNEQUAL = ("groups of unequal size or speed are built for fl_megatron.pretrain's trainer (its atom communicators "
            "and per-group step counts in its loop); Megatron-LM's groups are its distributed-optimizer instances, "
            "of equal size and stepping together (docs/heterogeneous.md)")
# FederationConfig field -> why a patched Megatron-LM refuses it
REFUSED = {
    "group_size": "Megatron-LM's federation groups are made of its distributed-optimizer instances: set "
                  "--num-distributed-optimizer-instances N and --fl-num-groups F (groups of world/F ranks)",
    "hsdp_shard_size": "the shard group is one distributed-optimizer instance (DP/N ranks): set its size with "
                       "--num-distributed-optimizer-instances N",
    "sick_loss_ratio": "Megatron-LM's train_step averages the reported loss over every federation group (its "
                       "data-parallel all-reduce), so no group's own loss reaches the vote (groups with NaN/Inf "
                       "shards are still left out and reset)",
    **{name: _ELASTIC for name in ("elastic", "lighthouse", "group_id", "min_groups", "sync_digest",
                                   "quorum_timeout_minutes", "peer_timeout_seconds",
                                   "start_wait_seconds")},
    **{f.name: _TUNE for f in dataclasses.fields(FederationConfig) if f.name == "link_probe" or f.name.startswith("tune")},
    **{name: _UNEQUAL for name in ("group_sizes", "hsdp_shard_sizes", "group_ranks_per_node", "group_intervals",
                                   "balance_steps")},
}


def _flag(name: str) -> str:
    return "--fl-" + name.replace("_", "-")


def _help(name: str) -> str:
    text = _FIELDS[name].metadata.get("help", "")
    if name in REFUSED:
        text = f"refused in Megatron-LM: {REFUSED[name]}"
    elif "default" not in text:
        text += f" (default: {getattr(_DEFAULTS, name)})"
    return text.replace("%", "%%")


def _field_type(name: str):
    hint = typing.get_type_hints(FederationConfig)[name]
    return next((a for a in typing.get_args(hint) if a is not type(None)), hint)


def add_federation_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the fl-megatron group to Megatron-LM's parser (an `extra_args_provider`). Every
    default is None, so that validation knows which flags were given."""
    group = parser.add_argument_group("fl-megatron", "federated outer loop: the distributed optimizer's fp32 "
                                      "shards synced across federation groups (fl_megatron's engine)")
    group.add_argument("--fl-num-groups", type=int, default=None, metavar="F",
                       help="number of federation groups F; F divides --num-distributed-optimizer-instances "
                            "N (P = N/F replicas per group: P=1 FL+FSDP, P>1 FL+HSDP). Default: N when any "
                            "--fl-* flag is given, else 1 (Megatron-LM runs unchanged)")
    for name in _FIELDS:
        kind = _field_type(name)
        dest = "fl_" + name
        if kind is bool:
            group.add_argument(_flag(name), dest=dest, action=argparse.BooleanOptionalAction, default=None,
                               help=_help(name))
        else:
            group.add_argument(_flag(name), dest=dest, type=kind, default=None, metavar=kind.__name__.upper(),
                               help=_help(name))
    return parser


def federation_config(args) -> FederationConfig:
    """The engine's settings from resolved Megatron-LM args (after `validate_federation_args`)."""
    return FederationConfig(num_groups=args.fl_num_groups,
                            **{name: getattr(args, "fl_" + name) for name in _FIELDS if name not in REFUSED})


def compose_args_providers(*providers: Optional[Callable]) -> Callable:
    """One `extra_args_provider` calling each given provider in turn (None entries skipped)."""
    chosen = [p for p in providers if p is not None]

    def provider(parser):
        for p in chosen:
            parser = p(parser)
        return parser
    return provider


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 3, 8, 9] -> '0-3, 8-9'."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(f"{start}-{r}" if r != start else str(r))
            start = None
    return ", ".join(out)


def federation_group_ranks(args, group: int) -> list[int]:
    """World ranks of federation group `group` in Megatron-LM's rank order (dense models)."""
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    dp = args.world_size // (tp * pp * cp)
    per = dp // args.fl_num_groups
    dp_outer = getattr(args, "use_tp_pp_dp_mapping", False)  # order tp-cp-ep-pp-dp instead of tp-cp-ep-dp-pp
    ranks = []
    for d in range(group * per, (group + 1) * per):
        for p in range(pp):
            for c in range(cp):
                for t in range(tp):
                    outer = (p + pp * d) if dp_outer else (d + dp * p)
                    ranks.append(t + tp * (c + cp * outer))
    return sorted(ranks)


def _given(args) -> bool:
    return any(getattr(args, "fl_" + name, None) is not None for name in ("num_groups", *_FIELDS))


def _layout_errors(args, f: int, n: int) -> list[str]:
    world = args.world_size
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    mp = tp * pp * cp
    if world % mp:
        return [f"world size {world} is not divisible by TP*PP*CP = {tp}*{pp}*{cp} = {mp}"]
    dp = world // mp
    if n == 1:
        return [f"--fl-num-groups {f} needs --num-distributed-optimizer-instances N = F*P (a multiple of "
                f"{f}: N={f} for FL+FSDP, N={2 * f} for FL+HSDP with 2 replicas per group); it is 1"]
    errors = []
    if n % f:
        errors.append(f"--fl-num-groups F={f} does not divide --num-distributed-optimizer-instances N={n} "
                      "(N = F*P with P replicas per federation group)")
    if dp % n:
        errors.append(f"the data-parallel size DP = world/(TP*PP*CP) = {world}/({tp}*{pp}*{cp}) = {dp} is not "
                      f"divisible by --num-distributed-optimizer-instances N={n}")
    if not errors and pp > 1 and not getattr(args, "use_tp_pp_dp_mapping", False):
        ranks = federation_group_ranks(args, 0)
        errors.append(f"with PP={pp}, Megatron-LM's default rank order (tp-cp-ep-dp-pp) makes federation group 0 "
                      f"of {f} the ranks {_ranges(ranks)} of {world}: not one block of consecutive ranks, so "
                      "pipeline traffic would cross federation groups every step; add --use-tp-pp-dp-mapping "
                      f"(then group f holds ranks f*{world // f} .. (f+1)*{world // f}-1)")
    return errors


def _flag_errors(args, h: int, syncing: bool) -> list[str]:
    errors = []
    refused = {
        "use_precision_aware_optimizer": "--use-precision-aware-optimizer keeps the fp32 main parameters "
                                         "inside Transformer Engine's FusedAdam, where the outer loop cannot "
                                         "average them",
        "overlap_param_gather_with_optimizer_step": "--overlap-param-gather-with-optimizer-step leaves a "
                                                    "parameter all-gather in flight when the sync edits the shards",
        "calculate_per_token_loss": "--calculate-per-token-loss all-reduces the token count over the whole "
                                    "data-parallel group (all federation groups) in finalize_model_grads",
        "use_torch_fsdp2": "--use-torch-fsdp2 has no distributed optimizer to average (use fl_megatron.pretrain "
                           "--backend fsdp2 for FL+FSDP2)",
        "use_megatron_fsdp": "--use-megatron-fsdp has no distributed optimizer to average",
    }
    for attr, why in refused.items():
        if getattr(args, attr, False):
            errors.append(f"{why}: not supported with --fl-num-groups > 1")
    if not getattr(args, "use_distributed_optimizer", False):
        errors.append("--use-distributed-optimizer is required (the outer loop averages its fp32 main shards)")
    if getattr(args, "num_experts", None):
        errors.append(f"--num-experts {args.num_experts}: the expert-parallel gradient buffers are not gated "
                      "(mixture-of-experts models are not supported yet)")
    interval = getattr(args, "check_weight_hash_across_dp_replicas_interval", None)
    if interval is not None and (not syncing or interval % h):
        errors.append(f"--check-weight-hash-across-dp-replicas-interval {interval} must be a multiple of "
                      f"--fl-sync-interval H={h} (between syncs the groups' weights differ by design)"
                      if syncing else "--check-weight-hash-across-dp-replicas-interval needs syncing groups "
                      "(drop --fl-disable-sync / H=0)")
    if getattr(args, "save", None) and not syncing:
        errors.append("--save with --fl-disable-sync or --fl-sync-interval 0: the groups never sync, so a "
                      "checkpoint would mix their weights; drop --save or let the groups sync")
    return errors


def _engine_errors(args, f: int) -> list[str]:
    """The engine's own checks of the --fl-* values (the same as fl_megatron.pretrain's), the
    refused flags, and what a Megatron-LM checkpoint cannot carry."""
    errors = [f"{_flag(name)}: {why}" for name, why in REFUSED.items() if getattr(args, "fl_" + name, None) is not None]
    fed = federation_config(args)
    try:
        fed.validate()
    except ValueError as e:
        errors.append(str(e))
        return errors
    if fed.syncing and f > 1:
        for name in [fed.topology] + (fed.ada_ladder if fed.topology == "ada" else []):
            problem = topology_problem(name, f) if name != "none" else None
            if problem:
                errors.append(problem)
    if getattr(args, "non_persistent_save_interval", None) and (not fed.plain_average or fed.fragments > 1):
        errors.append("--non-persistent-save-interval: the outer optimizer's state, error-feedback residuals and "
                      "fragment schedule are saved beside Megatron-LM's persistent checkpoints only (drop it, or "
                      "use the plain fp32 FedAvg)")
    return errors


def validate_federation_args(args) -> list[str]:
    """Resolve the --fl-* defaults into `args` and check them against Megatron-LM's flags.

    Raises ValueError listing every problem (each names its numbers); returns warnings (also
    printed on rank 0). Sets `args.fl_enabled` (F > 1) and `args.fl_replicas` (P). Pure: call it
    from validate_args, before anything expensive. Idempotent.
    """
    n = int(getattr(args, "num_distributed_optimizer_instances", 1) or 1)
    given = _given(args)
    explicit = getattr(args, "fl_num_groups", None) is not None
    if not explicit:
        args.fl_num_groups = n if given else 1
    for name in _FIELDS:
        if name not in REFUSED and getattr(args, "fl_" + name, None) is None:
            setattr(args, "fl_" + name, getattr(_DEFAULTS, name))
    f, h = args.fl_num_groups, args.fl_sync_interval
    syncing = h > 0 and not args.fl_disable_sync
    errors, warnings = [], []
    if f < 1:
        errors.append(f"--fl-num-groups {f} must be at least 1")
    if not errors and f == 1 and given and not explicit:
        errors.append("--fl-* flags were given but --num-distributed-optimizer-instances is 1, so there is a "
                      "single federation group; set it to N = F*P (e.g. 2 for 2 groups)")
    errors += _engine_errors(args, f)
    if not errors and f > 1:
        errors += _layout_errors(args, f, n)
        errors += _flag_errors(args, h, syncing)
    if errors:
        raise ValueError("fl-megatron: invalid federated settings:\n  - " + "\n  - ".join(errors))
    args.fl_enabled = f > 1
    args.fl_replicas = n // f if f > 1 else n
    if args.fl_enabled and syncing:
        for attr, flag in (("save_interval", "--save-interval"),
                           ("non_persistent_save_interval", "--non-persistent-save-interval")):
            value = getattr(args, attr, None)
            if getattr(args, "save", None) and value and value % h:
                warnings.append(f"{flag} {value} is not a multiple of --fl-sync-interval {h}: each such save "
                                "syncs the groups first (an extra sync; checkpoints hold synced state only)")
    if warnings and getattr(args, "rank", 0) == 0:
        for w in warnings:
            print(f"fl-megatron: WARNING: {w}", flush=True)
    return warnings
