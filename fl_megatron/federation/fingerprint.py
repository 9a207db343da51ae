"""A fingerprint of a sharded model that does not depend on how it is sharded.

Groups of unequal size hold the same parameters cut differently, so their shards' hashes cannot be
compared. Here every element contributes a 64-bit mix of its global position and its bits, and the
contributions are summed modulo 2^64: each rank sums its own elements, the group adds the ranks'
sums. Any cut of the same values gives the same number, and a changed bit, or two values swapped,
changes it (with the chance of a 64-bit collision). Nothing is gathered. For tests and
--fl-sync-digest, not for security.
"""

from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed 64-bit integer
_MIX_1 = -4658895280553007687   # 0xBF58476D1CE4E5B9
_MIX_2 = -7723592293110705685   # 0x94D049BB133111EB


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping products; logical shifts by masking)."""
    z = (z ^ _logical_shift(z, 30)) * _MIX_1
    z = (z ^ _logical_shift(z, 27)) * _MIX_2
    return z ^ _logical_shift(z, 31)


def _logical_shift(z: torch.Tensor, bits: int) -> torch.Tensor:
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def shard_fingerprints(shards: Sequence[torch.Tensor], starts: Sequence[int], chunk: int = 1 << 20) -> List[int]:
    """Per tensor, the sum over this rank's elements (tensor t's flat shard, its first element at
    global position `starts[t]`) of mix(position, bits), modulo 2^64 (as signed int64)."""
    out = []
    for shard, start in zip(shards, starts):
        flat = shard.detach().reshape(-1)
        bits = (flat.view(torch.int32) if flat.element_size() == 4 else flat.view(torch.int16)).to(torch.int64)
        total = torch.zeros((), dtype=torch.int64, device=flat.device)
        for lo in range(0, flat.numel(), chunk):
            part = bits[lo:lo + chunk]
            where = torch.arange(start + lo, start + lo + part.numel(), dtype=torch.int64, device=flat.device)
            total += _mix((where * _GOLDEN) ^ _mix(part + 1)).sum()
        out.append(int(total))
    return out


def group_fingerprint(shards: Sequence[torch.Tensor], ranges: Sequence[Tuple[int, int]], group,
                      counts: bool = True) -> str:
    """The fingerprint of the model this group holds (collective over `group`): every tensor's
    rank sums added over the group, all tensors folded into one 16-hex-digit string. `counts`:
    False on HSDP replicas other than the first (their shards are already counted)."""
    sums = shard_fingerprints(shards, [lo for lo, _ in ranges]) if counts else [0] * len(shards)
    mine = torch.tensor(sums, dtype=torch.int64, device=shards[0].device if shards else "cpu")
    dist.all_reduce(mine, group=group)
    folded = _mix(mine * torch.arange(1, mine.numel() + 1, dtype=torch.int64, device=mine.device)).sum()
    return f"{int(folded) & ((1 << 64) - 1):016x}"
