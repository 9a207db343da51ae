"""--fl-tune's rule: the fastest sync mode the user allows, predicted by the cost model from
measured links and compute (pure Python, so it is tested on hand-made link figures).

A mode is a sync precision (fp32, bf16, or int8/int4 with error feedback), an overlap of 0 or
K steps, a number of fragments N and H. Every allowed mode is predicted with the cost model's
step and sync times plus three measured terms the network model has no part for: the codec's
time per element (encoding and decoding int8/int4/bf16), a fixed time per sync (the vote's
small collectives) and how much an exchange running beside compute slows it. An overlap hides
the links' part of a sync behind K steps, at that slowdown; the codec and the vote stay exposed.
The rule takes the fastest mode, then prefers the most exact one predicted within `tolerance`
of it: a smaller H first, then a finer precision, no overlap, fewer fragments. So on fast links
it keeps fp32 at the given H, and the slower the links the more compression, overlap and
fragments it takes, never past the user's bounds.
"""

import dataclasses
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

from ..config.sync_mode import PRECISIONS, SyncMode  # the mode value is configuration
from ..costs import wire_bytes_per_element
from ..topology import Layout
from .network import Cluster
from .timing import Variant, Workload, predict


@dataclass(frozen=True)
class TuneBounds:
    """What the user allows: the lowest precision, the largest H, overlap (of 1 step) or not,
    the most fragments, the memory one rank may use (None: no limit), and the sparse sync's
    density (0: no sparse sync; else int2 values at it)."""

    lowest_precision: str = "int8"
    sync_interval: int = 8
    max_sync_interval: Optional[int] = None
    overlap: bool = True
    max_fragments: int = 4
    memory_limit_bytes: Optional[float] = None
    topk_density: float = 0.0

    @classmethod
    def of(cls, fed, memory_limit_bytes: Optional[float]) -> "TuneBounds":
        """The bounds a run's federation settings (--fl-tune-*) give."""
        return cls(fed.tune_lowest_precision, fed.sync_interval, fed.tune_max_sync_interval, fed.tune_overlap,
                   fed.tune_max_fragments, memory_limit_bytes, fed.tune_topk_density)

    def __post_init__(self) -> None:
        if self.lowest_precision not in PRECISIONS:
            raise ValueError(f"lowest precision {self.lowest_precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.sync_interval < 1 or (self.max_sync_interval or self.sync_interval) < self.sync_interval:
            raise ValueError(f"sync intervals: H={self.sync_interval} must be >= 1 and the largest allowed H "
                             f"({self.max_sync_interval}) at least H")
        if self.max_fragments < 1:
            raise ValueError(f"max_fragments={self.max_fragments} must be at least 1")


def candidate_modes(bounds: TuneBounds) -> list[SyncMode]:
    """Every mode within the bounds: H, then its doublings up to the largest allowed H (and that
    H itself); each precision down to the lowest allowed; N fragments dividing H (powers of two up
    to the most allowed); overlap 0 or 1 where one step fits between two syncs. The sparse sync
    (int2 values at the allowed density) comes after the dense precisions, as the least exact."""
    top = bounds.max_sync_interval or bounds.sync_interval
    intervals, h = [], bounds.sync_interval
    while h <= top:
        intervals.append(h)
        h *= 2
    if top not in intervals:
        intervals.append(top)
    precisions = PRECISIONS[:PRECISIONS.index(bounds.lowest_precision) + 1]
    out = []
    for h in intervals:
        fragments = [n for n in (1, 2, 4, 8, 16) if n <= bounds.max_fragments and h % n == 0]
        codecs = [(dtype, 0.0) for dtype in precisions] + ([("int2", bounds.topk_density)] if bounds.topk_density
                                                             else [])
        for dtype, density in codecs:
            for n in fragments:
                for k in ((0, 1) if bounds.overlap else (0,)):
                    if k < h // n:
                        out.append(SyncMode(dtype, k, n, h, topk_density=density))
    return out


@dataclass(frozen=True)
class ModeEstimate:
    """A mode's predicted figures: tokens/s, the step, one sync (network, codec and fixed time)
    and what of it the overlap leaves exposed, and the memory per rank."""

    mode: SyncMode
    tokens_per_s: float
    step_seconds: float
    sync_seconds: float
    exposed_sync_seconds: float
    memory_bytes: Optional[float] = None
    network_seconds: float = 0.0  # the part of sync_seconds the links take (the cost model's collectives)


@dataclass(frozen=True)
class Measured:
    """What the run measured and the network model cannot know: seconds per shard element of the
    codec per sync precision (fp32: none), and the fixed seconds of one sync's small collectives."""

    codec_seconds_per_element: Mapping[str, float] = dataclasses.field(default_factory=dict)
    seconds_per_sync: float = 0.0
    overlap_interference: float = 0.0  # compute lost per second of an exchange running beside it


def estimate(mode: SyncMode, layout: Layout, work: Workload, cluster: Cluster, measured: Measured,
             replica_split: bool = True, memory_bytes: Optional[float] = None,
             step_seconds: Optional[float] = None) -> ModeEstimate:
    """The cost model's prediction for `mode`, with the measured codec and fixed sync time.
    `step_seconds`: the step as measured (a run knows it; the sync mode does not change it),
    else the cost model's."""
    variant = Variant(mode.label(), layout, mode.sync_interval, replica_split, mode.overlap_steps, "complete",
                      mode.fragments)
    wire = dataclasses.replace(work, master_bytes=wire_bytes_per_element(mode.sync_dtype, mode.topk_density),
                               sync_gathered=bool(mode.topk_density))
    prediction = predict(variant, wire, cluster)
    fragment_elements = -(-work.num_params // mode.fragments) / layout.shard_size
    sync = (prediction.sync_seconds + measured.seconds_per_sync
            + measured.codec_seconds_per_element.get(mode.codec, 0.0) * fragment_elements)
    step = prediction.step_seconds if step_seconds is None else step_seconds
    exposed = sync
    if mode.overlap_steps:  # the links' part hides behind K steps, slowing them by the measured interference;
        # the codec is compute, and the vote is taken before the launch
        window = mode.overlap_steps * step
        network = prediction.sync_seconds
        exposed = (sync - network + max(0.0, network - window)
                   + measured.overlap_interference * min(network, window))
    mean_step = step + exposed / mode.sync_every
    return ModeEstimate(mode, work.tokens_per_step / mean_step, step, sync, exposed, memory_bytes,
                        prediction.sync_seconds)


@dataclass(frozen=True)
class TuneChoice:
    """The chosen mode, the runner-up (the fastest of the others) and every estimate, fastest first;
    `over_memory`: the modes left out for memory."""

    chosen: ModeEstimate
    runner_up: Optional[ModeEstimate]
    ranked: tuple
    over_memory: tuple = ()

    def text(self) -> str:
        line = f"{self.chosen.mode.label()} (predicted {self.chosen.tokens_per_s:,.0f} tok/s)"
        if self.runner_up is not None:
            line += f"; runner-up {self.runner_up.mode.label()} ({self.runner_up.tokens_per_s:,.0f} tok/s)"
        return line


def choose(estimates: Sequence[ModeEstimate], tolerance: float = 0.03,
           memory_limit_bytes: Optional[float] = None, cheapest_to_leave: bool = False) -> TuneChoice:
    """The most exact mode predicted within `tolerance` of the fastest that fits in memory; with
    `cheapest_to_leave` (a choice from estimates that measured figures will revisit) the one of
    them whose sync moves the fewest bytes per element, the most exact of those: leaving a mode
    takes one blocking sync of the whole model in it."""
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance={tolerance} must be in [0, 1)")
    fits = [e for e in estimates if memory_limit_bytes is None or e.memory_bytes is None
            or e.memory_bytes <= memory_limit_bytes]
    over = tuple(e for e in estimates if e not in fits)
    if not fits:
        raise ValueError("no sync mode fits in memory: the smallest needs "
                         f"{min(e.memory_bytes for e in estimates) / 2**30:.1f} GiB per rank, the limit is "
                         f"{memory_limit_bytes / 2**30:.1f} GiB")
    ranked = tuple(sorted(fits, key=lambda e: (-e.tokens_per_s, e.mode.caution())))
    fastest = ranked[0].tokens_per_s
    def preference(e: ModeEstimate) -> tuple:
        return ((wire_bytes_per_element(e.mode.sync_dtype, e.mode.topk_density),) if cheapest_to_leave else ()) \
            + e.mode.caution()

    chosen = min((e for e in ranked if e.tokens_per_s >= (1 - tolerance) * fastest), key=preference)
    runner_up = next((e for e in ranked if e is not chosen), None)
    return TuneChoice(chosen, runner_up, ranked, over)


def tune(bounds: TuneBounds, layout: Layout, work: Workload, cluster: Cluster, measured: Measured,
         replica_split: bool = True, memory_of: Optional[Callable[[SyncMode], float]] = None,
         tolerance: float = 0.03, step_seconds: Optional[float] = None,
         cheapest_to_leave: bool = False) -> TuneChoice:
    """Estimate every mode the bounds allow and choose."""
    estimates = [estimate(m, layout, work, cluster, measured, replica_split, memory_of(m) if memory_of else None,
                          step_seconds) for m in candidate_modes(bounds)]
    return choose(estimates, tolerance, bounds.memory_limit_bytes, cheapest_to_leave)
