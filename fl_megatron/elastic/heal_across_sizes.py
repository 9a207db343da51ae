"""A heal between elastic groups of unequal size.

torchft heals rank k of a group from rank k of a live one, which needs identical shard layouts.
Here torchft's Manager runs on each group's first rank only (group_quorum.py), so its transfer
carries only what is the same on every rank: the training position, the step counts, the outer
optimizer's scalars. Everything cut as the shards are (the inner optimizer's moments, the outer
anchors and momenta, and at start-up the shards themselves) goes atom by atom from the source
group's owners to the healing group's (federation/atom_transfer.py), so any size heals from any
size and nothing is gathered. As in the equal case, the healing group then takes part in the
sync as a receiver, which sets its shards; error-feedback residuals start at zero.
"""

from typing import Optional, Sequence

import torch

from ..atom_plan import AtomPlan
from ..federation.atom_average import fragment_windows
from ..federation.atom_transfer import copy_across_groups_
from ..federation.failed_collective import PeerLatch, call_directly
from ..federation.outer import OUTER_STATE_PREFIX
from .healing import HealingState, is_residual
from .quorum_atoms import QuorumAtoms


class HealAcrossSizes:
    """What one rank sends, takes and copies when a group heals across sizes."""

    def __init__(self, state: HealingState, plan: AtomPlan, rank: int, atoms: QuorumAtoms,
                 bucket_bytes: int = 32 << 20, replica_group=None) -> None:
        """`replica_group`: this rank's HSDP replicas (None: FSDP inside the group)."""
        self.state, self.plan, self.rank, self.atoms = state, plan, rank, atoms
        self.bucket_bytes, self.replica_group = bucket_bytes, replica_group
        self.pending: Optional[dict] = None  # what torchft brought this group's first rank at its heal

    # --- through torchft, first rank to first rank --------------------------------------------
    def source(self) -> dict:
        """torchft's state_dict on a live group's first rank (its quorum thread: reads, no
        collective): the position and every small piece of state, as host copies."""
        s = self.state
        streams, rest = s.backend.atom_optimizer_state()
        engine_streams, engine_scalars = self._engine_split()
        return {**s.position(), "mode": s.engine.mode.fields(), "optimizer": bool(streams),
                "optimizer_rest": [t.detach().to("cpu", copy=True) for t, _ in rest],
                "engine_streams": sorted(engine_streams),
                "engine_scalars": {k: v.detach().to("cpu", copy=True) for k, v in engine_scalars.items()}}

    def receive(self, state: dict) -> None:
        """torchft's load_state_dict on the healing group's first rank: kept for `take_part`,
        which every rank of the group runs once the quorum's groups know who heals."""
        self.pending = state

    # --- every rank of the live groups --------------------------------------------------------
    def take_part(self, source: int, healing: Sequence[int], live: Sequence[int], taken: Optional[dict]) -> int:
        """After a quorum at which `healing` groups healed: the `source` group's ranks send, the
        healing groups' ranks (given `taken`, what their first rank received) prepare and receive,
        the other live groups' ranks do nothing. Returns the bytes this rank sent."""
        group = self.plan.group_of(self.rank)
        if group in healing:
            if taken is None:
                raise RuntimeError("this group heals but its first rank received no state from the live groups")
            at_start = self._prepare(taken)
        elif group == source:
            at_start = self.state.at_start
        else:
            return 0
        s = self.state
        streams = [s.backend.atom_shards()] if at_start else []
        streams += s.backend.atom_optimizer_state()[0]
        engine_streams, _ = self._engine_split()
        # a source goes on whatever happens to the healing group: a rank of it lost during the copy
        # (it restarts and heals again) is remembered, the rest of the copy skipped; the next
        # sync's vote then tells every live group (a receiver's own failure ends its job)
        call = PeerLatch() if group == source else call_directly
        copy = dict(plan=self.plan, rank=self.rank, communicators=self.atoms.communicators, source=source,
                    receivers=healing, live=live, bucket_bytes=self.bucket_bytes, replica_group=self.replica_group,
                    call=call)
        sent = copy_across_groups_(streams=streams, **copy)
        windows = self._windows()
        for fragment, key in sorted(engine_streams):  # each fragment's state holds its window of the shards
            sent += copy_across_groups_(streams=[engine_streams[fragment, key]], window=windows[fragment], **copy)
        if group in healing:
            s.backend.refresh_after_sync()
        return sent

    def _prepare(self, taken: dict) -> bool:
        """A healing rank makes the sender's state structure (same keys, its own layout) and takes
        the sender's small state; returns whether the shards travel too (a heal at start-up)."""
        s = self.state
        if taken["mode"] != s.engine.mode.fields():
            raise ValueError("a heal across group sizes into another sync mode (--fl-tune is refused for groups of "
                             "unequal size)")
        if taken["optimizer"]:
            _, rest = s.backend.atom_optimizer_state(make=True)
            if len(rest) != len(taken["optimizer_rest"]):
                raise ValueError(f"the optimizer state received has {len(taken['optimizer_rest'])} small tensors, "
                                 f"this rank's has {len(rest)} (a group with another optimizer)")
            for (target, write), value in zip(rest, taken["optimizer_rest"]):
                if write is None:
                    target.copy_(value)
                else:
                    write(value)
        else:
            s.backend.reset_optimizer_state()
        mine = _carried(s.engine.state_tensors())
        if taken["engine_streams"] or taken["engine_scalars"]:
            count = len(self.plan.numels)
            shaped = {_stream_name(fragment, key, i, self._fragments): torch.empty_like(
                mine[_stream_name(fragment, "anchor", i, self._fragments)])
                for fragment, key in taken["engine_streams"] for i in range(count)}
            device = next(iter(mine.values())).device if mine else "cpu"
            s.engine.load_state_tensors({**shaped, **{k: v.to(device) for k, v in taken["engine_scalars"].items()}})
        s.engine.forget_residuals()
        s.take_position(taken)
        return taken["at_start"]


    @property
    def _fragments(self) -> int:
        return self.state.engine.mode.fragments

    def _windows(self) -> list:
        """Each fragment's window over the model's elements (None: one fragment, whole shards)."""
        return fragment_windows(self.plan, self._fragments) if self._fragments > 1 else [None]

    def _engine_split(self) -> tuple[dict, dict]:
        """This rank's carried engine state split as `_engine_split` says, for its fragments."""
        return _engine_split(_carried(self.state.engine.state_tensors()), len(self.plan.numels), self._fragments)


