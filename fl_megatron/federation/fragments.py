"""Fragments of the local shards (--fl-fragments N, Streaming DiLoCo): each sync moves one.

The shards of a rank, taken as one flat sequence of elements, are cut into N contiguous ranges
of near-equal size; fragment f is the list of views of the shards that fall into range f. The
cut depends only on the shards' sizes, so the same shards of every federation group (and every
replica of a group) are cut at the same places. Fragment f syncs at the steps k * H/N with
k = f + 1 (mod N): each fragment once every H steps, the bytes spread over N smaller syncs.
Groups of unequal size cut the model's elements instead (atom_average.fragment_windows), since
their shards differ.
"""

from typing import Optional

import torch


def fragment_bounds(total: int, fragments: int) -> list[tuple[int, int]]:
    """[start, end) of each fragment in the flat element sequence (the first ones one longer)."""
    if fragments < 1 or total < fragments:
        raise ValueError(f"cannot cut {total} shard elements into {fragments} fragments")
    base, extra = divmod(total, fragments)
    bounds, start = [], 0
    for f in range(fragments):
        end = start + base + (f < extra)
        bounds.append((start, end))
        start = end
    return bounds


def fragment_views(shards: list[torch.Tensor], fragments: int) -> list[list[torch.Tensor]]:
    """The shards cut into `fragments` lists of contiguous flat views (one fragment: the shards)."""
    if fragments == 1:
        return [list(shards)]
    out: list[list[torch.Tensor]] = []
    for start, end in fragment_bounds(sum(s.numel() for s in shards), fragments):
        views, offset = [], 0
        for shard in shards:
            lo, hi = max(start, offset), min(end, offset + shard.numel())
            if lo < hi:
                views.append(shard.view(-1).narrow(0, lo - offset, hi - lo))
            offset += shard.numel()
        out.append(views)
    return out


def due_fragment(step: int, sync_interval: int, fragments: int) -> Optional[int]:
    """The fragment that syncs after step `step` (1-based), or None: one every H/N steps, in turn."""
    every = sync_interval // fragments
    if every <= 0 or step % every:
        return None
    return (step // every - 1) % fragments
