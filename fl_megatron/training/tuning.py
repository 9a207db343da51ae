"""--fl-tune in a run: choose the sync mode at the first sync from the probed links and the measured
step time, then every --fl-tune-every syncs compare the measured syncs with the prediction and
choose again when the links changed. A choice is applied at a sync boundary: where the current
mode's anchors carry over, before that sync, which runs in the new mode; otherwise (from the
plain fp32 average into a mode with anchors, and in elastic mode) that sync averages every
fragment and blocks, then the engine switches mode (docs/sync-modes.md, "Let it choose").

Every rank decides the same: the figures a decision uses are the slowest rank's of the job
(reduced inside the group, then over the peer group, at a sync step where the groups meet
anyway), and the rule is a pure function of them.

In elastic mode (`by_vote`) the groups meet only inside a sync, through torchft: each group
decides from its own figures (agreed inside the group), its choice rides on the sync's vote and
the lowest-numbered group's choice holds for every group that met (vote.py). No link between
groups is probed at the start: the first choice comes at the second sync, once the first one's
exchange has shown what the links carry. A group that joins later takes the mode and the tuner's
state with the rest of its heal.
"""

import dataclasses
import statistics
import time
from concurrent.futures import Future
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..checkpoint import find_checkpoint, resume_source, saved_mode
from ..config import ResolvedRun
from ..cost_model.calibrate import dry_run_flags
from ..cost_model.calibrate import cluster_from_probe, rescale_tier
from ..cost_model.network import Cluster
from ..cost_model.tune import Measured, ModeEstimate, SyncMode, TuneBounds, TuneChoice, estimate, tune
from ..cost_model.workload import workload_for
from ..costs import wire_bytes_per_element
from ..federation.groups import ProcessGroups
from ..federation.link_probe import LinkProbe
from .compute_probe import ComputeRate, measure_compute_rate
from .dry_run import mode_memory, model_sizes

# a large dense product reaches about this share of a GPU's nominal peak (what --mfu is a share of):
# the peak a measured product rate stands for
DENSE_PRODUCT_SHARE = 0.75
# before step 1, where the trial step measures an overlap's interference only later: what it
# usually is. NCCL on a stream of its own slows the step's kernels a little (memory bandwidth,
# SMs); gloo's threads share the CPU ranks' cores (0.12 to 0.69 measured by trial steps on the
# 2-core harness)
START_INTERFERENCE = {"cuda": 0.1, "cpu": 0.5}
WARMUP_STEPS = 1  # steps left out of the measured step time (the first one builds and warms up)


TRIAL_SHOWS_BANDWIDTH = 1 << 20  # trial elements from which its exchange times the links' bandwidth


