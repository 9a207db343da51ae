"""The checks one GPU can run (one H200 as lent: tools/gpu_check.py --plan): each backend's bf16
step with its tokens/s and MFU, the dry run's memory estimate against the measured peak, the
codecs' speed, save / exact resume / Hugging Face export, which collectives gloo does on CUDA,
and, with two processes of the GPU on gloo, the overlapped sync and the tuner's interference."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

from . import common
from .common import ONE_GPU_GLOO, ROOT, Outcome, failed, finite, losses, summary

# a real shape at a real length: Llama 3.2 1B, 2048 tokens, 4 sequences a step (8,192 tokens)
THROUGHPUT = ["--model", "llama3.2-1b", "--seq-length", "2048", "--micro-batch-size", "4", "--train-iters", "10",
              "--log-interval", "1", "--eval-iters", "0", "--mock-data", "--optimizer", "adamw", "--lr", "1e-4",
              "--lr-decay-style", "constant", "--bf16"]
WARMUP_STEPS = 3  # steps left out of tokens/s: allocator growth, kernel selection
# Llama 3.1 8B's layers at its published length (8192 tokens), cut to 8 layers (2.8 B parameters,
# about 60 GiB with AdamW): one group of one rank, where the estimate's terms all show
EIGHT_B_CUT = ["--model", "llama3.1-8b", "--num-layers", "8", "--seq-length", "8192", "--micro-batch-size", "1",
               "--train-iters", "2", "--log-interval", "1", "--eval-iters", "0", "--mock-data", "--optimizer",
               "adamw", "--lr", "1e-4", "--lr-decay-style", "constant", "--bf16"]
# large enough that a step is the GPU's work, not Python's: the tuner times a step beside an exchange
MEDIUM = ["--num-layers", "4", "--hidden-size", "1024", "--ffn-hidden-size", "2816", "--num-attention-heads", "8",
          "--vocab-size", "32000", "--seq-length", "1024", "--micro-batch-size", "4"]
# the tuner's check: its run, then one pinned to the overlap it measured (landings at steps 5 and
# 9, steps 2, 3, 6, 7, 10 and 11 alone)
TUNE_RUN = [*MEDIUM, "--fl-sync-interval", "4", "--train-iters", "8"]
PINNED_TUNE_RUN = [*MEDIUM, "--fl-sync-interval", "4", "--train-iters", "12"]
# DeepSpeed's FusedAdam is built on first use (a JIT nvcc build, a minute or more): torch's Adam here
DEEPSPEED_TORCH_ADAM = {"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}


def parsed_model(flags: list) -> tuple:
    """(parameters, model config, seq length) of the run `flags` describe, on the meta device."""
    sys.path.insert(0, str(ROOT))
    from fl_megatron.config.flags import parse_args
    from fl_megatron.training.dry_run import model_sizes

    cfg, _ = parse_args(list(flags))
    counts, _ = model_sizes(cfg.model)
    return counts[0], cfg.model, cfg.training.seq_length


def backend_throughput(backend: str):
    """Llama 3.2 1B in bf16 on one GPU for 10 steps on `backend`: finite losses, tokens/s over the
    steps after the warm-up, and MFU (6N + 12 L h s FLOPs per token, as the cost model counts)
    against the card's measured bf16 rate."""
    def run(ctx) -> Outcome:
        flags = [*THROUGHPUT, "--backend", backend]
        if backend == "deepspeed":
            config = ctx.work / "ds_config.json"
            config.write_text(json.dumps(DEEPSPEED_TORCH_ADAM))
            flags += ["--deepspeed_config", str(config)]
        proc = common.pretrain(ctx, f"throughput-{backend}", 1, *flags, base=())
        if proc.returncode:
            return Outcome(failed(proc))
        records = [r for r in common.step_records(ctx.work / f"throughput-{backend}") if r["step"] > WARMUP_STEPS]
        if not records or not finite(r["loss"] for r in records):
            return Outcome(f"losses {[r['loss'] for r in records]}")
        tokens_per_s = statistics.median(r["tokens_per_s"] for r in records)
        from fl_megatron.cost_model.flops import train_flops_per_token

        params, model, seq = parsed_model(flags)
        achieved = tokens_per_s * train_flops_per_token(params, model, seq) / 1e12
        peak = common.card_tflops(ctx.gpu_name)
        figures = {"tokens_per_s": round(tokens_per_s), "model_tflops": round(achieved, 1),
                   "parameters": params, "tokens_per_step": 2048 * 4, "measured_steps": len(records)}
        text = f"{tokens_per_s:,.0f} tokens/s, {achieved:.0f} TFLOP/s"
        if peak:
            figures.update(mfu=round(achieved / peak, 4), card_bf16_tflops=peak)
            text += f", MFU {achieved / peak:.1%} of the card's measured {peak:g}"
        peak_bytes = max(summary(ctx.work / f"throughput-{backend}")["peak_memory_bytes_per_rank"])
        figures["peak_memory_gib"] = round(peak_bytes / 2**30, 2)
        return Outcome("", figures, text + f", peak {peak_bytes / 2**30:.1f} GiB")
    return run


