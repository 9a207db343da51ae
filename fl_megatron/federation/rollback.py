"""What a sync that may be voted down (elastic mode) keeps to undo itself: host copies."""

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class HostBackup:
    """Host copies of a rank's shards and of the engine's state tensors (anchors, outer state,
    error-feedback residuals): one more fp32 copy of the shards in host memory during a sync."""

    shards: list
    state: dict

    @torch.no_grad()
    def restore(self, shards: list, load_state: Callable[[dict], None]) -> None:
        """Write the copies back into `shards` (in place) and through `load_state`."""
        for shard, saved in zip(shards, self.shards):
            shard.copy_(saved)
        load_state(self.state)


def host_backup(shards: list, state: dict) -> HostBackup:
    return HostBackup([s.detach().to("cpu", copy=True) for s in shards],
                      {k: v.detach().to("cpu", copy=True) for k, v in state.items()})
