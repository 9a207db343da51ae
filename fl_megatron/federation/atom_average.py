"""FedAvg across federation groups of unequal size, atom by atom, never gathering the model.

`atom_plan` cuts every tensor where any group's shards (or HSDP replica slices) begin, so each
atom has one owner rank per group. A rank averages its atoms over one communicator per owner
tuple, packed into buckets, in the plan's sorted order of tuples on every rank (a common order:
no two ranks wait on each other's later collective, on NCCL's one stream as on gloo). With HSDP
each replica then broadcasts the slices it averaged to the other replicas of its shard.

fp32 (AVG, two buckets in flight), or compressed per bucket over the tuple's communicator
(compression.py: bf16, int8, int4, with error feedback per bucket); blocking, or in an overlapped
sync's thread. Groups left out (sick) send zeros and take the others' mean. The variance metric
samples blocks of the buckets as ShardAverager does. `TensorShards` hands the engine a backend's
shards tensor by tensor, in the plan's order.
"""

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..atom_plan import AtomPlan
from .averaging import SyncStats, weigh_
from .compression import compressed_mean_
from .consensus import sampled_blocks
from .failed_collective import call_directly
from .fragments import fragment_bounds
from .ledger import CommLedger

MAX_IN_FLIGHT = 2  # packed buckets alive at once


@dataclass(frozen=True)
class Piece:
    """Elements [offset, offset + length) of this rank's local shard number `tensor`."""

    tensor: int
    offset: int
    length: int


def build_atom_groups(plan: AtomPlan, rank: int, timeout: Optional[timedelta] = None,
                      backend: Optional[str] = None) -> Dict[Tuple[int, ...], dist.ProcessGroup]:
    """The communicators of `rank`'s owner tuples. Every rank of the world calls it with the same
    plan: one `new_group` per owner tuple, in the plan's sorted order (torch names groups by a
    count and connects only their members; no barrier unless TORCH_DIST_INIT_BARRIER=1)."""
    mine = {atom.owners for atom in plan.rank_atoms(rank)}
    groups = {}
    for owners in plan.owner_tuples():
        group = dist.new_group(list(owners), timeout=timeout, backend=backend)
        if owners in mine:
            groups[owners] = group
    return groups


def _clip(span: Tuple[int, int], window: Tuple[int, int]) -> Tuple[int, int]:
    """The part of `span` inside `window`: [lo, hi) within `span`, empty (lo == hi) where they do
    not meet."""
    lo = min(max(span[0], window[0]), span[1])
    return lo, max(lo, min(span[1], window[1]))


