"""The start-up link probe: timed all-reduces over the peer group (the links between federation
groups) and over the federation group (the links inside one), and the sync codec's speed.

Each probed group runs a tiny all-reduce (its time is latency) and all-reduces of growing
payloads until one takes long enough to measure bandwidth or reaches the largest payload; the
ranks of a group agree on every decision (the slowest rank's time), so they run the same
collectives. The figures are the slowest rank's of the whole job (reduced inside the group, then
over the peer group, as every cross-group figure is), so every rank holds the same numbers.
`fl_megatron.cost_model.calibrate` turns them into the cost model's link speeds.
"""

import contextlib
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from ..topology import federation_groups, spans_nodes
from ..config.sync_mode import sparse_codec_name
from ..costs import SPARSE_CHUNK
from .compression import dequantize, quantize
from .groups import ProcessGroups
from .sparse import SparseCodec

SMALL_REPEATS = 5
PAYLOAD_BYTES = (256 << 10, 1 << 20, 4 << 20, 16 << 20)
# a payload that takes this long measures bandwidth well enough: 25 ms against the 0.1-2 ms of a
# tiny all-reduce (each payload size is timed twice, at start-up)
LONG_ENOUGH_S = 0.025
CODEC_ELEMENTS = 1 << 20
IN_GROUP_ELEMENTS = 1 << 16  # the interference loop's own all-reduce inside the group (256 KiB)


@dataclass
class GroupTiming:
    """One probed group: its kind, size and tier, the tiny all-reduce's seconds and the largest
    payload's (bytes, seconds), the median of its repeats and the slowest rank's."""

    group: str
    ranks: int
    tier: str
    small_seconds: float = 0.0
    payload_bytes: int = 0
    payload_seconds: float = 0.0


@dataclass
class LinkProbe:
    """What the probe measured: a timing per probed group, the codec's seconds per shard element
    (encode and decode, twice: what a compressed sync does), and the probe's own duration."""

    timings: list = field(default_factory=list)
    codec_seconds_per_element: dict = field(default_factory=dict)
    seconds: float = 0.0
    overlap_interference: float = 0.0  # compute lost per second of an exchange running beside it (0: free)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LinkProbe":
        return cls([GroupTiming(**t) for t in d.get("timings", [])], dict(d.get("codec_seconds_per_element", {})),
                   float(d.get("seconds", 0.0)), float(d.get("overlap_interference", 0.0)))

    def timing(self, group: str) -> Optional[GroupTiming]:
        return next((t for t in self.timings if t.group == group), None)


def _timed_all_reduce(buf: torch.Tensor, group, repeats: int, agree) -> float:
    """The median over `repeats` of one all-reduce of `buf`, each the slowest rank's of the job."""
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        if buf.is_cuda:
            torch.cuda.synchronize(buf.device)
        start = time.perf_counter()
        dist.all_reduce(buf, group=group)
        if buf.is_cuda:
            torch.cuda.synchronize(buf.device)
        times.append(agree(time.perf_counter() - start))
    return statistics.median(times)