def memory_estimate(ctx) -> Outcome:
    """--dry-run's per-rank memory estimate of Llama 3.1 8B's layers cut to 8 against the peak
    torch allocated in 2 real steps: it fails if the estimate is more than 10% under the peak
    (a user would run out of memory the dry run said fits) or over 1.5x it (no use for planning)."""
    sys.path.insert(0, str(ROOT))
    from fl_megatron.config.flags import parse_args
    from fl_megatron.config.resolved import resolve
    from fl_megatron.training.dry_run import run_memory_estimate

    cfg, _ = parse_args(list(EIGHT_B_CUT))
    estimate = run_memory_estimate(resolve(cfg, 1, 1))
    proc = common.pretrain(ctx, "memory-8b-cut", 1, *EIGHT_B_CUT, base=())
    if proc.returncode:
        return Outcome(failed(proc), {"estimate_gib": round(estimate["total"] / 2**30, 2)})
    peak = max(summary(ctx.work / "memory-8b-cut")["peak_memory_bytes_per_rank"])
    ratio = peak / estimate["total"]
    figures = {"estimate_gib": round(estimate["total"] / 2**30, 2), "measured_peak_gib": round(peak / 2**30, 2),
               "measured_over_estimate": round(ratio, 3),
               "estimate_terms_gib": {k: round(v / 2**30, 2) for k, v in estimate.items()}}
    text = (f"estimate {estimate['total'] / 2**30:.1f} GiB, measured peak {peak / 2**30:.1f} GiB "
            f"(torch.cuda.max_memory_allocated), measured/estimate {ratio:.2f}")
    problem = "" if 1 / 1.5 <= ratio <= 1.10 else f"{text}: outside 0.67-1.10"
    return Outcome(problem, figures, text)


def codecs(ctx) -> Outcome:
    """int8 and int4 encode and decode of 64 Mi fp32 elements on the GPU (GB/s of fp32 in), the
    codes equal to the CPU's for the same values, the error within half a step of each block; the
    sparse sync's codec likewise, with the link speed its time equals the payload's wire time at."""
    out = common.script("codec_speed.py", timeout=ctx.left())
    bad = [f"{k}: {v['problem']}" for k, v in out.items() if v.get("problem")]
    text = ", ".join(f"{k} encode {v['encode_gbps']:.0f} GB/s, decode {v['decode_gbps']:.0f} GB/s"
                     + (f" (= its wire time at {v['breakeven_gbit_s']:.3g} Gbit/s)" if "breakeven_gbit_s" in v else "")
                     for k, v in out.items())
    return Outcome("; ".join(bad), out, text)


