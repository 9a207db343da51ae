"""Predicted time per step and per sync of one layout: compute plus the collectives that run."""

from dataclasses import dataclass
from typing import Optional

from ..costs import CommBreakdown, step_comm, sync_comm
from ..topology import Layout
from .network import Cluster, CollectiveTime, collective_time


@dataclass(frozen=True)
class Workload:
    """What every rank computes and moves in one optimizer step, whatever the layout.

    regathered_params: parameters the backward pass all-gathers again (FSDP2: all but the root
    module's; DeepSpeed: beyond stage3_max_live_parameters); units: separately gathered modules.
    eval_forwards: forward passes of one evaluation (each gathers the parameters once).
    gathered_once: every rank keeps the whole model (megatron-core): one all-gather per step and
    none for evaluation."""

    num_params: int
    regathered_params: int
    units: int
    param_bytes: int
    grad_bytes: int
    micro_batches: int
    tokens_per_step: int
    compute_seconds: float
    master_bytes: float = 4  # bytes per shard element on the inter-group wire (--fl-sync-dtype)
    sync_gathered: bool = False  # the sparse sync: every group's payload all-gathered (--fl-topk-density)
    eval_forwards: int = 0
    gathered_once: bool = False


@dataclass(frozen=True)
class Variant:
    """One way to run the same workload: a layout, H (0: no sync) and the HSDP averaging variant."""

    label: str
    layout: Layout
    sync_interval: int = 0
    replica_split: bool = True
    overlap_steps: int = 0  # --fl-overlap-steps: the sync travels while K steps train
    graph: str = "complete"  # --fl-topology: the graph of a sync (ada: its densest)
    fragments: int = 1  # --fl-fragments: a sync moves 1/N of the shards, every H/N steps

    @property
    def sync_every(self) -> int:
        """Steps between two syncs (H/N with fragments; 0: no sync)."""
        return self.sync_interval // self.fragments


@dataclass(frozen=True)
class Prediction:
    """Seconds and inter-node wire bytes (all nodes together) of one variant."""

    variant: Variant
    compute_seconds: float
    step_comm: tuple[CollectiveTime, ...]
    sync_comm: tuple[CollectiveTime, ...]
    step_seconds: float
    eval_comm_seconds: float
    eval_inter_node_bytes: float

    @property
    def sync_seconds(self) -> float:
        """One sync (of one fragment with --fl-fragments)."""
        return sum(t.seconds for t in self.sync_comm)

    @property
    def step_inter_node_bytes(self) -> float:
        return sum(t.inter_node_wire_bytes for t in self.step_comm)

    @property
    def sync_inter_node_bytes(self) -> float:
        return sum(t.inter_node_wire_bytes for t in self.sync_comm)

    @property
    def exposed_sync_seconds(self) -> float:
        """What a sync adds to the run: all of it, or with K overlapped steps what the K steps'
        time does not cover (the exchange crosses nodes while the group's own traffic stays
        inside them: FL+FSDP with groups within a node)."""
        return max(0.0, self.sync_seconds - self.variant.overlap_steps * self.step_seconds)

    @property
    def mean_step_seconds(self) -> float:
        """One step with the sync amortised over H steps."""
        h = self.variant.sync_every
        return self.step_seconds + (self.exposed_sync_seconds / h if h else 0.0)

    def run_seconds(self, steps: int) -> float:
        """`steps` steps and their syncs (one every H/N steps, and after the last one of every
        fragment, which is blocking)."""
        return self.span_seconds(steps)

    def span_seconds(self, steps: int, warmup: int = 0) -> float:
        """Steps `warmup` + 1 to `steps` of a `steps`-step run and the syncs after them: the
        overlapped ones add what K steps do not cover, the last (of every fragment) all of it."""
        every, last = self.variant.sync_every, self.variant.fragments
        syncs = self.syncs(steps) - (warmup // every if every else 0)
        return (steps - warmup) * self.step_seconds + max(0, syncs - last) * self.exposed_sync_seconds + \
            (last * self.sync_seconds if syncs > 0 else 0.0)

    def syncs(self, steps: int) -> int:
        """Syncs of one fragment each (of the shards without fragments) in `steps` steps: every
        H/N steps, the one after the last step being a sync of all N fragments."""
        h, n = self.variant.sync_every, self.variant.fragments
        if not h or not self.sync_comm or steps < 1:
            return 0
        return steps // h - (steps % h == 0) + n

    def run_inter_node_bytes(self, steps: int, evaluations: int = 0) -> float:
        """Inter-node wire bytes of `steps` steps, their syncs and `evaluations` evaluations."""
        return (steps * self.step_inter_node_bytes + self.syncs(steps) * self.sync_inter_node_bytes
                + evaluations * self.eval_inter_node_bytes)


def _timed(breakdown: CommBreakdown, layout: Layout, cluster: Cluster) -> tuple[CollectiveTime, ...]:
    return tuple(collective_time(c, layout, cluster) for c in breakdown.entries)


def predict(variant: Variant, work: Workload, cluster: Cluster, overlap: float = 0.0,
            compute_seconds: Optional[float] = None) -> Prediction:
    """Time of one step: compute plus the in-group collectives, of which `overlap` (a fraction of the
    smaller of the two) hides behind compute; a sync is blocking and adds its collectives' time."""
    layout = variant.layout
    compute = work.compute_seconds if compute_seconds is None else compute_seconds
    step = _timed(step_comm(layout, work.num_params, work.param_bytes, work.grad_bytes, work.micro_batches,
                            work.regathered_params, work.units, work.gathered_once), layout, cluster)
    fragment = -(-work.num_params // variant.fragments)  # the largest fragment
    sync = _timed(sync_comm(layout, fragment, work.master_bytes, variant.replica_split, variant.graph,
                            work.sync_gathered), layout, cluster) if variant.sync_interval else ()
    comm = sum(t.seconds for t in step)
    gathers = step_comm(layout, work.num_params, work.param_bytes, micro_batches=max(work.eval_forwards, 1),
                        units=work.units).entries
    evaluation = _timed(CommBreakdown(tuple(c for c in gathers if c.name == "all_gather_forward")), layout,
                        cluster) if work.eval_forwards and not work.gathered_once else ()
    return Prediction(variant, compute, step, sync, compute + comm - overlap * min(compute, comm),
                      sum(t.seconds for t in evaluation), sum(t.inter_node_wire_bytes for t in evaluation))


def tokens_per_second(prediction: Prediction, tokens_per_step: int) -> float:
    return tokens_per_step / prediction.mean_step_seconds