def probe_group(name: str, group, ranks: int, tier: str, device: torch.device, agree, repeats: int = 2) -> GroupTiming:
    """Latency and bandwidth of one group. `agree(seconds)` returns the slowest rank's of the job,
    so every rank makes the same decisions and records the same figures."""
    timing = GroupTiming(name, ranks, tier)
    if ranks < 2:
        return timing
    timing.small_seconds = _timed_all_reduce(torch.zeros(1, device=device), group, SMALL_REPEATS, agree)
    for nbytes in PAYLOAD_BYTES:
        seconds = _timed_all_reduce(torch.ones(nbytes // 4, device=device), group, repeats, agree)
        timing.payload_bytes, timing.payload_seconds = nbytes, seconds
        if seconds >= LONG_ENOUGH_S:
            break
    return timing


def codec_seconds(device: torch.device, dtypes: tuple, sparse: tuple = ()) -> dict:
    """Seconds per element of encoding and decoding twice (a compressed sync encodes its piece
    and the mean, and decodes both) for each of `dtypes`; fp32 costs nothing. `sparse`: (values,
    density) pairs of the sparse sync, timed as one encoding, its residual's update and two
    payloads added up (named as SyncMode.codec names them)."""
    x = torch.randn(CODEC_ELEMENTS, device=device)
    out = {}
    for dtype in (*dtypes, *sparse):
        if dtype == "fp32":
            continue
        start = time.perf_counter()
        if isinstance(dtype, tuple):
            codec, dtype = SparseCodec(dtype[1], dtype[0]), sparse_codec_name(*dtype)
            payload, indices, decoded = codec.encode(x)
            x.view(-1, SPARSE_CHUNK).scatter_add_(1, indices, -decoded)
            total = torch.zeros_like(x)
            for _ in range(2):
                codec.add_decoded_(payload, total)
        for _ in range(2 if dtype in ("bf16", "int8", "int4") else 0):
            if dtype == "bf16":
                x.to(torch.bfloat16).float()
            else:
                bits = 8 if dtype == "int8" else 4
                dequantize(*quantize(x, bits), bits=bits)
        if x.is_cuda:
            torch.cuda.synchronize(device)
        out[dtype] = (time.perf_counter() - start) / CODEC_ELEMENTS
    return out


def _compute(a: torch.Tensor, times: int, group=None) -> float:
    """`times` matrix products, each followed by a small all-reduce over `group` (a training
    step's own collectives inside its group); seconds."""
    talk = torch.zeros(IN_GROUP_ELEMENTS, device=a.device) if group is not None else None
    if a.is_cuda:  # the loop's own stream only: an exchange on a stream of its own is not waited for
        torch.cuda.current_stream(a.device).synchronize()
    start = time.perf_counter()
    for _ in range(times):
        a @ a
        if talk is not None:
            dist.all_reduce(talk, group=group)
    if a.is_cuda:
        torch.cuda.current_stream(a.device).synchronize()
    return time.perf_counter() - start


def overlap_interference(exchange_group, group, device: torch.device, bytes_per_second: float, agree) -> float:
    """How much a training-like loop slows while an exchange runs beside it, as an overlapped sync
    does: matrix products with small all-reduces over the federation group, alone, then while a
    background thread all-reduces over the exchange's own communicator as many bytes as the links
    carry in that time (on CUDA on a stream of its own, each side timing its own stream). The
    loop's extra time over its time beside the exchange (0: free, as NCCL on its own stream nearly
    is; CPU ranks sharing cores lose much of it)."""
    a = torch.randn(256, 256, device=device)
    times = 4
    while _compute(a, times) < 0.05 and times < 1 << 14:
        times *= 2
    times = int(agree(float(times)))  # every rank of a group makes the same collectives
    alone = agree(_compute(a, times, group))
    elements = int(min(max(bytes_per_second * alone, 1 << 18), 64 << 20)) // 4
    buf = torch.ones(elements, device=device)
    box = {}
    # on CUDA the exchange runs on a stream of its own, as an overlapped sync's does (overlap.py):
    # its all-reduce then waits for nothing the loop enqueues, and each side syncs its own stream
    stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(device))  # the buffer is written

    def exchange():
        with contextlib.ExitStack() as on_device:
            if stream is not None:
                on_device.enter_context(torch.cuda.device(device))
                on_device.enter_context(torch.cuda.stream(stream))
            began = time.perf_counter()
            dist.all_reduce(buf, group=exchange_group)
            if stream is not None:
                stream.synchronize()
            box["seconds"] = time.perf_counter() - began

    dist.barrier(group=group)
    thread = threading.Thread(target=exchange, name="fl-probe")
    thread.start()
    beside = _compute(a, times, group)
    thread.join()
    together = min(box.get("seconds", beside), beside)
    return min(1.0, max(0.0, beside - alone) / max(together, 1e-9))


def probe_links(groups: ProcessGroups, device: torch.device, codec_dtypes: tuple = (),
                overlap_group=None, across_groups: bool = True, sparse_codecs: tuple = ()) -> LinkProbe:
    """Probe the peer group and the federation group (every rank calls this at the same point);
    with `overlap_group` (the exchange's own peer communicator) also the overlap's interference;
    `codec_dtypes` and `sparse_codecs` ((values, density) pairs): the codecs' speed.
    `across_groups` False (elastic mode: the groups meet only at syncs): the federation group and
    the codec alone, agreed inside the group; the links between groups are left to the syncs."""
    layout = groups.layout

    def agree(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64, device=device)
        if across_groups:
            groups.all_reduce_job(t, op=dist.ReduceOp.MAX)
        else:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=groups.federation)
        return float(t)

    agree(0.0)  # every rank here: the probe's time is its own, not the wait for the last rank to arrive
    start = time.perf_counter()

    fed_ranks = federation_groups(layout)[groups.coords[0]]
    timings = [probe_group("peer", groups.peer, layout.num_groups, groups.tier("peer"), device, agree)] \
        if across_groups else []
    timings.append(probe_group("federation", groups.federation, layout.group_size,
                               "inter-node" if spans_nodes(layout, fed_ranks) else "intra-node", device, agree))
    codec = {dtype: agree(s) for dtype, s in codec_seconds(device, codec_dtypes, sparse_codecs).items()}
    interference = 0.0
    if overlap_group is not None and across_groups and layout.num_groups > 1:
        peer = timings[0]
        rate = peer.payload_bytes / max(peer.payload_seconds - peer.small_seconds, 1e-9)
        fed = groups.federation if layout.group_size > 1 else None
        interference = agree(overlap_interference(overlap_group, fed, device, rate, agree))
    return LinkProbe(timings, codec, time.perf_counter() - start, interference)
