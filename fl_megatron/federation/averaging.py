"""FedAvg of local shards across peer groups, bucketed and pipelined, never gathering the model.

Each rank averages its own shards with the same shards of the other federation groups. With
HSDP replica split the P replicas of a group hold identical shards, so replica r averages only
slice r of every piece across groups and the replicas then all-gather the slices: inter-group
payload per rank drops by P. Results are written in place into the shards.
"""

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..torch_version import all_gather_flat
from .bucket_buffers import BucketBuffers
from .chunks import Chunk, plan_chunks
from .compression import compressed_mean_
from .consensus import sampled_blocks
from .failed_collective import call_directly
from .graphs import Round
from .ledger import CommLedger
from .rider import Rider, sum_together
from .sparse import sparse_mean_

MAX_PACKED_IN_FLIGHT = 2  # packed bucket buffers alive at once (double buffering)


def gather_slices(buffer: torch.Tensor, slice_index: int, group) -> None:
    """All-gather the equal slices of `buffer` in place over `group` (rank i holds slice i).

    gloo's all-gather is about 3x slower than broadcasts on CPU, so there each slice is
    broadcast from its owner; other backends (NCCL) use the all-gather.
    """
    if dist.get_backend(group) != "gloo":
        part = buffer.numel() // dist.get_world_size(group)
        all_gather_flat(buffer, buffer.narrow(0, slice_index * part, part), group=group)
        return
    slices = buffer.chunk(dist.get_world_size(group))
    works = [dist.broadcast(piece, group_src=i, group=group, async_op=True) for i, piece in enumerate(slices)]
    for work in works:
        work.wait()


def weigh_(buffer: torch.Tensor, include: bool, weight: Optional[float], contributors: Optional[int],
           groups: int) -> Optional[int]:
    """Before a weighted mean: a sender's `buffer` times its `weight` (in place; a group left out
    sends zeros anyway). Returns the divisor of the sum that follows (the senders: `contributors`,
    or all `groups`), or None without a weight (the plain mean's own path, bit for bit)."""
    if weight is None:
        return None
    if include:
        buffer.mul_(weight)
    return contributors if contributors is not None else groups


@dataclass(frozen=True)
class Peers:
    """Who one average runs over: the peer group, how many groups are in it, and what every
    collective over it goes through (`call_directly`; elastic mode: the sync's PeerLatch)."""

    group: object
    size: int
    call: Callable = call_directly


