"""A DeepSpeed JSON config with a `federation` block: read it into the run's settings, check it
against the flags, and build the dict the DeepSpeed engine gets (pure Python, no DeepSpeed import).

What the JSON says about batches, precision, clipping and the optimizer becomes the run's
training settings (so every backend, the dry run and the logs agree); a flag that contradicts
it is an error. The `federation` block sets the --fl-* settings, which flags override. Every
other key reaches DeepSpeed unchanged.
"""

import dataclasses
import json
from typing import Optional

from .json_file import read_json_object
from .keys import unknown_keys_problem
from .parallel import FederationConfig

# The top-level keys DeepSpeed's config reads, recorded from DeepSpeedConfig (tests/test_config_keys.py
# records them again from the installed DeepSpeed and compares).
DEEPSPEED_VERSION = "0.19.8"
DEEPSPEED_KEYS = frozenset((
    "activation_checkpointing", "aio", "amp", "autotuning", "bf16", "bfloat16", "checkpoint", "comet",
    "comms_logger", "communication_data_type", "compile", "compression_training", "csv_monitor",
    "curriculum_learning", "data_efficiency", "data_types", "dataloader_drop_last", "datastates_ckpt",
    "disable_allgather", "disable_python_gc", "dump_state", "eigenvalue", "elasticity", "expert_parallel",
    "flops_profiler", "fp16", "gradient_accumulation_steps", "gradient_allreduce_op", "gradient_clipping",
    "gradient_predivide_factor", "graph_harvesting", "hybrid_engine", "log_level", "managed_gradient_accumulation",
    "memory_breakdown", "nebula", "optimizer", "pipeline", "prescale_gradients", "progressive_layer_drop",
    "quantize_training", "scheduler", "seq_parallel_communication_data_type", "sparse_attention",
    "sparse_gradients", "steps_per_print", "tensor_parallel", "tensorboard", "timers", "torch_autocast",
    "train_batch_size", "train_micro_batch_size_per_gpu", "use_data_before_expert_parallelism",
    "vocabulary_size", "wall_clock_breakdown", "wandb", "weight_quantization", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "zero_optimization"))

# DeepSpeed key -> training field it sets.
_BATCH_KEYS = {"train_micro_batch_size_per_gpu": "micro_batch_size",
               "gradient_accumulation_steps": "gradient_accumulation_steps"}
# DeepSpeed optimizer types we map onto the run's optimizer setting.
_OPTIMIZER_TYPES = {"adam": "adamw", "adamw": "adamw", "sgd": "sgd"}
# Flags a DeepSpeed `scheduler` block takes over (fl-megatron's schedule is then unused).
_SCHEDULE_FIELDS = ("lr_warmup_iters", "lr_decay_style", "lr_decay_iters", "min_lr")
# Keys DeepSpeed would accept but this integration cannot honour, with what to use instead.
_UNSUPPORTED_ZERO_KEYS = {
    "mics_shard_size": "MiCS was removed from DeepSpeed 0.19.8; use the federation block's "
                       "hsdp_shard_size (--fl-hsdp-shard-size) for hybrid sharding",
    "offload_optimizer": "optimizer offload is not supported with federated averaging yet",
    "offload_param": "parameter offload is not supported with federated averaging yet",
}


def load_deepspeed_json(path: str) -> dict:
    """Read a DeepSpeed config file; errors name the file and position."""
    return read_json_object(path, "DeepSpeed config")


def _enabled(ds: dict, key: str, where: str) -> bool:
    block = ds.get(key)
    if block is None:
        return False
    if not isinstance(block, dict):
        raise ValueError(f"{where}: {key!r} must be an object like {{\"enabled\": true}}")
    return bool(block.get("enabled", False))


def _in_use(value) -> bool:
    """Whether a zero_optimization entry turns its feature on (offload blocks with device
    "none" and empty or zero values do not)."""
    if isinstance(value, dict):
        return bool(value) and value.get("device", "none") != "none"
    return value not in (None, 0)