class SyncTuner:
    """One rank's view of --fl-tune. `decide` runs at every due sync (before it), `observe_*`
    after every step and sync; `state`/`load_state` go with checkpoints."""

    def __init__(self, run: ResolvedRun, groups: ProcessGroups, probe: LinkProbe, say: Callable[[str], None],
                 device: torch.device, by_vote: bool = False) -> None:
        self.run, self.groups, self.say, self.device = run, groups, say, device  # device: the rank's own
        self.by_vote = by_vote  # elastic mode: agreed inside the group, then in the sync's vote
        fed = run.cfg.federation
        self.bounds = TuneBounds.of(fed, run.cfg.cluster.device_memory_gib * 2**30)
        self.cluster = cluster_from_probe(run.layout, probe, Cluster.from_config(run.cfg.cluster))
        small = sum(t.small_seconds for t in probe.timings)
        # the vote: group, then peers
        self.measured = Measured(dict(probe.codec_seconds_per_element), 2 * small, probe.overlap_interference)
        self.counts, self.largest = model_sizes(run.cfg.model)
        self.num_params = self.counts[0]
        self.step_seconds: list[float] = []
        self.sync_seconds: list[float] = []
        peer = probe.timing("peer")
        self.peer_bytes_per_s = peer.payload_bytes / max(peer.payload_seconds - peer.small_seconds, 1e-9) \
            if peer is not None and peer.payload_bytes else 0.0
        # a step timed beside a trial exchange before the first choice: what an overlap really costs
        self.trial_step = trial_step(fed) if self.peer_bytes_per_s else None
        self.trial: Optional[tuple[float, float]] = None  # (that step's seconds, the exchange's)
        self.trial_info: Optional[dict] = None  # what the trial exchanged, for the first decision's record
        self.decided = False
        self.calibrated = False  # whether measured syncs corrected the probed link speed yet
        self.syncs_since_check = 0
        self.last_record: Optional[dict] = None  # the last decision, for metrics.jsonl
        self.start_choice: Optional[dict] = None  # the choice before step 1 (one world), for config.json

    # --- what the run measured ------------------------------------------------------------
    def observe_step(self, seconds: float) -> None:
        """The wall time of one optimizer step's forward, backward and update on this rank."""
        self.step_seconds.append(seconds)
        del self.step_seconds[:-64]

    def start_trial(self, step: int, engine) -> Optional[Future]:
        """Before optimizer step `step` (1-based): at the trial step, start a throwaway exchange of
        about one step's worth of the links' bytes beside it, in the lowest allowed precision (its
        codec runs in the thread too), never more than a whole sync moves (this rank's shards), the
        same size on every rank."""
        if self.decided or step != self.trial_step or not self.step_seconds:
            return None
        dtype = self.bounds.lowest_precision  # what the overlapped modes that matter send, codec included
        typical = statistics.median(self.step_seconds[WARMUP_STEPS:] or self.step_seconds)  # not the first's set-up
        shard = sum(s.numel() for s in engine.backend.local_shards())
        agreed = torch.tensor([self.peer_bytes_per_s * typical / wire_bytes_per_element(dtype), shard],
                              dtype=torch.float64, device=self.device)
        self._agree(agreed)
        link_worth, largest_shard = agreed.tolist()
        elements = int(min(max(link_worth, 1 << 16), 1 << 25, largest_shard))
        self.trial_info = {"step": step, "elements": elements, "sync_dtype": dtype}
        return trial_exchange(engine, elements, dtype)

    def end_trial(self, trial: Future, step_seconds: float) -> None:
        self.trial = (step_seconds, trial.result())

    def _interference(self, baseline: float) -> float:
        """Step time lost beside the trial exchange per second they overlapped (may exceed 1: the
        exchange costs more than the time it could hide)."""
        if self.trial is None:
            return self.measured.overlap_interference
        with_exchange, exchange = self.trial
        return min(3.0, max(0.0, with_exchange - baseline) / max(min(exchange, with_exchange), 1e-9))

    def observe_sync(self, exchange_seconds: float) -> None:
        self.sync_seconds.append(exchange_seconds)
        self.syncs_since_check += 1

    # --- deciding -------------------------------------------------------------------------
    def measure_compute(self) -> ComputeRate:
        """The device's rate for the model's own matrix products, timed on every rank of the job
        at once (the slowest rank's: the same on each), for the compute estimate before step 1."""
        model, t = self.run.cfg.model, self.run.cfg.training
        dtype = torch.bfloat16 if t.bf16 else torch.float32

        def agree(seconds: float) -> float:
            figure = torch.tensor([seconds], dtype=torch.float64, device=self.device)
            self._agree(figure)
            return float(figure)

        return measure_compute_rate(self.device, dtype, t.micro_batch_size * t.seq_length, model.hidden_size,
                                    model.ffn_hidden_size or 4 * model.hidden_size, agree)

    def choose_at_start(self, now: SyncMode, rate: Optional[ComputeRate] = None) -> SyncMode:
        """Before step 1 (one world): a first choice from the probed links and the compute time a
        step should take (--compute-seconds, else the model's FLOPs at --mfu of the peak the
        device's measured `rate` stands for, else of --peak-tflops), so that no interval runs in a mode the probe
        already rules out. The first sync refines it with the measured step time (its decision is
        still the first choice). The same on every rank: the probe's figures and the rate are the
        job's. Returns the mode to start in."""
        given = self.run.cfg.cluster.compute_seconds is not None
        peak = rate.tflops / DENSE_PRODUCT_SHARE if rate is not None and not given else None
        compute_s = workload_for(self.run, counts=self.counts, peak_tflops=peak).compute_seconds
        source = ("--compute-seconds" if given else
                  f"FLOPs at {self.run.cfg.cluster.mfu:g} of a peak of {peak:.3g} TFLOP/s, from the {rate.tflops:.3g} "
                  f"this device's products ran at" if peak is not None
                  else f"FLOPs at {self.run.cfg.cluster.mfu:g} of --peak-tflops")
        measured, prior = self.measured, None
        if not measured.overlap_interference and self.trial_step is not None:  # the trial will measure it
            prior = START_INTERFERENCE.get(self.device.type, START_INTERFERENCE["cpu"])
            measured = dataclasses.replace(measured, overlap_interference=prior)
        choice = self._choose(compute_s, measured)
        # the first sync chooses again; a different choice there costs one blocking sync in this
        # mode. Where that costs more than the tolerance of an interval, of the modes within the
        # tolerance the one cheapest to leave (fewest bytes), not the most exact
        fed = self.run.cfg.federation
        if choice.chosen.sync_seconds > fed.tune_tolerance * fed.sync_interval * compute_s:
            choice = self._choose(compute_s, measured, cheapest_to_leave=True)
        mode = choice.chosen.mode
        assumed = f", an overlap assumed to slow a step by {prior:.0%} until the trial measures it" if prior else ""
        self.say(f"  fl-tune before step 1: from the probed links and the estimated compute time ({compute_s:.3g} s "
                 f"a step, {source}){assumed}, {'starting in' if mode != now else 'keeping'} " + choice.text()
                 + "\n    (the first sync chooses again from the measured steps)")
        self.start_choice = {"mode": mode.fields(), "label": mode.label(), "estimated_step_seconds": compute_s,
                             "predicted_tokens_per_s": choice.chosen.tokens_per_s,
                             **({"overlap_interference_prior": prior} if prior is not None else {}),
                             **({"device_rate": {**dataclasses.asdict(rate), "tflops": rate.tflops}}
                                if peak is not None else {})}
        return mode

    def decide(self, step: int, now: SyncMode) -> Optional[SyncMode]:
        """At a due sync after `step`, in mode `now`: the new mode when it should change (the caller
        switches before this sync or after it, tuning_hook.before_or_after), else None.
        Logs every decision."""
        fed = self.run.cfg.federation
        if self.decided and not (fed.tune_every and self.syncs_since_check >= fed.tune_every):
            return None
        measured_steps = self.step_seconds[WARMUP_STEPS:] or self.step_seconds
        if not measured_steps:
            return None
        if self.by_vote and not self.decided and not self.sync_seconds:
            return None  # the links between groups are known from a sync's exchange only
        baseline = statistics.median(measured_steps)
        agreed = torch.tensor([baseline, statistics.median(self.sync_seconds) if self.sync_seconds else 0.0,
                               self._interference(baseline), self.trial[1] if self.trial is not None else 0.0],
                              dtype=torch.float64, device=self.device)
        self._agree(agreed)
        step_s, sync_s, interference, trial_s = agreed.tolist()
        interference_from = "the link probe's compute loop" \
            if self.measured.overlap_interference and not self.decided else None
        if self.trial is not None:
            self.measured = dataclasses.replace(self.measured, overlap_interference=interference)
            interference_from = {"trial": self.trial_info, "step_seconds": self.trial[0],
                                 "exchange_seconds": self.trial[1]}
            links = self._links_from_trial(step_s, trial_s)
            if links is not None:
                interference_from["links"] = links
            self.trial = None
        reason = "first choice, from the probed links and the measured step time"
        links = interference_from.get("links") if isinstance(interference_from, dict) else None
        if links is not None:
            reason = (f"first choice, from the measured step time and the {links['tier']} links as the trial exchange "
                      f"showed them ({links['gbps'] * 1e3:.4g} Mbit/s)")
        if self.decided:
            reason = self._recheck(step_s, sync_s, now)
        elif self.by_vote:
            seen = self._recheck(step_s, sync_s, now)
            if seen is None:
                return None
            reason = f"first choice, from the measured step time and the links the first syncs showed ({seen})"
        self.syncs_since_check, self.sync_seconds = 0, []
        if reason is None:
            return None
        self.decided = True
        choice = self._choose(step_s)
        mode = choice.chosen.mode
        change = mode != now
        verb = ("choosing " if change else "keeping ") if self.by_vote else ("switching to " if change else "keeping ")
        self.say(f"  fl-tune at step {step}: {reason}; " + verb
                 + choice.text() + f"\n    (to pin it by hand: {' '.join(mode.flags())})")
        self.last_record = {"step": step, "tune": {
            "reason": reason, "mode": mode.fields(), "label": mode.label(), "flags": mode.flags(), "switched": change,
            "predicted_tokens_per_s": choice.chosen.tokens_per_s,
            "predicted_sync_seconds": choice.chosen.sync_seconds,
            "runner_up": choice.runner_up.mode.label() if choice.runner_up else None,
            "runner_up_tokens_per_s": choice.runner_up.tokens_per_s if choice.runner_up else None,
            "measured_step_seconds": step_s, "overlap_interference": self.measured.overlap_interference,
            **({"overlap_interference_from": interference_from} if interference_from else {}),
            "inter_node_gbps": self.cluster.inter_node_gbps,
            "intra_node_gbps": self.cluster.intra_node_gbps}}
        return mode if change or self.by_vote else None

    def _agree(self, figures: torch.Tensor) -> None:
        """The slowest rank's `figures` (MAX): of the job, or in elastic mode of the group."""
        if self.by_vote:
            dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=self.groups.federation)
        else:
            self.groups.all_reduce_job(figures, op=dist.ReduceOp.MAX)

    def outvoted(self, adopted: Optional[SyncMode], chose: SyncMode) -> None:
        """Elastic mode: the vote did not take this group's choice `chose` (another group's
        `adopted` holds, or the sync was voted down: None). A lost first choice is taken again."""
        if adopted is None and self.last_record is not None and self.last_record["tune"]["reason"].startswith("first"):
            self.decided = False
        if self.last_record is not None:
            self.last_record["tune"]["switched"] = False
            self.last_record["tune"]["outvoted_by"] = adopted.label() if adopted is not None else "a voted-down sync"
        self.say(f"  fl-tune: this group's choice ({chose.label()}) did not hold: "
                 + (f"the vote took {adopted.label()}" if adopted is not None else "the sync was voted down"))

    def _links_from_trial(self, step_s: float, exchange_s: float) -> Optional[dict]:
        """Before the first choice: the trial's exchange (the slowest rank's, beside a step, as an
        overlapped sync runs) against the cost model's time for the same elements; the tier the
        syncs cross takes the speed it showed, since the probe's short collectives, run alone,
        miss what a real exchange meets (its buckets, the codec's passes, the compute beside it).
        None where the trial was too small to show the bandwidth (latency would dominate)."""
        info = self.trial_info
        if info is None or info["elements"] < TRIAL_SHOWS_BANDWIDTH or exchange_s <= 0:
            return None
        dtype, elements = info["sync_dtype"], info["elements"]
        whole = self._estimate(SyncMode(dtype, 0, 1, self.bounds.sync_interval), step_s)
        predicted = whole.network_seconds * elements / (self.num_params / self.run.layout.shard_size)
        measured = exchange_s - self.measured.codec_seconds_per_element.get(dtype, 0.0) * elements
        rescaled = self._rescale_peer_tier(predicted, measured)
        if rescaled is None:
            return None
        tier, gbps = rescaled
        return {"tier": tier, "predicted_seconds": predicted, "measured_seconds": measured, "gbps": gbps}

    def _rescale_peer_tier(self, predicted_s: float, measured_s: float) -> Optional[tuple[str, float]]:
        """The tier the syncs cross made as fast as a transfer predicted at `predicted_s` that took
        `measured_s` shows; returns (that tier, its new Gbit/s), or None (a time not positive)."""
        tier = self.groups.tier("peer")
        rescaled = rescale_tier(self.cluster, tier, predicted_s, measured_s)
        if rescaled is None:
            return None
        self.cluster = rescaled
        return tier, rescaled.inter_node_gbps if tier == "inter-node" else rescaled.intra_node_gbps

    def _recheck(self, step_s: float, sync_s: float, now: SyncMode) -> Optional[str]:
        """Why to choose again, or None. The measured exchange time against the one predicted for
        the current mode, compared by their network parts. The first check after the first choice
        calibrates: the tier the sync crosses takes the speed the syncs showed (the probe's short
        collectives miss what a real sync meets). Later checks choose again only when the ratio
        leaves [1 / (1 + threshold), 1 + threshold]: the links changed."""
        if sync_s <= 0:
            return None
        predicted = self._estimate(now, step_s)
        other = predicted.sync_seconds - predicted.network_seconds  # the codec's and the vote's
        network_predicted = max(predicted.network_seconds, 1e-9)
        network_measured = max(sync_s - other, 1e-9)
        ratio = network_measured / network_predicted
        threshold = self.run.cfg.federation.tune_threshold
        if self.calibrated and 1 / (1 + threshold) <= ratio <= 1 + threshold:
            return None
        rescaled = self._rescale_peer_tier(network_predicted, network_measured)
        if rescaled is None:
            return None
        tier, gbps = rescaled
        why = (f"the syncs took {sync_s:.3g} s against {predicted.sync_seconds:.3g} s predicted (x{ratio:.2f}"
               + (f", past 1 + {threshold:g}): the links changed" if self.calibrated else "): calibrating")
               + f"; the {tier} links re-estimated at {gbps * 1e3:.4g} Mbit/s")
        self.calibrated = True
        return why

    def _estimate(self, mode: SyncMode, step_s: float) -> ModeEstimate:
        fed = self.run.cfg.federation
        return estimate(mode, self.run.layout, workload_for(self.run, step_s, self.counts), self.cluster,
                        self.measured, fed.replica_split, step_seconds=step_s)

    def _choose(self, step_s: float, measured: Optional[Measured] = None, cheapest_to_leave: bool = False) -> TuneChoice:
        fed = self.run.cfg.federation
        return tune(self.bounds, self.run.layout, workload_for(self.run, step_s, self.counts), self.cluster,
                    measured or self.measured, fed.replica_split,
                    lambda mode: mode_memory(self.run, self.counts, self.largest, mode),
                    fed.tune_tolerance, step_seconds=step_s, cheapest_to_leave=cheapest_to_leave)

    # --- checkpoints ----------------------------------------------------------------------
    def state(self) -> dict:
        return {"decided": self.decided, "calibrated": self.calibrated, "syncs_since_check": self.syncs_since_check,
                "inter_node_gbps": self.cluster.inter_node_gbps, "intra_node_gbps": self.cluster.intra_node_gbps}

    def load_state(self, state: dict) -> None:
        """Continue a resumed run: the choice stands (its mode came with the checkpoint's config);
        the next re-check comes after the syncs still due."""
        self.decided = bool(state.get("decided", False))
        self.calibrated = bool(state.get("calibrated", False))
        self.syncs_since_check = int(state.get("syncs_since_check", 0))
        if self.calibrated:  # the speeds the syncs showed, not the new probe's
            self.cluster = dataclasses.replace(self.cluster, inter_node_gbps=state["inter_node_gbps"],
                                               intra_node_gbps=state["intra_node_gbps"])


