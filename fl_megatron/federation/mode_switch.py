"""Carrying the outer optimizer's state across a change of fragments (--fl-tune switching modes).

Each fragment's outer optimizer keeps its state per view of the shards (fragments.py cuts the
shards, taken as one flat sequence, into contiguous ranges). The state of all fragments is
written into shard-shaped buffers through the old cut, then read back through the new one, so
every element keeps its own momentum (or Adam moments) whatever the fragments become. A switch
between syncs carries the anchors the same way (`copy_in_element_order`), element by element.
"""

import torch

from .fragments import fragment_views
from .outer import OuterOptimizer


@torch.no_grad()
def recut_outer_state(old: list[OuterOptimizer], old_fragments: int, new: list[OuterOptimizer],
                      new_fragments: int, shards: list[torch.Tensor]) -> None:
    """Copy the per-element state of `old` (cut into `old_fragments`) into `new` (cut into
    `new_fragments`), both over `shards`. Scalars (Adam's step count) are taken from the first
    fragment. Optimizers of different kinds keep their fresh state."""
    if not old or not new or old[0].kind != new[0].kind:
        return
    first = old[0].optimizer.state.get(old[0].anchors[0], {})
    if not first:
        return
    buffers = {k: [torch.zeros_like(s, dtype=torch.float32) for s in shards] for k, v in first.items()
               if k != "step" and torch.is_tensor(v)}
    for key, whole in buffers.items():
        for outer, views in zip(old, fragment_views(whole, old_fragments)):
            for anchor, view in zip(outer.anchors, views):
                value = outer.optimizer.state.get(anchor, {}).get(key)
                if value is not None:
                    view.copy_(value.view_as(view))
    for outer, index in zip(new, range(new_fragments)):
        cut = {k: fragment_views(whole, new_fragments)[index] for k, whole in buffers.items()}
        for i, anchor in enumerate(outer.anchors):
            state = {k: views[i].detach().clone().view_as(anchor) for k, views in cut.items()}
            if "step" in first:
                state["step"] = first["step"].clone()
            outer.optimizer.state[anchor] = state


@torch.no_grad()
def copy_in_element_order(source: list[torch.Tensor], target: list[torch.Tensor]) -> None:
    """Copy `source` into `target`, both taken as one flat sequence of elements (each list in the
    shards' element order, cut differently): no buffer of the whole, one slice at a time."""
    sources, targets = [t.view(-1) for t in source], [t.view(-1) for t in target]
    if sum(t.numel() for t in sources) != sum(t.numel() for t in targets):
        raise ValueError("copy_in_element_order: the two cuts hold different numbers of elements")
    j, at_target = 0, 0
    for piece in sources:
        at_source = 0
        while at_source < piece.numel():
            while targets[j].numel() == at_target:
                j, at_target = j + 1, 0
            n = min(piece.numel() - at_source, targets[j].numel() - at_target)
            targets[j].narrow(0, at_target, n).copy_(piece.narrow(0, at_source, n))
            at_source, at_target = at_source + n, at_target + n
