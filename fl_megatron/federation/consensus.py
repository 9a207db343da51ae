"""DBench-style metrics at a sync, before any mixing: how far the federation groups' parameters
are apart (the consensus distance), each group's parameter norm, and the same per tensor.

Consensus distance (Kong et al., 2021): Xi^2 = (1/G) sum_g ||x_g - x_mean||^2 over the whole
model. Every rank samples the same contiguous blocks of its shards as its peers (exact when its
shards hold at most `max_samples` elements), all-reduces the sample over the peer group for the
mean, and one small reduction over the job (inside the group, then over the peer group) sums
deviations, sample counts and exact squared norms per tensor and per group. The sample's
all-reduce is the only shard data that moves.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

MAX_SAMPLES = 1 << 16     # elements per rank sampled for the distance (512 KiB in fp64)
SAMPLE_BLOCK = 1024       # contiguous elements per sampled block of the averager's variance metric
CONSENSUS_BLOCK = 64      # the consensus samples smaller blocks: spread wider, less biased by layout


def sampled_blocks(flat: torch.Tensor, stride: int, block: int = SAMPLE_BLOCK) -> torch.Tensor:
    """Every `stride`-th block of `block` elements of a 1-D tensor (all of it for stride 1)."""
    if stride == 1:
        return flat
    blocks = flat.numel() // block
    return flat.narrow(0, 0, blocks * block).view(blocks, block)[::stride].reshape(-1)


@dataclass
class Consensus:
    """The metrics of one sync (identical on every rank)."""

    distance: float            # Xi = sqrt((1/G) sum_g ||x_g - mean||^2)
    relative: float            # Xi^2 / ((1/G) sum_g ||x_g||^2): scale-free, what Ada reads
    variance: float            # per element: mean over elements of the variance across groups
    group_norms: list          # ||x_g|| per group
    group_bytes: list          # bytes each group sent to other groups at this sync (set by the engine)
    sample_bytes: int          # this rank's sample payload (counted as inter-group traffic)
    elements: float            # parameter elements of the model
    tensors: dict = field(default_factory=dict)  # name -> {"distance", "variance", "norms"}


@torch.no_grad()
def measure(views: list, groups, group: int, counts: bool, max_samples: int = MAX_SAMPLES) -> Consensus:
    """The metrics of `views` ((name, this rank's fp32 shard of it) in the same order on every
    rank of the job; collective over the peer and federation groups of `groups`, a
    ProcessGroups). `counts`: whether this rank's shards count (False on all but one replica of
    an HSDP shard, which holds the same values). `max_samples` 0: every element."""
    num_groups, device_type = groups.layout.num_groups, groups.device_type
    flats = [t.reshape(-1) for _, t in views]
    own = sum(f.numel() for f in flats)
    stride = math.ceil(own / max_samples) if 0 < max_samples < own else 1
    # every tensor gets at least its first block, so that each has a per-tensor figure
    pieces = [(sampled_blocks(f, stride, CONSENSUS_BLOCK) if f.numel() >= CONSENSUS_BLOCK * stride
               else f[:CONSENSUS_BLOCK]).double() for f in flats]
    sample = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.float64)
    mean = sample.clone()
    dist.all_reduce(mean, group=groups.peer)
    mean.div_(num_groups)
    t = len(views)
    # per tensor: squared deviations of the sample, sample size, exact squared norm, element count,
    # summed on the shards' device (one transfer at the all-reduce, not one per tensor)
    table = torch.zeros(4 + num_groups, t, dtype=torch.float64, device=sample.device)
    if counts and t:
        sizes = [p.numel() for p in pieces]
        table[0] = torch.stack([d.pow(2).sum() for d in (sample - mean).split(sizes)])
        table[1] = torch.tensor(sizes, dtype=torch.float64, device=sample.device)
        table[2] = torch.stack([torch.linalg.vector_norm(f, dtype=torch.float64) for f in flats]).pow(2)
        table[3] = torch.tensor([f.numel() for f in flats], dtype=torch.float64, device=sample.device)
        table[4 + group] = table[2]
    sample_bytes = sample.numel() * sample.element_size()  # fp64: deviations are tiny next to the values

    totals = table.to(device_type)
    groups.all_reduce_job(totals)
    totals = totals.cpu()
    dev, cnt, sq, numel = totals[0], totals[1], totals[2], totals[3]
    # each tensor's sampled variance weighted by its size (a stratified estimate: small tensors,
    # sampled more densely than large ones, do not skew it)
    per_tensor = torch.where(cnt > 0, dev / cnt.clamp_min(1), torch.zeros_like(dev))
    elements = float(numel.sum()) / num_groups
    variance = _ratio((per_tensor * numel).sum(), numel.sum())
    distance_sq = variance * elements
    mean_sq_norm = float(sq.sum()) / num_groups
    tensors = {name: {"distance": math.sqrt(float(per_tensor[i]) * float(numel[i]) / num_groups),
                      "variance": float(per_tensor[i]),
                      "norms": [math.sqrt(float(x)) for x in totals[4:, i]]}
               for i, (name, _) in enumerate(views)}
    return Consensus(math.sqrt(distance_sq), distance_sq / mean_sq_norm if mean_sq_norm > 0 else 0.0, variance,
                     [math.sqrt(float(x)) for x in totals[4:].sum(dim=1)], [0] * num_groups, sample_bytes,
                     elements, tensors)


def _ratio(num: torch.Tensor, den: torch.Tensor) -> float:
    return float(num / den) if den > 0 else 0.0