def trial_step(fed) -> Optional[int]:
    """The step (1-based) the tuner times beside a trial exchange before its first choice, or None:
    halfway to the first sync, when overlap is allowed and there are steps enough to spare one
    (otherwise the link probe measures the interference beside a compute loop)."""
    every = fed.fragment_interval
    return every // 2 if fed.tune_overlap and every >= 4 else None


def probe_line(probe: LinkProbe, cluster: Cluster) -> str:
    """The banner's lines: what the probe measured per group, and the figures as --dry-run flags."""
    parts = []
    for t in probe.timings:
        if t.ranks < 2:
            continue
        rate = t.payload_bytes * 8 / max(t.payload_seconds - t.small_seconds, 1e-9) / 1e6
        parts.append(f"{t.group} group ({t.ranks} ranks, {t.tier}): {t.small_seconds * 1e6:,.0f} us for a tiny "
                     f"all-reduce, {t.payload_bytes >> 10:,} KiB in {t.payload_seconds * 1e3:,.1f} ms "
                     f"({rate:,.0f} Mbit/s of payload)")
    codec = ", ".join(f"{k} {v * 1e9:.2f} ns/element" for k, v in probe.codec_seconds_per_element.items())
    return ("  links (probed in {:.2f} s): ".format(probe.seconds) + "; ".join(parts)
            + (f"; codec {codec}" if codec else "")
            + (f"; an exchange beside compute slows it by {probe.overlap_interference:.0%}"
               if probe.overlap_interference else "")
            + f"\n    as --dry-run flags: {dry_run_flags(cluster)}")