def exact_resume(ctx) -> Outcome:
    """Save at step 2 on CUDA, resume to 4: the same losses as 4 uninterrupted steps, bit for bit
    (--deterministic-mode: FlashAttention's backward is not deterministic by default), then HF export."""
    flags = ["--train-iters", "4", "--bf16", "--deterministic-mode"]
    work = ctx.work
    for name, extra in (("ref", ()), ("resumed", ("--save", str(work / "ckpt"), "--exit-interval", "2")),
                        ("resumed", ("--save", str(work / "ckpt"), "--load", str(work / "ckpt")))):
        proc = common.pretrain(ctx, name, 1, *flags, *extra)
        if proc.returncode:
            return Outcome(failed(proc))
    if losses(work / "resumed") != losses(work / "ref"):
        return Outcome(f"resumed {losses(work / 'resumed')} != uninterrupted {losses(work / 'ref')}")
    export = subprocess.run([sys.executable, str(ROOT / "tools" / "convert_checkpoint_to_hf.py"), "--checkpoint",
                             str(work / "ckpt"), "--output", str(work / "hf")], capture_output=True, text=True,
                            timeout=ctx.left())
    if export.returncode:
        return Outcome(failed(export))
    return Outcome("", {"losses": losses(work / "ref")}, "4 resumed losses equal 4 uninterrupted ones; exported")


def gloo_collectives(ctx) -> Outcome:
    """Which collectives gloo runs on CUDA tensors (2 processes of one GPU), each checked against
    its closed-form result; kept in the shared folder for the two-process checks after it."""
    out = common.script("gloo_probe.py", nproc=2, timeout=ctx.left())
    (ctx.shared / "gloo_probe.json").write_text(json.dumps(out))
    works = [k for k, v in out.items() if v == "ok"]
    fails = {k: v for k, v in out.items() if v != "ok"}
    text = f"gloo on CUDA does {', '.join(works) or 'none'}" + (
        f"; not {', '.join(fails)}" if fails else "")
    return Outcome("" if "all_reduce" in works else "gloo cannot all-reduce CUDA tensors", out, text)


def _gloo_gaps(ctx) -> str:
    """What the probe found gloo cannot do on CUDA ('' when it ran everything or did not run)."""
    path = ctx.shared / "gloo_probe.json"
    if not path.exists():
        return ""
    gaps = {k: v for k, v in json.loads(path.read_text()).items() if v != "ok"}
    return "; ".join(f"{k} ({v[:80]})" for k, v in gaps.items())


def two_groups_on_one_gpu(name: str, *flags: str, judge=None, identical: bool = True):
    """Two federation groups of one rank each, both processes on the one GPU, on gloo: `flags`'
    sync; finite losses, the groups identical after the last sync (the checkpoint's tensors;
    `identical`), then `judge(ctx, run_dir)`."""
    def run(ctx) -> Outcome:
        proc = _two_groups(ctx, name, *flags, "--save", str(ctx.work / name / "ckpt"))
        if proc.returncode:
            gaps = _gloo_gaps(ctx)
            if gaps:  # what gloo cannot do on CUDA, not our sync: say so, with the run's last line
                return Outcome(skipped=f"gloo on CUDA lacks {gaps}; the run: {failed(proc)}")
            return Outcome(failed(proc))
        same = common.groups_identical(ctx.work / name / "ckpt") if identical else True
        if not same or not finite(losses(ctx.work / name)):
            return Outcome(f"groups identical after the last sync: {same}, losses {losses(ctx.work / name)}")
        return judge(ctx, ctx.work / name) if judge else Outcome("", {}, "both groups identical after the last sync")
    return run


def _two_groups(ctx, name: str, *flags: str):
    base = ["--train-iters", "6", "--fl-sync-interval", "2", "--bf16", "--fl-group-size", "1"]
    return common.pretrain(ctx, name, 2, *base, *flags, env=ONE_GPU_GLOO)


