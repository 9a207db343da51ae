"""--fl-inner-state at a sync: keep each group's inner optimizer moments, average them exactly
(fp32; left-out groups take the others' mean), or reset them. A sick group restarts its moments
unless they are averaged (a healing group keeps the moments it received). A sync of one fragment
averages the same fraction of the moments, cut the same way, in turn."""

from typing import Callable, Optional

from .averaging import Peers, SyncStats
from .contract import ShardOwner
from .vote import Senders


def settle_inner_state(policy: str, backend: ShardOwner, state, stats: SyncStats, senders: Senders, peers: Peers,
                       sick: bool, fragment: Optional[int] = None,
                       before_change: Callable[[], None] = lambda: None) -> None:
    """Apply `policy` after the shards were exchanged; the moments' bytes go into `stats`.
    `state`: the mode's SyncState, which says what to average with which averager
    (`inner_state_parts`). `sick`: this rank's group was left out as sick. `fragment`: the one
    fragment this sync moved (None: all). `before_change`: called before the moments change (a
    sync that may be voted down keeps them)."""
    if policy == "average":
        parts = state.inner_state_parts(backend, fragment)
        if parts:
            before_change()
        for averager, moments in parts:
            moved = averager.average(moments, senders.include, senders.contributors, peers=peers)
            stats.inter_group_bytes += moved.inter_group_bytes
            stats.intra_group_bytes += moved.intra_group_bytes
    elif policy == "reset" or sick:
        before_change()
        backend.reset_optimizer_state()