def resumed_choice(options) -> tuple[Optional[SyncMode], dict]:
    """(the sync mode, the tuner's state) of the checkpoint this run resumes, if its run tuned;
    else (None, {})."""
    source = resume_source(options)
    if source is None:
        return None, {}
    _, meta = find_checkpoint(*source)
    state = meta.get("federation", {}).get("tune")
    if state is None:
        return None, {}
    return saved_mode(meta), state


def trial_exchange(engine, elements: int, sync_dtype: str) -> Future:
    """Start a throwaway average of `elements` random values in `sync_dtype` in the engine's
    background thread, the way an overlapped sync runs (its own communicators, the averager's
    buckets, the codec; on CUDA the exchange's stream): a training step timed beside it shows what
    an overlap costs. Returns the future of its seconds; every rank of the job calls it at the same step."""
    if engine.averaging.peer is engine.groups.peer:
        raise ValueError("a trial exchange needs the exchange's own process groups: "
                         "build_process_groups(..., exchange=True)")
    averager = engine.averaging.make(sync_dtype)
    buffer = torch.randn(elements, device=engine.device)

    def run(buffers: list) -> float:
        began = time.perf_counter()
        averager.average(buffers)
        if buffers[0].is_cuda:
            torch.cuda.current_stream(buffers[0].device).synchronize()
        return time.perf_counter() - began

    return engine.overlapped.thread().submit(run, [buffer])