def split_deepspeed_json(ds: dict, where: str) -> tuple[dict, dict, dict]:
    """(federation settings, training settings, what DeepSpeed gets) from a DeepSpeed config.

    Raises ValueError naming the key for anything this integration cannot run.
    """
    ds = json.loads(json.dumps(ds))  # a deep copy the caller cannot alias
    federation = ds.pop("federation", None) or {}
    if not isinstance(federation, dict):
        raise ValueError(f"{where}: 'federation' must be an object")
    problem = unknown_keys_problem(federation, [f.name for f in dataclasses.fields(FederationConfig)],
                                   f"{where}, federation block")
    if problem:
        raise ValueError(problem)
    # DeepSpeed ignores top-level keys it does not read: a misspelt one would silently do nothing
    problem = unknown_keys_problem(ds, DEEPSPEED_KEYS, where, "top-level key", list_valid=False)
    if problem:
        raise ValueError(problem + f" (DeepSpeed {DEEPSPEED_VERSION} reads {len(DEEPSPEED_KEYS)} top-level keys; "
                         "'federation' holds the --fl-* settings)")

    training: dict = {}
    for key, name in _BATCH_KEYS.items():
        if key in ds:
            training[name] = ds[key]
    if "gradient_clipping" in ds:
        training["clip_grad"] = ds["gradient_clipping"]
    bf16 = _enabled(ds, "bf16", where) or _enabled(ds, "bfloat16", where)
    fp16 = _enabled(ds, "fp16", where)
    if bf16 and fp16:
        raise ValueError(f"{where}: fp16 and bf16 are both enabled; enable one (bf16 is supported)")
    if fp16:
        raise ValueError(f"{where}: fp16 (loss-scaled) training is not supported; use "
                         "\"bf16\": {\"enabled\": true}")
    if "bf16" in ds or "bfloat16" in ds:
        training["bf16"] = bf16

    zero = ds.get("zero_optimization")
    if zero is not None:
        if not isinstance(zero, dict):
            raise ValueError(f"{where}: 'zero_optimization' must be an object")
        stage = zero.get("stage", 0)
        if stage != 3:
            raise ValueError(f"{where}: zero_optimization.stage is {stage!r}; fl-megatron's DeepSpeed "
                             "backend shards with ZeRO stage 3 (set \"stage\": 3)")
        for key, why in _UNSUPPORTED_ZERO_KEYS.items():
            if _in_use(zero.get(key)):
                raise ValueError(f"{where}: zero_optimization.{key}: {why}")

    optimizer = ds.get("optimizer")
    if optimizer is not None:
        kind = str(optimizer.get("type", "")).lower() if isinstance(optimizer, dict) else ""
        if kind not in _OPTIMIZER_TYPES:
            raise ValueError(f"{where}: optimizer type {optimizer.get('type') if isinstance(optimizer, dict) else optimizer!r} "
                             f"is not supported; use AdamW, Adam or SGD")
        training["optimizer"] = _OPTIMIZER_TYPES[kind]
        params = optimizer.get("params") or {}
        for key, name in (("lr", "lr"), ("eps", "adam_eps"), ("weight_decay", "weight_decay"),
                          ("momentum", "sgd_momentum")):
            if key in params:
                training[name] = float(params[key])
        if "betas" in params:
            betas = params["betas"]
            if not (isinstance(betas, (list, tuple)) and len(betas) == 2):
                raise ValueError(f"{where}: optimizer.params.betas must be a list of two numbers, got {betas!r}")
            training["adam_beta1"], training["adam_beta2"] = float(betas[0]), float(betas[1])
        if kind == "adam" and params.get("adam_w_mode") is False:
            raise ValueError(f"{where}: optimizer Adam with adam_w_mode false (L2 decay) is not "
                             "supported; use AdamW")
    return federation, training, ds


def check_against_flags(training: dict, flags: dict, scheduler: bool, where: str) -> None:
    """A value typed on the command line (or set in the --config file) must not contradict the
    DeepSpeed config. `flags` maps "training.<field>" to the value given."""
    typed = {dest.split(".", 1)[1]: value for dest, value in flags.items() if dest.startswith("training.")}
    clashes = [f"--{name.replace('_', '-')} {typed[name]} vs {value}" for name, value in training.items()
               if name in typed and typed[name] != value]
    if clashes:
        raise ValueError(f"{where} contradicts the command line or --config: {'; '.join(clashes)} "
                         "(set each value in one place)")
    if scheduler:
        given = [f"--{name.replace('_', '-')}" for name in _SCHEDULE_FIELDS if name in typed]
        if given:
            raise ValueError(f"{where} has a 'scheduler' block, which sets the learning rate; "
                             f"remove {', '.join(given)} or the scheduler block")


def engine_config(ds: Optional[dict], training, data_parallel_size: int, steps: int,
                  accumulation: int) -> dict:
    """The dict deepspeed.initialize gets: the user's keys plus the run's batch, precision,
    clipping and optimizer, with DeepSpeed's data-parallel size being the ZeRO-3 group."""
    out = json.loads(json.dumps(ds or {}))
    t = training
    out["train_micro_batch_size_per_gpu"] = t.micro_batch_size
    out["gradient_accumulation_steps"] = accumulation
    out["train_batch_size"] = t.micro_batch_size * accumulation * data_parallel_size
    out["gradient_clipping"] = t.clip_grad
    out.pop("bfloat16", None)
    out["bf16"] = {**(out.get("bf16") or {}), "enabled": t.bf16}
    zero = out.setdefault("zero_optimization", {})
    zero["stage"] = 3
    user_params = ((out.get("optimizer") or {}).get("params") or {})
    if t.optimizer == "adamw":
        params = {"lr": t.lr, "betas": [t.adam_beta1, t.adam_beta2], "eps": t.adam_eps,
                  "weight_decay": t.weight_decay}
        kind = "AdamW"
    else:
        params = {"lr": t.lr, "momentum": t.sgd_momentum, "weight_decay": t.weight_decay}
        kind = "SGD"
    extra = {k: v for k, v in user_params.items() if k not in params and k not in ("adam_w_mode",)}
    out["optimizer"] = {"type": kind, "params": {**params, **extra}}
    out.setdefault("steps_per_print", steps + 1)  # fl-megatron prints progress itself
    out.setdefault("wall_clock_breakdown", False)
    return out


def train_batch_problem(ds: Optional[dict], micro: int, accumulation: int, group_size: int) -> Optional[str]:
    """A message if the JSON's train_batch_size is not one federation group's batch."""
    if not ds or "train_batch_size" not in ds:
        return None
    expected = micro * accumulation * group_size
    if ds["train_batch_size"] != expected:
        return (f"DeepSpeed train_batch_size={ds['train_batch_size']} is not one federation group's "
                f"batch: micro-batch {micro} x accumulation {accumulation} x group size {group_size} "
                f"= {expected}")
    return None