def tensor_windows(plan: AtomPlan, window: Optional[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """Each tensor's part [a, b) (its own element offsets) of a window over all tensors taken as
    one flat sequence in the plan's order (None: every tensor whole)."""
    out, offset = [], 0
    for numel in plan.numels:
        lo, hi = (0, numel) if window is None else _clip((0, numel), (window[0] - offset, window[1] - offset))
        out.append((lo, hi))
        offset += numel
    return out


def fragment_windows(plan: AtomPlan, fragments: int) -> List[Tuple[int, int]]:
    """The model's elements cut into `fragments` near-equal windows, the same in every group
    (--fl-fragments: fragments.py cuts a rank's shards, which differ between groups of unequal size)."""
    return fragment_bounds(sum(plan.numels), fragments)


def window_views(plan: AtomPlan, rank: int, shards: List[torch.Tensor],
                 window: Tuple[int, int]) -> List[torch.Tensor]:
    """One view per tensor of `rank`'s flat shards: the part inside `window` (possibly empty)."""
    views = []
    for t, (shard, w) in enumerate(zip(shards, tensor_windows(plan, window))):
        start, _ = plan.shard_range(rank, t)
        lo, hi = _clip(plan.shard_range(rank, t), w)
        views.append(shard.view(-1).narrow(0, lo - start, hi - lo))
    return views


def window_lengths(plan: AtomPlan, rank: int, window: Optional[Tuple[int, int]]) -> List[int]:
    """The length of each view `window_views` gives `rank` (None: its whole shards)."""
    return [hi - lo for lo, hi in (_clip(plan.shard_range(rank, t), w)
                                   for t, w in enumerate(tensor_windows(plan, window)))]


def pieces_by_tuple(plan: AtomPlan, rank: int, windows: Optional[List[Tuple[int, int]]] = None
                    ) -> Dict[Tuple[int, ...], List[Piece]]:
    """`rank`'s atoms as pieces of its shards (of `windows`' views, see `window_views`), by owner
    tuple: the same lengths in the same order on every owner of a tuple."""
    windows = windows or tensor_windows(plan, None)
    spans = [_clip(plan.shard_range(rank, t), w) for t, w in enumerate(windows)]
    by_tuple: Dict[Tuple[int, ...], List[Piece]] = {}
    for atom in plan.rank_atoms(rank):
        lo, hi = _clip((atom.start, atom.stop), windows[atom.tensor])
        if lo < hi:
            by_tuple.setdefault(atom.owners, []).append(Piece(atom.tensor, lo - spans[atom.tensor][0], hi - lo))
    return by_tuple


def replica_slice_buckets(plan: AtomPlan, rank: int, windows: Optional[List[Tuple[int, int]]],
                          bucket_elements: int) -> List[List[List[Piece]]]:
    """Per replica of `rank`'s shard (HSDP), the buckets of the pieces of the shard that replica
    owns in the plan (averages, or receives in a heal); empty without replicas."""
    f, _, s = plan.shard_of(rank)
    if plan.groups[f].replicas == 1:
        return []
    windows = windows or tensor_windows(plan, None)
    spans = [_clip(plan.shard_range(rank, t), w) for t, w in enumerate(windows)]
    out = []
    for replica in range(plan.groups[f].replicas):
        owner, pieces = plan.groups[f].rank(replica, s), []
        for t in range(len(plan.numels)):
            for a, b, who in plan.replica_runs(rank, t):
                lo, hi = _clip((a, b), windows[t])
                if who == owner and lo < hi:
                    pieces.append(Piece(t, lo - spans[t][0], hi - lo))
        out.append(buckets(pieces, bucket_elements))
    return out


def share_replica_slices_(flats: List[torch.Tensor], slices: List[List[List[Piece]]], replica: int,
                          replica_group) -> List[int]:
    """Each replica broadcasts the slices it owns to the other replicas of its shard (collective
    over the replica group, in replica order); returns the bytes of each bucket this rank sent."""
    sent = []
    for source, owned in enumerate(slices):
        for bucket in owned:
            buffer = pack(bucket, flats)
            dist.broadcast(buffer, group_src=source, group=replica_group)
            if source != replica:
                unpack(buffer, bucket, flats)
            else:
                sent.append(buffer.numel() * buffer.element_size())
    return sent


def buckets(pieces: List[Piece], bucket_elements: int) -> List[List[Piece]]:
    """Consecutive pieces packed up to `bucket_elements` (a longer piece is cut into several)."""
    out, current, size = [], [], 0
    for piece in pieces:
        offset, left = piece.offset, piece.length
        while left:
            take = min(left, bucket_elements - size)
            current.append(Piece(piece.tensor, offset, take))
            size, offset, left = size + take, offset + take, left - take
            if size == bucket_elements:
                out.append(current)
                current, size = [], 0
    if current:
        out.append(current)
    return out


def pack(bucket: List[Piece], flats: List[torch.Tensor]) -> torch.Tensor:
    """A bucket's pieces of the flat shards `flats` in one buffer (a view where it is one piece)."""
    if len(bucket) == 1:  # one stretch of one shard: averaged in place
        p = bucket[0]
        return flats[p.tensor].narrow(0, p.offset, p.length)
    return torch.cat([flats[p.tensor].narrow(0, p.offset, p.length) for p in bucket])


def unpack(buffer: torch.Tensor, bucket: List[Piece], flats: List[torch.Tensor]) -> None:
    """`pack` undone: the buffer's pieces back into `flats`."""
    if len(bucket) == 1:  # `pack` gave a view: averaged (or received) in place already
        return
    targets = [flats[p.tensor].narrow(0, p.offset, p.length) for p in bucket]
    torch._foreach_copy_(targets, list(buffer.split([p.length for p in bucket])))


@dataclass
class _Flight:
    """One bucket's all-reduce in flight: the buffer, this rank's sampled values before it, where
    they go."""

    buffer: torch.Tensor
    own: torch.Tensor
    bucket: List[Piece]
    work: Optional[dist.Work]
    divisor: Optional[int]


class TensorShards:
    """A backend whose shards the engine takes tensor by tensor: `local_shards` is the backend's
    `atom_shards` (views of its fp32 shards, one per parameter, in its `atom_cut`'s order: the
    atom plan's), everything else the backend's own."""

    def __init__(self, backend) -> None:
        self._backend = backend

    def local_shards(self) -> List[torch.Tensor]:
        """Views of the backend's storage: the engine writes them in place."""
        return self._backend.atom_shards()

    def __getattr__(self, name: str):
        return getattr(self._backend, name)


class AtomAverager:
    """Averages one rank's local shards (tensor t: its shard's range of tensor t, flat) over the
    atoms of `plan`."""

    def __init__(self, plan: AtomPlan, rank: int, communicators: Dict[Tuple[int, ...], dist.ProcessGroup], *,
                 replica_group=None, bucket_bytes: int = 32 << 20, ledger: Optional[CommLedger] = None,
                 peer_tier: str = "inter-node", replica_tier: str = "intra-node", sync_dtype: str = "fp32",
                 error_feedback: bool = False, window: Optional[Tuple[int, int]] = None,
                 max_samples: int = 1 << 18) -> None:
        """`window`: average only the elements [start, stop) of the model's tensors taken as one
        flat sequence in the plan's order (a fragment: `fragment_windows`); the shards given to
        `average` are then `window_views` of the rank's shards."""
        f, self.replica_index, _ = plan.shard_of(rank)
        self.windows = tensor_windows(plan, window)
        self.sync_dtype, self.error_feedback = sync_dtype, error_feedback
        self.residuals: Dict[int, torch.Tensor] = {}  # error feedback: per bucket (in the plan's order)
        self.replicas = plan.groups[f].replicas
        if self.replicas > 1 and replica_group is None:
            raise ValueError(f"rank {rank}'s group has {self.replicas} replicas: the replica group is needed")
        self.plan, self.rank, self.replica_group = plan, rank, replica_group
        self.bucket_elements = max(1, int(bucket_bytes) // 4)
        self.ledger, self.peer_tier, self.replica_tier = ledger, peer_tier, replica_tier
        self.spans = [_clip(plan.shard_range(rank, t), w) for t, w in enumerate(self.windows)]
        self.lengths = [hi - lo for lo, hi in self.spans]
        by_tuple = pieces_by_tuple(plan, rank, self.windows)
        # read at every average: in elastic mode each quorum makes them anew (elastic/quorum_atoms.py)
        self.communicators = communicators
        self.rounds = [(owners, buckets(pieces, self.bucket_elements)) for owners, pieces in sorted(by_tuple.items())]
        # the variance metric's sampling stride: about max_samples of this rank's averaged elements
        averaged = sum(p.length for _, buckets in self.rounds for bucket in buckets for p in bucket)
        self.stride = max(1, math.ceil(averaged / max_samples))
        # per replica of this rank's shard: the buckets of the slices it averaged, cut once
        self.replica_slices = replica_slice_buckets(plan, rank, self.windows, self.bucket_elements)

    @torch.no_grad()
    def average(self, shards: List[torch.Tensor], include: bool = True, contributors: Optional[int] = None,
                mixing=None, peers=None, weight: Optional[float] = None) -> SyncStats:
        """Replace every shard by its mean over the groups, in place; returns what it moved and the
        sums of the variance metric. `contributors` < the number of groups: the groups with
        `include=False` send zeros and receive the mean of the others (ShardAverager's signature;
        `peers.call` wraps every cross-group collective; `weight`: this group's weight in a
        weighted mean, see averaging.weigh_)."""
        if mixing is not None:
            raise ValueError("groups of unequal size average over atoms: a gossip round has no peer group to mix along")
        call = peers.call if peers is not None else call_directly
        if len(shards) != len(self.lengths):
            raise ValueError(f"{len(shards)} shards for a plan of {len(self.lengths)} tensors")
        for t, (shard, length) in enumerate(zip(shards, self.lengths)):
            if shard.numel() != length or shard.dtype != torch.float32 or not shard.is_contiguous():
                raise ValueError(f"shard {t}: {shard.numel()} {shard.dtype} elements"
                                 f"{'' if shard.is_contiguous() else ', not contiguous'}; the plan expects "
                                 f"{length} contiguous fp32 elements")
        missing = [owners for owners, _ in self.rounds if owners not in self.communicators]
        if missing:
            raise ValueError(f"no communicator for owner tuple(s) {missing[:3]}: build them with build_atom_groups")
        groups = peers.size if peers is not None else len(self.plan.groups)  # the groups that met
        flats = [s.view(-1) for s in shards]
        stats = SyncStats()
        sums = torch.zeros(2, dtype=torch.float64, device=shards[0].device if shards else "cpu")
        in_flight: List[_Flight] = []
        index = 0
        for owners, owned in self.rounds:
            group = self.communicators[owners]
            if group is None:  # the only owner in the live groups: its elements are their own mean
                index += len(owned)  # (error feedback's residuals keep their buckets' numbers)
                continue
            for bucket in owned:
                if len(in_flight) >= MAX_IN_FLIGHT:
                    self._land(in_flight.pop(0), flats, stats, sums, call)
                buffer = pack(bucket, flats)
                own = sampled_blocks(buffer, self.stride).clone()  # the variance metric's sample, before
                index += 1
                divisor = weigh_(buffer, include, weight, contributors, groups)
                divides = contributors if divisor is None else divisor
                if self.sync_dtype != "fp32":  # encoded, summed in fp32, the mean encoded once (blocking)
                    residual = self.residuals.setdefault(index - 1, torch.zeros_like(buffer)) \
                        if self.error_feedback else None
                    nbytes = call(compressed_mean_, buffer, group, self.sync_dtype, include=include,
                                  contributors=divides, residual=residual) or 0
                    self._land(_Flight(buffer, own, bucket, None, None), flats, stats, sums, call)
                    self._count(stats, nbytes, "inter-group", self.peer_tier)
                    continue
                if divides is None:
                    work = call(dist.all_reduce, buffer, op=dist.ReduceOp.AVG, group=group, async_op=True)
                else:
                    if not include:
                        buffer.zero_()
                    work = call(dist.all_reduce, buffer, op=dist.ReduceOp.SUM, group=group, async_op=True)
                in_flight.append(_Flight(buffer, own, bucket, work, divides))
                self._count(stats, buffer.numel() * 4, "inter-group", self.peer_tier)
        while in_flight:
            self._land(in_flight.pop(0), flats, stats, sums, call)
        stats.sq_dev_sum, stats.sq_mean_sum = sums.tolist()
        shared = share_replica_slices_(flats, self.replica_slices, self.replica_index, self.replica_group)
        for nbytes in shared:
            self._count(stats, nbytes, "intra-group", self.replica_tier)
        return stats

    def _land(self, item: "_Flight", flats: List[torch.Tensor], stats: SyncStats, sums: torch.Tensor, call) -> None:
        if item.work is not None:
            call(item.work.wait)
        if item.divisor is not None:
            item.buffer.div_(item.divisor)
        # a left-out group's own values may be non-finite: they count as its distance from the mean
        averaged = sampled_blocks(item.buffer, self.stride).double()
        sums[0] += (item.own.double().nan_to_num(0.0, 0.0, 0.0) - averaged).pow(2).sum()
        sums[1] += averaged.pow(2).sum()
        stats.samples += item.own.numel()
        unpack(item.buffer, item.bucket, flats)

    def _count(self, stats: SyncStats, nbytes: int, scope: str, tier: str) -> None:
        stats.collectives += 1
        if scope == "inter-group":
            stats.inter_group_bytes += nbytes
        else:
            stats.intra_group_bytes += nbytes
        if self.ledger is not None:
            self.ledger.add(scope, tier, nbytes)
