"""Communication graphs between federation groups, their mixing weights and their bytes.

A gossip round replaces group g's shard by sum_h W[g, h] x_h with a doubly stochastic W, so the
mean over groups is preserved. Undirected graphs (ring, torus) use Metropolis-Hastings weights,
w_gh = 1 / (1 + max(d_g, d_h)); the directed circulant ones (exponential, one-peer exponential)
use uniform weights over the group itself and its in-neighbours. `complete` is FedAvg (the
all-reduce); `none` (an Ada level only) exchanges nothing.
"""

import math
from dataclasses import dataclass

import torch

from ..graph_fit import topology_problem, torus_shape


@dataclass(frozen=True)
class Round:
    """Group g's part of one gossip round: its own weight, the groups it sends its shard to and
    the (group, weight) pairs it receives."""

    self_weight: float
    sends: tuple[int, ...]
    receives: tuple[tuple[int, float], ...]


def _hops(groups: int) -> list[int]:
    """1, 2, 4, ... below `groups`: the exponential graphs' offsets (ceil(log2 G) of them)."""
    return [1 << k for k in range(max(1, math.ceil(math.log2(groups))))] if groups > 1 else []


def _neighbours(name: str, groups: int, g: int) -> set[int]:
    """Undirected neighbours of group g."""
    if name == "ring":
        return {(g - 1) % groups, (g + 1) % groups} - {g}
    rows, cols = torus_shape(groups)
    r, c = divmod(g, cols)
    return {((r - 1) % rows) * cols + c, ((r + 1) % rows) * cols + c, r * cols + (c - 1) % cols,
            r * cols + (c + 1) % cols}


def mixing_matrix(name: str, groups: int, round_index: int = 0) -> torch.Tensor:
    """W (float64, groups x groups) of one round of graph `name`; row g: what group g mixes."""
    problem = topology_problem(name, groups) if name != "none" else None
    if problem or name == "ada":
        raise ValueError(problem or "ada is a schedule of graphs, not one graph")
    w = torch.zeros(groups, groups, dtype=torch.float64)
    if name == "none" or groups == 1:
        return w.fill_diagonal_(1.0)
    if name == "complete":
        return w.fill_(1.0 / groups)
    if name in ("ring", "torus"):
        neighbours = [_neighbours(name, groups, g) for g in range(groups)]
        for g in range(groups):
            for h in neighbours[g]:
                w[g, h] = 1.0 / (1 + max(len(neighbours[g]), len(neighbours[h])))
            w[g, g] = 1.0 - w[g].sum()
        return w
    hops = _hops(groups)
    if name == "one-peer-exponential":
        hops = [hops[round_index % len(hops)]]
    for g in range(groups):
        for h in [g, *((g - hop) % groups for hop in hops)]:
            w[g, h] = 1.0 / (len(hops) + 1)
    return w


def gossip_round(name: str, groups: int, group: int, round_index: int = 0) -> Round:
    """Group `group`'s sends and weighted receives in one round of graph `name` (not complete)."""
    w = mixing_matrix(name, groups, round_index)
    sends = tuple(h for h in range(groups) if h != group and w[h, group] > 0)
    receives = tuple((h, float(w[group, h])) for h in range(groups) if h != group and w[group, h] > 0)
    return Round(float(w[group, group]), sends, receives)
