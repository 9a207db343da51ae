"""What a sync that may be voted down (elastic mode) keeps to undo itself: host copies."""

from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass
class HostBackup:
    """Host copies of the engine's state tensors (anchors, outer state, error-feedback residuals)
    and, once `keep_shards` ran, of a rank's shards: one more fp32 copy of the shards in host
    memory while a sync runs. An overlapped sync keeps the state at its launch (its exchange
    changes the residuals in the background) and the shards at its landing (they trained on)."""

    state: dict
    shards: Optional[list] = None

    def keep_shards(self, shards: list) -> None:
        """Copy `shards` now (once: a later call keeps the first copy)."""
        if self.shards is None:
            self.shards = _host_copies(shards)

    @torch.no_grad()
    def restore(self, shards: list, load_state: Callable[[dict], None]) -> None:
        """Write the copies back into `shards` (in place, where kept) and through `load_state`."""
        for shard, saved in zip(shards, self.shards or ()):
            shard.copy_(saved)
        load_state(self.state)


def _host_copies(tensors) -> list:
    return [t.detach().to("cpu", copy=True) for t in tensors]


def host_backup(state: dict) -> HostBackup:
    """The state tensors' copies; the shards' follow with `keep_shards`."""
    return HostBackup(dict(zip(state, _host_copies(state.values()))))