@dataclass
class SyncStats:
    """What one average moved and measured on this rank."""

    inter_group_bytes: int = 0
    intra_group_bytes: int = 0
    collectives: int = 0
    sq_dev_sum: float = 0.0      # sum over sampled elements of (own value - average)^2
    sq_mean_sum: float = 0.0     # sum over sampled elements of average^2
    samples: int = 0
    exchange_seconds: float = 0.0  # an overlapped sync's time in the background thread
    gathered_bytes: int = 0      # of inter_group_bytes, the payloads all-gathered (the sparse sync's)

    def merge(self, other: "SyncStats") -> None:
        """Add another average's counts and sums (several fragments in one sync)."""
        for name in ("inter_group_bytes", "intra_group_bytes", "collectives", "sq_dev_sum", "sq_mean_sum", "samples",
                     "exchange_seconds", "gathered_bytes"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class _InFlight:
    chunk: Chunk
    buffer: torch.Tensor          # the piece (in place) or a packed bucket buffer
    region: torch.Tensor          # the part of `buffer` this rank averages across groups
    valid: int                    # elements of `region` that are real data (not padding)
    stride: int                   # sampling stride for the variance metric
    sample: torch.Tensor          # own values of the sampled blocks, before averaging
    work: Optional[dist.Work] = field(default=None)
    divisor: Optional[int] = None  # a SUM to divide (some groups left out); None: averaged already
    mixing: Optional[Round] = None  # a gossip round: mix `received` into the region when done
    received: list = field(default_factory=list)
    gossip_works: list = field(default_factory=list)
    rider: Optional[Rider] = None  # the first bucket's rider: its payload summed (in the buffer or beside it)


class ShardAverager:
    """Averages a list of shards across the peer group (and, with replica split, the replicas)."""

    def __init__(self, peer_group, num_groups: int, *, replica_group=None, replicas: int = 1,
                 replica_index: int = 0, replica_split: bool = True, bucket_bytes: int = 32 << 20,
                 max_samples: int = 1 << 18, ledger: Optional[CommLedger] = None,
                 peer_tier: str = "inter-node", replica_tier: str = "intra-node",
                 sync_dtype: str = "fp32", error_feedback: bool = False, topk_density: float = 0.0,
                 error_feedback_decay: float = 1.0) -> None:
        if num_groups < 1 or replicas < 1 or not 0 <= replica_index < replicas:
            raise ValueError(f"num_groups={num_groups}, replicas={replicas}, "
                             f"replica_index={replica_index} are inconsistent")
        if replicas > 1 and replica_split and replica_group is None:
            raise ValueError("replica split needs the replica process group")
        self.peers = Peers(peer_group, num_groups)  # unless an average is given its own
        self.replica_group = replica_group
        self.split = replicas if (replica_split and replicas > 1) else 1
        self.replica_index = replica_index if self.split > 1 else 0
        self.bucket_bytes = int(bucket_bytes)
        self.max_samples = max_samples
        self.ledger = ledger
        self.peer_tier, self.replica_tier = peer_tier, replica_tier
        self.sync_dtype, self.error_feedback = sync_dtype, error_feedback
        self.topk_density, self.decay = topk_density, error_feedback_decay  # the sparse sync (sparse.py)
        if topk_density and not error_feedback:
            raise ValueError("a sparse average needs error feedback: what it leaves out is carried to the next")
        self.residuals: dict[int, torch.Tensor] = {}  # error feedback: per piece, this rank's region
        self.buffers = BucketBuffers(keep=MAX_PACKED_IN_FLIGHT)  # packed buckets, kept between syncs on CPU
        self._riding, self._senders = False, None  # an average with a rider: its senders, once it landed

    def can_carry(self, shards: list[torch.Tensor]) -> bool:
        """Whether an average of `shards` can carry a Rider: fp32 data summed by an all-reduce
        (no compression), no replica split, something to average."""
        return (self.sync_dtype == "fp32" and self.split == 1 and sum(s.numel() for s in shards) > 0
                and all(s.dtype == torch.float32 for s in shards))

    def plan(self, shards: list[torch.Tensor]) -> list[Chunk]:
        """How `shards` are cut into collectives (same on every rank of a peer group)."""
        itemsize = shards[0].element_size() if shards else 4
        return plan_chunks([s.numel() for s in shards], max(self.bucket_bytes // itemsize, self.split),
                           replicas=self.split)

    @torch.no_grad()
    def average(self, shards: list[torch.Tensor], include: bool = True,
                contributors: Optional[int] = None, mixing: Optional[Round] = None,
                peers: Optional[Peers] = None, weight: Optional[float] = None,
                rider: Optional[Rider] = None) -> SyncStats:
        """Replace every shard by its average over the federation groups, in place.

        `contributors` < the number of groups leaves some groups out: those ranks pass
        `include=False`, send zeros, and receive the mean of the others. With `mixing` (a
        gossip round, fp32 only) each shard becomes its weighted mix with the same shard of
        the round's neighbour groups instead, by point-to-point sends and receives. `peers`:
        this average's peer group (default: the one the averager was made with). `weight`: this
        group's weight in a weighted mean (the weights of the senders sum to their number,
        vote.token_weight); None: the plain mean. `rider`: a payload on the first all-reduce
        (`can_carry` must hold), inside the first bucket's buffer if it is packed, else beside it
        (rider.py); every bucket is then a SUM corrected by what its landing returns."""
        peers = peers or self.peers
        if rider is not None and (mixing is not None or weight is not None or not self.can_carry(shards)):
            raise ValueError("a rider needs a plain fp32 average without replica split")
        if mixing is not None and (self.sync_dtype != "fp32" or contributors is not None or weight is not None):
            raise ValueError("a gossip round mixes fp32 shards of every group (no compression, nobody left out, "
                             "no weights)")
        for i, s in enumerate(shards):
            if not s.is_contiguous():
                raise ValueError(f"shard {i} is not contiguous; the backend must hand out contiguous shards")
        if shards and len({s.dtype for s in shards}) != 1:
            raise ValueError(f"shards have mixed dtypes {sorted({str(s.dtype) for s in shards})}")
        stats = SyncStats()
        flats = [s.view(-1) for s in shards]
        chunks = self.plan(shards)
        own = sum(c.padded_length(self.split) for c in chunks) // self.split
        stride = max(1, math.ceil(own / self.max_samples)) if own > self.max_samples else 1
        # squared deviations and squares of the sample, summed on the device: one host sync per average
        sums = torch.zeros(2, dtype=torch.float64, device=shards[0].device if shards else "cpu")
        pending: deque[_InFlight] = deque()
        packed_alive = 0
        left_out = contributors is not None and contributors != peers.size
        # with a rider, how many send is known only when it lands: every bucket is a SUM, divided
        # by the senders the landing counts (the same division the exact path's AVG makes)
        self._riding, self._senders = rider is not None, None
        for index, chunk in enumerate(chunks):
            if not chunk.inplace and packed_alive >= MAX_PACKED_IN_FLIGHT:
                packed_alive -= self._finish(pending.popleft(), flats, stats, sums, peers)
            pending.append(self._start(chunk, flats, stride, stats, peers, index, include,
                                       contributors if left_out else None, mixing, weight,
                                       rider if index == 0 else None))
            packed_alive += not chunk.inplace
        while pending:
            self._finish(pending.popleft(), flats, stats, sums, peers)
        stats.sq_dev_sum, stats.sq_mean_sum = sums.tolist()
        return stats

    def _start(self, chunk: Chunk, flats: list[torch.Tensor], stride: int, stats: SyncStats, peers: Peers,
               index: int = 0, include: bool = True, contributors: Optional[int] = None,
               mixing: Optional[Round] = None, weight: Optional[float] = None,
               rider: Optional[Rider] = None) -> _InFlight:
        extra = rider.payload.numel() if rider is not None and not chunk.inplace else 0  # inside the buffer
        if chunk.inplace:
            seg = chunk.segments[0]
            buffer = flats[seg.index].narrow(0, seg.start, seg.length)
        else:
            padded = chunk.padded_length(self.split)
            buffer = self.buffers.take(flats[chunk.segments[0].index], padded + extra)
            torch.cat([flats[s.index].narrow(0, s.start, s.length) for s in chunk.segments],
                      out=buffer.narrow(0, 0, chunk.length))
            buffer.narrow(0, chunk.length, padded - chunk.length).zero_()  # the padding only
            if extra:  # the rider follows the data (no replica split: the region is the whole buffer)
                buffer.narrow(0, padded, extra).copy_(rider.payload)
        part = (buffer.numel() - extra) // self.split
        start = self.replica_index * part
        region = buffer.narrow(0, start, part + extra)
        valid = max(0, min(part, chunk.length - start))
        sample = sampled_blocks(region.narrow(0, 0, valid), stride).clone()
        weighted = weigh_(region.narrow(0, 0, part), include, weight, contributors, peers.size)
        if weighted is not None:  # a weighted mean: the weighted values summed, divided by the senders
            contributors = weighted
        work, divisor, received, gossip_works = None, None, [], []
        if mixing is not None:
            received = [torch.empty_like(region) for _ in mixing.receives]
            ops = [dist.P2POp(dist.isend, region, group=peers.group, group_peer=g) for g in mixing.sends]
            ops += [dist.P2POp(dist.irecv, buf, group=peers.group, group_peer=g)
                    for buf, (g, _) in zip(received, mixing.receives)]
            gossip_works = (peers.call(dist.batch_isend_irecv, ops) or []) if ops else []
            nbytes = region.numel() * region.element_size() * len(mixing.sends)
        elif self.topk_density:  # every group's payload gathered, added up in group order (sparse.py)
            residual = self.residuals.setdefault(index, torch.zeros_like(region))
            nbytes = peers.call(sparse_mean_, region, peers.group, self.topk_density, self.sync_dtype, residual,
                                decay=self.decay, include=include, contributors=contributors) or 0
            stats.gathered_bytes += nbytes
        elif self.sync_dtype != "fp32":
            residual = None
            if self.error_feedback:
                residual = self.residuals.setdefault(index, torch.zeros_like(region))
            nbytes = peers.call(compressed_mean_, region, peers.group, self.sync_dtype, include=include,
                                contributors=contributors, residual=residual, decay=self.decay) or 0
        else:
            if self._riding:  # a rider's average: a SUM (a left-out group sends zeros)
                if not include:  # its data only: the rider rides on all the same
                    region.narrow(0, 0, part).zero_()
                if rider is not None and not extra:  # an in-place bucket: the rider's sum beside it
                    work = peers.call(sum_together, region, rider.payload, peers.group)
                else:
                    work = peers.call(dist.all_reduce, region, op=dist.ReduceOp.SUM, group=peers.group,
                                      async_op=True)
            elif contributors is None:  # the exact path: every group contributes
                work = peers.call(dist.all_reduce, region, op=dist.ReduceOp.AVG, group=peers.group, async_op=True)
            else:
                if not include:
                    region.zero_()
                work = peers.call(dist.all_reduce, region, op=dist.ReduceOp.SUM, group=peers.group, async_op=True)
                divisor = contributors
            nbytes = part * region.element_size()  # the data's (a rider's few numbers are not counted)
        stats.inter_group_bytes += nbytes
        stats.collectives += 1
        if self.ledger is not None:
            self.ledger.add("inter-group", self.peer_tier, nbytes)
        if extra:  # the data's own view; the rider's part is read when it lands
            rider = Rider(region.narrow(0, part, extra), rider.landed)
            region = region.narrow(0, 0, part)
        return _InFlight(chunk, buffer, region, valid, stride, sample, work, divisor, mixing, received, gossip_works,
                         rider)

    def _finish(self, item: _InFlight, flats: list[torch.Tensor], stats: SyncStats,
                sums: torch.Tensor, peers: Peers) -> int:
        """Complete one piece; returns 1 if it freed a packed buffer."""
        if item.work is not None:
            peers.call(item.work.wait)
        for work in item.gossip_works:
            peers.call(work.wait)
        if item.rider is not None:  # how many sent, from the rider (none: the zeros stay zeros)
            self._senders = max(item.rider.landed(item.rider.payload), 1)
        if self._riding:
            item.region.div_(self._senders)
        if item.mixing is not None:
            item.region.mul_(item.mixing.self_weight)
            for buf, (_, weight) in zip(item.received, item.mixing.receives):
                item.region.add_(buf, alpha=weight)
        if item.divisor is not None:
            item.region.div_(item.divisor)
        averaged = sampled_blocks(item.region.narrow(0, 0, item.valid), item.stride).double()
        # a left-out group's own values may be non-finite: they count as its distance from the mean
        sums[0] += (item.sample.double().nan_to_num(0.0, 0.0, 0.0) - averaged).pow(2).sum()
        sums[1] += averaged.pow(2).sum()
        stats.samples += item.sample.numel()
        if self.split > 1:
            gather_slices(item.buffer, self.replica_index, self.replica_group)
            nbytes = item.region.numel() * item.region.element_size()
            stats.intra_group_bytes += nbytes
            stats.collectives += 1
            if self.ledger is not None:
                self.ledger.add("intra-group", self.replica_tier, nbytes)
        if not item.chunk.inplace:
            offset = 0
            views, targets = [], []
            for seg in item.chunk.segments:
                views.append(item.buffer.narrow(0, offset, seg.length))
                targets.append(flats[seg.index].narrow(0, seg.start, seg.length))
                offset += seg.length
            torch._foreach_copy_(targets, views)
            self.buffers.give_back(item.buffer)
            return 1
        return 0
