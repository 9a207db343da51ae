"""The inner optimiser of a federation group (its state is never averaged across groups)."""

from typing import Callable, Optional

import torch

from ..config.training import TrainingConfig


def parameter_groups(named_params, weight_decay: float) -> list[dict]:
    """Weight decay for matrices only (not for norms and biases); empty groups left out.

    A ZeRO-3 parameter's data is an empty placeholder once partitioned: its real shape is
    `ds_shape`."""
    decay, no_decay = [], []
    for _, param in named_params:
        if param.requires_grad:
            ndim = len(getattr(param, "ds_shape", param.shape))
            (decay if ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(named_params, cfg: TrainingConfig) -> torch.optim.Optimizer:
    """AdamW or SGD over `parameter_groups`."""
    groups = parameter_groups(named_params, cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.sgd_momentum)
    raise ValueError(f"unknown optimizer {cfg.optimizer!r}")


def set_learning_rate(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def state_tensors(optimizer, params: list, local=_identity) -> list[torch.Tensor]:
    """The optimizer's state tensors of `params` in their order, keys sorted, step counts left out
    (the inner state a sync may average or reset); empty until the first step."""
    out = []
    for param in params:
        state = optimizer.state.get(param, {})
        out += [local(state[key]) for key in sorted(state)
                if key != "step" and torch.is_tensor(state[key]) and state[key].is_floating_point()]
    return out


def _count_tensor(value) -> torch.Tensor:
    """A step count kept as a Python number, as a 0-d CPU tensor (int64 for an int)."""
    return torch.tensor(value, dtype=torch.int64 if isinstance(value, int) else torch.float64)


def _writer(holder: dict, key: str, kind: type) -> Callable[[torch.Tensor], None]:
    """Writes a received 0-d tensor back into `holder[key]` as a Python number of type `kind`."""
    def write(value: torch.Tensor) -> None:
        holder[key] = kind(value.item())
    return write


def _transfer_entries(optimizer, params: list, local=_identity, skip: frozenset = frozenset()) -> list[tuple]:
    """(tensor, how to write a received value back: None to copy in place) for everything a
    healing peer needs: per parameter in order its state, keys sorted (a Python number such as
    DeepSpeed FusedAdam's int step as a 0-d tensor), then the step count of each parameter group
    holding one of `params` (Transformer Engine's and Apex's FusedAdam keep it there). `skip`: keys
    left out."""
    entries = []
    for param in params:
        state = optimizer.state.get(param, {})
        for key in sorted(set(state) - skip):
            value = state[key]
            if torch.is_tensor(value):
                entries.append((local(value), None))
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                entries.append((_count_tensor(value), _writer(state, key, type(value))))
    held = {id(p) for p in params}
    for group in optimizer.param_groups:
        if "step" in group and any(id(p) in held for p in group["params"]):
            step = group["step"]
            entries.append((step, None) if torch.is_tensor(step) else
                           (_count_tensor(step), _writer(group, "step", type(step))))
    return entries


def split_transfer_state(optimizer, params: list, local=_identity) -> tuple[list, list]:
    """The transfer state (`_transfer_entries`) split for a heal between groups of unequal size:
    (streams, rest). A stream is one key whose tensor is shaped as every parameter's local shard
    (a moment): the flat local tensor of each parameter, in order; it is re-cut atom by atom. The
    rest (step counts, anything else) is `_transfer_entries`' (tensor, writer) list without the
    streams: it travels whole. Both empty before the first step."""
    states = [optimizer.state.get(p, {}) for p in params]
    keys = sorted({key for state in states for key, value in state.items() if torch.is_tensor(value)})
    moments = [key for key in keys if all(torch.is_tensor(state.get(key)) and local(state[key]).shape == local(p).shape
                                          for state, p in zip(states, params))]
    streams = [[local(state[key]).reshape(-1) for state in states] for key in moments]
    return streams, _transfer_entries(optimizer, params, local, skip=frozenset(moments))


def transfer_state_tensors(optimizer, params: list, local=_identity) -> list[torch.Tensor]:
    """Every state tensor of `params` in their order, keys sorted, step counts included wherever
    the optimizer keeps them (see `_transfer_entries`): what a healing group receives to continue
    exactly where the sender is (empty before the first step)."""
    return [tensor for tensor, _ in _transfer_entries(optimizer, params, local)]


def has_state(optimizer, params: list) -> bool:
    """Whether the optimizer holds per-parameter state for any of `params` (it has stepped them)."""
    return any(optimizer.state.get(param) for param in params)


def forget_state(optimizer) -> None:
    """Drop the optimizer's state, step counts included: also those a fused Adam keeps in its
    parameter groups (left there, the next step's bias correction would be the old step's, and
    the first updates from fresh moments several times too large)."""
    optimizer.state.clear()
    for group in optimizer.param_groups:
        group.pop("step", None)


@torch.no_grad()
def step_at_zero_lr(optimizer, params: list) -> None:
    """Make a fresh optimizer's state by one step at learning rate 0 from zero gradients (AdamW
    and SGD leave the parameters unchanged then, bit for bit: the decay factor is exactly 1 and
    the update exactly 0)."""
    rates = [group["lr"] for group in optimizer.param_groups]
    for param in params:
        param.grad = torch.zeros_like(param)
    set_learning_rate(optimizer, 0.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for param in params:  # (an optimizer whose groups do not hold them right now: DeepSpeed's)
        param.grad = None
    for group, lr in zip(optimizer.param_groups, rates):
        group["lr"] = lr


@torch.no_grad()
def load_transfer_state_tensors(optimizer, params: list, tensors: list, local=_identity,
                                materialise: Optional[Callable[[], None]] = None) -> None:
    """Copy `transfer_state_tensors` of a peer rank in, step counts included. An optimizer without
    state for `params` makes it first with `materialise` (default: `step_at_zero_lr`)."""
    if tensors and not has_state(optimizer, params):
        (materialise or (lambda: step_at_zero_lr(optimizer, params)))()
    mine = _transfer_entries(optimizer, params, local)
    if [tuple(t.shape) for t, _ in mine] != [tuple(t.shape) for t in tensors]:
        raise ValueError(f"the optimizer state received has {len(tensors)} tensors that do not match this rank's "
                         f"{len(mine)} (a peer with another model, optimizer or shard layout)")
    for (target, write), value in zip(mine, tensors):
        if write is None:
            target.copy_(value)
        else:
            write(value)