def tuner_interference(run_dir: Path) -> Outcome:
    """The tuner's record: the interference it measured (a trial step beside a trial exchange)."""
    # a decision's figures are under its record's "tune" (docs/metrics.md)
    records = [r["tune"] for path in sorted(run_dir.rglob("*.jsonl")) for r in common.read_records(path)
               if "overlap_interference" in r.get("tune", {})]
    if not records:
        return Outcome("no tuning record with overlap_interference in the run's metrics")
    last = records[-1]
    value = last["overlap_interference"]
    figures = {k: last.get(k) for k in ("overlap_interference", "overlap_interference_from", "measured_step_seconds",
                                        "label", "mode") if k in last}
    if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
        return Outcome(f"overlap_interference {value!r} is not a fraction", figures)
    source = last.get("overlap_interference_from")
    how = "a trial step beside a trial exchange" if isinstance(source, dict) else (source or "the link probe")
    return Outcome("", figures, f"an exchange beside a step slows it by {value:.0%} (from {how}; gloo on one GPU)")


INTERFERENCE_MATCH = 0.2   # the tuner's interference against a pinned run's: within 20 % of the larger,
INTERFERENCE_FLOOR = 0.05  # or this close (two figures near zero differ by more than 20 % and mean the same)


def interference_of_a_run(records: list[dict]) -> float | None:
    """The interference an overlapped run met, as the tuner defines it: per landing step, its time
    less the landing's wait (the step computed beside the exchange) less the median time of the
    steps with no exchange beside them, over the exchange's seconds (at most the step's); the
    median over the landings. None without a landing to measure (records need --log-interval 1)."""
    by_step = {r["step"]: r for r in records if "elapsed_s" in r}
    duration = {s: r["elapsed_s"] - by_step[s - 1]["elapsed_s"] for s, r in by_step.items() if s - 1 in by_step}
    last = max(by_step, default=0)
    landings = [s for s, r in by_step.items() if r.get("sync_exchange_seconds") and s != last and s in duration
                and not by_step[s - 1].get("sync_exchange_seconds")]
    near = {s for land in landings for s in (land - 1, land)}  # the launch and the landing
    alone = [d for s, d in duration.items() if s not in near and s != last and not by_step[s].get("synced")]
    if not landings or not alone:
        return None
    baseline = statistics.median(alone)
    values = []
    for land in landings:
        beside = duration[land] - by_step[land].get("sync_seconds", 0.0)
        exchange = by_step[land]["sync_exchange_seconds"]
        values.append(max(0.0, beside - baseline) / max(min(exchange, beside), 1e-9))
    return statistics.median(values)


def interference_matches(tuner: float, run: float) -> bool:
    return abs(tuner - run) <= max(INTERFERENCE_MATCH * max(tuner, run), INTERFERENCE_FLOOR)


def tuner_interference_against_a_pinned_run(ctx, run_dir: Path) -> Outcome:
    """The tuner's interference is a fraction, and a run pinned to overlap 1 in the trial's
    precision (same model, H and groups) meets the same within 20 % (interference_of_a_run)."""
    got = tuner_interference(run_dir)
    if got.problem or got.skipped:
        return got
    trial = (got.figures.get("overlap_interference_from") or {}).get("trial") or {}
    dtype = trial.get("sync_dtype", "int4")
    pinned = ["--fl-sync-dtype", dtype, "--fl-overlap-steps", "1", "--log-interval", "1"]
    if dtype != "fp32":
        pinned.append("--fl-error-feedback")
    proc = _two_groups(ctx, "tune-pinned", *PINNED_TUNE_RUN, *pinned)
    if proc.returncode:
        return Outcome(f"the run pinned to overlap 1 ({dtype}): {failed(proc)}", got.figures)
    run = interference_of_a_run(common.read_records(ctx.work / "tune-pinned" / "metrics.jsonl"))
    if run is None:
        return Outcome("the pinned run logged no landing with steps alone beside it", got.figures)
    tuner = got.figures["overlap_interference"]
    figures = {**got.figures, "pinned_run_interference": round(run, 4)}
    if not interference_matches(tuner, run):
        return Outcome(f"the tuner measured {tuner:.0%}, a run of overlap 1 ({dtype}) met {run:.0%}: more than "
                       f"{INTERFERENCE_MATCH:.0%} apart", figures)
    return Outcome("", figures, got.text + f"; a run of overlap 1 ({dtype}) met {run:.0%}")
