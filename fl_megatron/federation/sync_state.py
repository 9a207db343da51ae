"""What a rank keeps between syncs for one sync mode: one averager (with its error-feedback
residuals) and one outer optimizer (anchors and state) per fragment, and the fp32 averager of the
inner optimizer's moments. A switch of mode makes a new state from the old one: residuals carry
over while the codec and the fragments stay, the outer state is re-cut for the new fragments."""

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..config.parallel import FederationConfig
from ..config.sync_mode import SyncMode
from .averaging import ShardAverager
from .fragments import fragment_views
from .ledger import CommLedger
from .mode_switch import copy_in_element_order, recut_outer_state
from .outer import OuterOptimizer


@dataclass(frozen=True)
class AveragerSettings:
    """What every averager of a rank shares: its default peer group, the HSDP replica group and
    split, the bucket size, the ledger and the network tiers (or, for groups of unequal size, what
    makes their averager)."""

    peer: object
    num_groups: int
    replica: object
    replicas: int
    replica_index: int
    replica_split: bool
    bucket_bytes: int
    ledger: CommLedger
    peer_tier: str
    replica_tier: str
    # groups of unequal size: unequal_groups.AtomAveraging, whose averagers replace ShardAverager
    # and whose fragments are cut from the model's elements, the same in every group
    atoms: Optional[object] = None

    def make(self, sync_dtype: str = "fp32", error_feedback: bool = False,
             fragment: Optional[tuple] = None, topk_density: float = 0.0, decay: float = 1.0) -> ShardAverager:
        """An averager (of fragment `fragment` = (index, count); a ShardAverager takes the fragment's
        views as they come). `topk_density`: the sparse sync's (not for groups of unequal size)."""
        if self.atoms is not None:
            if topk_density:
                raise ValueError("the sparse sync does not average atom by atom (groups of unequal size)")
            return self.atoms.make(sync_dtype, error_feedback, fragment)
        return ShardAverager(self.peer, self.num_groups, replica_group=self.replica, replicas=self.replicas,
                             replica_index=self.replica_index, replica_split=self.replica_split,
                             bucket_bytes=self.bucket_bytes, ledger=self.ledger, peer_tier=self.peer_tier,
                             replica_tier=self.replica_tier, sync_dtype=sync_dtype, error_feedback=error_feedback,
                             topk_density=topk_density, error_feedback_decay=decay)


