"""tools/bench_tune.py's report: the tuned row's tokens/s over its whole run with its own start-up
(the link probe and the timing of the device's products, which the hand-picked rows do not make)
against the best hand-picked row's, from fabricated bench_cluster outputs."""

import json

import pytest
from tool_loader import tool_module


def _row(tmp_path, key: str, tokens_per_s: float, flags: list, eval_loss: float = 6.0) -> dict:
    run_dir = tmp_path / key
    run_dir.mkdir()
    return {"row": {"key": key, "extra": flags}, "run_dir": str(run_dir),
            "measured": {"tokens_per_s": tokens_per_s, "span_seconds": 20.0, "eval_loss": eval_loss}}


def test_the_tuned_row_pays_its_start_up_and_is_held_to_the_best_row(tmp_path):
    bench_tune = tool_module("bench_tune")
    int4 = ["--fl-sync-dtype", "int4", "--fl-error-feedback"]
    rows = [_row(tmp_path, "fl-fsdp", 1000.0, []),
            _row(tmp_path, "fl-fsdp-int4", 3000.0, int4),
            _row(tmp_path, "fl-fsdp-int4-overlap", 3200.0, [*int4, "--fl-overlap-steps", "1"]),
            _row(tmp_path, bench_tune.TUNE_ROW, 3200.0, ["--fl-tune"])]
    tuned = tmp_path / bench_tune.TUNE_ROW
    mode = {"sync_dtype": "int4", "error_feedback": True, "overlap_steps": 1, "fragments": 1, "sync_interval": 8}
    decision = {"mode": mode, "reason": "first choice", "label": "int4 + EF, H 8, overlap 1"}
    (tuned / "metrics.jsonl").write_text(json.dumps({"step": 8, "tune": decision}) + "\n")
    (tuned / "config.json").write_text(json.dumps({"link_probe": {"seconds": 0.6},
                                                   "fl_tune_start": {"device_rate": {"wall_seconds": 0.4}}}))
    got = bench_tune.report_rate({"results": rows}, 100.0, 8)
    # the same speed over its 20 s of steps, with 1 s of start-up: 3200 x 20 / 21
    assert got["tuner_startup_seconds"] == pytest.approx(1.0)
    assert got["tuned_tokens_per_s"] == pytest.approx(3200 * 20 / 21)
    assert got["best_row"] == "fl-fsdp-int4-overlap" and got["same_mode_row"] == "fl-fsdp-int4-overlap"
    assert got["speed_ratio"] == pytest.approx(20 / 21) and got["speed_ok"] is True  # 0.952
    (tuned / "config.json").write_text(json.dumps({"link_probe": {"seconds": 2.0}}))
    got = bench_tune.report_rate({"results": rows}, 100.0, 8)
    assert got["speed_ratio"] == pytest.approx(20 / 22) and got["speed_ok"] is False
