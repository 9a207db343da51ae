"""What the groups of an elastic federation must agree on, and how they compare it before they meet.

Each group's torchft replica id carries its settings (`fl1-<value>-<value>-..._group_G`): the
lighthouse shows every heartbeating replica id on its status page before any quorum or
communicator exists, so a group can compare itself with the others while it waits, and a group
that joins later compares itself with the live ones before it heals. torchft reads the group
slot from the trailing digits of the part before the first ':' (its replica rank order is that
of the ids, as with plain `group_G`). Pure: no torch.distributed, no torchft.
"""

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Optional

from ..config import ResolvedRun

VERSION = "fl1"
_SAFE = re.compile(r"[A-Za-z0-9.]{1,16}")
# FederationConfig fields that are each group's own, or compared one by one below
_OWN_OR_LISTED = {"group_id", "lighthouse", "quorum_timeout_minutes", "start_wait_seconds", "sync_digest",
                  "link_probe", "elastic", "group_size", "hsdp_shard_size", "num_groups", "min_groups", "sync_interval",
                  "fragments",
                  "sync_dtype", "error_feedback", "outer_optimizer", "outer_lr", "outer_momentum", "inner_state"}
_TRAINING_AGREED = ("lr", "min_lr", "lr_warmup_iters", "lr_decay_style", "lr_decay_iters", "weight_decay",
                    "adam_beta1", "adam_beta2", "adam_eps", "sgd_momentum", "clip_grad", "grad_reduce_dtype")


@dataclass(frozen=True)
class Signature:
    """The settings one group runs with, in a fixed order: (what, value) pairs. `what` names the
    setting as a user would fix it (a flag, or 'ranks'); values are short tokens."""

    items: tuple

    def replica_id(self, group: int) -> str:
        """torchft's replica id of group slot `group` (torchft appends ':<uuid>')."""
        return f"{VERSION}-{'-'.join(value for _, value in self.items)}_group_{group}"


def _token(value) -> str:
    """A value as a replica-id token: itself when short and plain, else a 6-hex digest."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    text = text.strip('"')
    return text if _SAFE.fullmatch(text) else "h" + hashlib.sha256(text.encode()).hexdigest()[:6]


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:6]


def federation_signature(run: ResolvedRun, parameters: int) -> Signature:
    """What every group of `run`'s federation must share; `parameters`: the model's count."""
    cfg, lay = run.cfg, run.layout
    fed, t = cfg.federation, cfg.training
    outer = f"{fed.outer_optimizer}.{fed.resolved_outer_lr:g}.{fed.outer_momentum:g}"
    other_fed = {k: v for k, v in dataclasses.asdict(fed).items() if k not in _OWN_OR_LISTED}
    training = {k: getattr(t, k) for k in _TRAINING_AGREED}
    training["deepspeed"] = cfg.deepspeed
    unequal = hasattr(lay, "group_sizes")  # a GroupLayout: every group agrees on every group's size
    items = (
        ("ranks", "+".join(map(str, lay.group_sizes)) if unequal else str(lay.group_size)),
        ("--fl-hsdp-shard-size", "none" if not lay.is_hsdp else
         "+".join(map(str, lay.shard_sizes)) if unequal else str(lay.shard_size)),
        ("--fl-num-groups", str(lay.num_groups)),
        ("--fl-min-groups", str(fed.min_groups)),
        ("model", f"{parameters}p{_digest(dataclasses.asdict(cfg.model))}"),
        ("--backend", _token(cfg.parallel.backend)),
        ("--bf16", "bf16" if t.bf16 else "fp32"),
        ("--optimizer", _token(t.optimizer)),
        ("--fl-sync-dtype", _token(fed.sync_dtype)),
        ("--fl-error-feedback", "on" if fed.error_feedback else "off"),
        ("--fl-sync-interval", str(fed.sync_interval)),
        ("--fl-fragments", str(fed.fragments)),
        ("--fl-outer-optimizer", _token(outer)),
        ("--fl-inner-state", _token(fed.inner_state)),
        ("--seed", _token(t.seed)),
        ("batch", f"{t.micro_batch_size}x{run.accumulation}x{t.seq_length}"),
        ("--train-iters", str(t.train_iters)),
        ("other --fl-* settings", _digest(other_fed)),
        ("training settings", _digest(training)),
    )
    return Signature(items)


def parse_replica_id(replica: str) -> Optional[tuple[int, tuple]]:
    """(group slot, values) of a replica id as the lighthouse shows it (with or without torchft's
    ':<uuid>'); None for an id that is not an elastic group's of this signature version."""
    head = replica.split(":", 1)[0]
    match = re.fullmatch(rf"{VERSION}-(.*)_group_(\d+)", head)
    if match is None:
        return None
    return int(match.group(2)), tuple(match.group(1).split("-"))


def _shown(what: str, value: str) -> str:
    if what == "ranks":
        return f"{value} rank{'s' if value != '1' else ''}"
    if what == "model":
        count, _, digest = value.partition("p")
        return f"a model of {int(count):,} parameters (shape digest {digest})" if count.isdigit() else value
    return value


def mismatch_text(mine: Signature, group: int, others: dict) -> Optional[str]:
    """One line naming, for every group in `others` (slot -> values) whose settings differ from
    `mine` (this is group `group`), the settings and both values; None when all agree."""
    parts = []
    for other, values in sorted(others.items()):
        if len(values) != len(mine.items):
            parts.append(f"group {other} runs another version of fl-megatron's elastic settings")
            continue
        for (what, value), theirs in zip(mine.items, values):
            if value == theirs:
                continue
            if what == "ranks":
                parts.append(f"group {group} has {_shown(what, value)}, group {other} has {_shown(what, theirs)}")
            else:
                parts.append(f"{what}: group {group} has {_shown(what, value)}, group {other} has "
                             f"{_shown(what, theirs)}")
    return "; ".join(parts) or None
