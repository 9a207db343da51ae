"""What one benchmark row measured, read back from its run directory (step records, summary.json)."""

import json
import statistics
from pathlib import Path

from fl_megatron.training.run_files import logged_steps


def step_records(run_dir: Path) -> list[dict]:
    """Training-step records in step order: one per logged step over all groups (a federated
    run's merged from its groups' files, elapsed_s from group 0's: rank 0's clock)."""
    return sorted((r for r in logged_steps(run_dir) if "elapsed_s" in r), key=lambda r: r["step"])


def span_seconds(records: list[dict], warmup: int) -> tuple[float, int]:
    """(seconds, steps) from the end of step `warmup` (0: the start of training) to the last step."""
    by_step = {r["step"]: r["elapsed_s"] for r in records}
    last = records[-1]["step"]
    if warmup and warmup not in by_step:
        raise ValueError(f"no record of step {warmup}: run with --log-interval 1")
    return by_step[last] - (by_step[warmup] if warmup else 0.0), last - warmup


def step_durations(records: list[dict]) -> list[tuple[float, bool]]:
    """(seconds, synced) of each logged step after the first."""
    return [(b["elapsed_s"] - a["elapsed_s"], bool(b.get("synced"))) for a, b in zip(records, records[1:])
            if b["step"] == a["step"] + 1]


def compute_seconds(run_dir: Path, warmup: int) -> float:
    """Median time of the steps after `warmup` that did not sync: a calibration run's time per step."""
    records = step_records(run_dir)
    times = [s for s, synced in step_durations(records[max(warmup - 1, 0):]) if not synced]
    if not times:
        raise ValueError(f"{run_dir}: no unsynced steps after step {warmup} to calibrate from")
    return statistics.median(times)


def measured(run_dir: Path, warmup: int, tokens_per_step: int) -> dict:
    """tokens/s and seconds per step over the timed span, final eval loss, peak memory, payload bytes."""
    records = step_records(run_dir)
    seconds, steps = span_seconds(records, warmup)
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    peaks = summary.get("peak_memory_bytes_per_rank") or [0]
    ledger = summary.get("bytes_all_ranks") or {}
    return {"steps": steps, "span_seconds": seconds, "tokens_per_s": steps * tokens_per_step / seconds,
            "step_seconds": seconds / steps, "eval_loss": summary.get("eval_loss"),
            "final_train_loss": summary.get("final_train_loss"), "peak_memory_bytes": max(peaks),
            "inter_group_payload_bytes": ledger.get("inter_group_bytes"),
            "tokens_per_s_whole_run": summary.get("tokens_per_s"), "layout": summary.get("layout")}