class SyncState:
    """The averagers and outer optimizers of one sync mode over a rank's shards. `active`: whether
    the run averages at all (a single group or disabled syncing keeps one plain fragment)."""

    def __init__(self, settings: FederationConfig, averaging: AveragerSettings,
                 local_shards: Callable[[], list[torch.Tensor]], active: bool,
                 averagers: Optional[list[ShardAverager]] = None) -> None:
        """`local_shards`: the backend's shards, asked for only where outer optimizers anchor on them."""
        self.settings, self.averaging, self.active = settings, averaging, active
        self.fragments = settings.fragments if active else 1
        self.averagers = averagers or [averaging.make(settings.sync_dtype, settings.error_feedback, (f, self.fragments),
                                                      settings.topk_density, settings.resolved_error_feedback_decay)
                                       for f in range(self.fragments)]
        self.state_averager = averaging.make()  # --fl-inner-state average: the moments, exactly (fp32)
        self._fragment_state_averagers: dict = {}  # groups of unequal size: one per fragment's window
        self.outers = self._new_outers(local_shards()) if active and not settings.plain_average else []

    @property
    def mode(self) -> SyncMode:
        return self.settings.mode

    def views(self, shards: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """`shards` cut into this mode's fragments (one: the shards themselves)."""
        if self.averaging.atoms is not None:
            return self.averaging.atoms.views(shards, self.fragments)
        try:
            return fragment_views(shards, self.fragments)
        except ValueError as e:
            raise ValueError(f"--fl-fragments {self.fragments}: {e} (this rank's shards are too small)") from None

    def inner_state_parts(self, backend, fragment: Optional[int] = None) -> list:
        """What --fl-inner-state average averages at a sync of `fragment` (None: every fragment):
        (averager, moments) pairs. Equal groups: the backend's moment shards, cut into fragments
        as the shards are. Groups of unequal size: each moment stream (`atom_optimizer_state`, in
        the atom plan's order), or its views of the fragment's window, over that window's atoms."""
        cut = fragment is not None and self.fragments > 1
        if self.averaging.atoms is None:
            moments = backend.inner_state_shards()
            if moments and cut:
                moments = fragment_views(moments, self.fragments)[fragment]
            return [(self.state_averager, moments)] if moments else []
        streams = backend.atom_optimizer_state()[0]
        if not cut:
            return [(self.state_averager, stream) for stream in streams]
        if fragment not in self._fragment_state_averagers:
            self._fragment_state_averagers[fragment] = self.averaging.make(fragment=(fragment, self.fragments))
        averager = self._fragment_state_averagers[fragment]
        return [(averager, self.averaging.atoms.views(stream, self.fragments)[fragment]) for stream in streams]

    def outer(self, fragment: int) -> Optional[OuterOptimizer]:
        return self.outers[fragment] if self.outers else None

    def _new_outers(self, shards: list[torch.Tensor]) -> list[OuterOptimizer]:
        s = self.settings
        return [OuterOptimizer(views, s.outer_optimizer, s.resolved_outer_lr, s.outer_momentum)
                for views in self.views(shards)]

    def switched(self, settings: FederationConfig, shards: list[torch.Tensor], between_syncs: bool = False) -> "SyncState":
        """This state carried into `settings`' mode, over `shards`: right after a full sync (the
        anchors equal the shards), or `between_syncs` (nothing in flight): each element keeps its
        anchor, its value at its last sync, under the new cut. Residuals carry over while the
        precision and the fragments stay (otherwise at most one quantisation step of each element
        is not sent again); the outer optimizer's per-element state is re-cut for the new fragments.
        At most one more copy of the anchors lives during the switch."""
        if between_syncs and not self.can_switch_between_syncs(settings):
            raise ValueError(f"no switch to {settings.mode.label()} between syncs: it keeps anchors and this mode "
                             "has none to carry over (or the fragments are cut by atoms); switch after a full sync")
        old = self.settings
        keep = _wire_format(old) == _wire_format(settings)
        new = SyncState(settings, self.averaging, lambda: shards, self.active, self.averagers if keep else None)
        if self.outers and new.outers:
            if between_syncs:
                copy_in_element_order([a for o in self.outers for a in o.anchors],
                                      [a for o in new.outers for a in o.anchors])
            recut_outer_state(self.outers, self.fragments, new.outers, new.fragments, shards)
        return new

    def can_switch_between_syncs(self, settings: FederationConfig) -> bool:
        """Whether `settings`' mode can take over between syncs: it averages the shards themselves
        (the plain average), or this mode's anchors carry over. Groups of unequal size cut their
        fragments by atoms, which the carried anchors do not follow."""
        return self.active and self.averaging.atoms is None and (settings.plain_average or bool(self.outers))

    # --- what a checkpoint, a heal or a rollback carries ----------------------------------
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Outer anchors and state, and error-feedback residuals, by name (empty for the plain average)."""
        out = {}
        for fragment in range(self.fragments):
            prefix = self._prefix(fragment)
            if self.outers:
                out.update({prefix + k: v for k, v in self.outers[fragment].state_tensors().items()})
            out.update({f"{prefix}residual.{i}": r for i, r in self.averagers[fragment].residuals.items()})
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore `state_tensors` (on the shards' device already)."""
        for fragment in range(self.fragments):
            prefix = self._prefix(fragment)
            mine = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            if self.outers:
                self.outers[fragment].load_state_tensors(mine)
            self.averagers[fragment].residuals = {int(k.split(".")[1]): v.clone() for k, v in mine.items()
                                                  if k.startswith("residual.")}

    def _prefix(self, fragment: int) -> str:
        return f"fragment{fragment}." if self.fragments > 1 else ""

    def restart(self, shards: list[torch.Tensor]) -> None:
        """Anchors from `shards` (the loaded ones), fresh outer state, no residuals."""
        if self.outers:
            self.outers = self._new_outers(shards)
        self.forget_residuals()

    def forget_residuals(self) -> None:
        """Error-feedback residuals back to zero (a restart, or a group that healed: the residual
        it received is its source's own compression error, which the source still carries)."""
        for averager in self.averagers:
            averager.residuals = {}


def _wire_format(settings: FederationConfig) -> tuple:
    """What error-feedback residuals are kept for: the codec and the cut they were made under."""
    return (settings.sync_dtype, settings.error_feedback, settings.topk_density, settings.resolved_error_feedback_decay,
            settings.fragments)