def _carried(tensors: dict) -> dict:
    """The engine's state a heal carries: all but the error-feedback residuals."""
    return {k: v for k, v in tensors.items() if not is_residual(k)}


def _stream_name(fragment: int, key: str, i: int, fragments: int) -> str:
    """The engine state's name (SyncState.state_tensors) of stream `key` ("anchor", or an outer
    optimizer key) of fragment `fragment` for tensor `i`."""
    return _outer_prefix(fragment, fragments) + (f"anchor.{i}" if key == "anchor" else f"state.{i}.{key}")


def _outer_prefix(fragment: int, fragments: int) -> str:
    """Where fragment `fragment`'s outer state starts in the engine state's names."""
    return (f"fragment{fragment}." if fragments > 1 else "") + OUTER_STATE_PREFIX


def _engine_split(tensors: dict, count: int, fragments: int = 1) -> tuple[dict, dict]:
    """The engine's carried state as (streams by (fragment, key): each tensor's anchor-shaped
    state in the plan's order, a fragment's over its window of the shards; the rest by name: the
    outer optimizer's step counts)."""
    if not tensors:
        return {}, {}
    if _stream_name(0, "anchor", 0, fragments) not in tensors:
        raise ValueError(f"engine state without anchors for {fragments} fragment(s) cannot be cut across group "
                         f"sizes: {sorted(tensors)[:3]}")
    streams = {}
    for fragment in range(fragments):
        anchors = [tensors[_stream_name(fragment, "anchor", i, fragments)] for i in range(count)]
        state = _outer_prefix(fragment, fragments) + "state."
        keys = {name[len(state):].split(".", 1)[1] for name in tensors if name.startswith(state)}
        streams[fragment, "anchor"] = anchors
        for key in sorted(keys):
            values = [tensors.get(_stream_name(fragment, key, i, fragments)) for i in range(count)]
            if all(v is not None and v.shape == a.shape for v, a in zip(values, anchors)):
                streams[fragment, key] = values
    inside = {_stream_name(fragment, key, i, fragments) for fragment, key in streams for i in range(count)}
    return streams, {k: v for k, v in tensors.items() if k not in inside}
