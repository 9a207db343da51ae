"""The two-tier benchmark's parts (rows, read-back, prediction, table) and one small shaped run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_utils import TINY

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))

from cluster_bench.bench_report import markdown, table_rows  # noqa: E402
from cluster_bench.prediction import TCP_WIRE_OVERHEAD, as_tuned, predict_row  # noqa: E402
from cluster_bench.rows import all_rows, select_rows  # noqa: E402
from cluster_bench.run_outputs import compute_seconds, measured, span_seconds, step_records  # noqa: E402

LLAMA_TINY = 5_048_576            # parameters of the llama-tiny preset
LLAMA_TINY_ROOT = 2 * 4096 * 256 + 256  # embedding, output layer, final norm: gathered once per step


def test_rows_follow_the_cluster_shape():
    assert [r.key for r in all_rows(2, 2, 8)] == ["fsdp", "hsdp", "fl-fsdp", "fl-fsdp-lockstep", "fl-fsdp-bf16", "fl-fsdp-int8",
                                                  "fl-fsdp-int8-overlap", "fl-fsdp-int4", "fl-fsdp-int4-overlap",
                                                  "fl-fsdp-int4-frag2-overlap", "fl-fsdp-sparse-frag2-overlap",
                                                  "fl-fsdp-int4-frag4-overlap",
                                                  "fl-fsdp-tune", "torchft-localsgd",
                                                  "torchft-diloco", "zero3", "fl-zero3"]
    assert {r.key: r.fault for r in all_rows(2, 2, 8) if r.fault} == {"fl-fsdp-lockstep": "lockstep"}
    modes = {r.key: r.flags() for r in all_rows(2, 2, 8)}
    assert modes["fl-fsdp-int8-overlap"][-5:] == ["--fl-sync-dtype", "int8", "--fl-error-feedback",
                                                  "--fl-overlap-steps", "1"]
    rows = {r.key: r for r in all_rows(4, 2, 8)}
    assert rows["fl-hsdp-split"].group_size == 4 and rows["fl-hsdp-split"].shard_size == 2
    assert "--no-fl-replica-split" in rows["fl-hsdp-naive"].flags()
    assert rows["torchft-diloco"].flags()[-2:] == ["--algorithm", "diloco"]
    with pytest.raises(ValueError, match="unknown or inapplicable row.*fl-hsdp-split.*valid: fsdp"):
        select_rows(all_rows(2, 2, 8), ["fl-hsdp-split"])


def _write_run(run_dir: Path, elapsed: list[float], synced: set, eval_loss: float = 5.0) -> None:
    run_dir.mkdir()
    lines = [{"step": i + 1, "loss": 1.0, "elapsed_s": e, "synced": i + 1 in synced} for i, e in enumerate(elapsed)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (run_dir / "summary.json").write_text(json.dumps({
        "eval_loss": eval_loss, "peak_memory_bytes_per_rank": [100, 300], "bytes_all_ranks": {"inter_group_bytes": 7},
        "tokens_per_s": 1.0, "final_train_loss": 1.0, "layout": {"num_groups": 2, "replicas": 1}}))


def test_timed_span_and_calibration(tmp_path):
    _write_run(tmp_path / "r", [3.0, 4.0, 6.5, 7.5, 8.5], synced={3})
    records = step_records(tmp_path / "r")
    assert span_seconds(records, 0) == (8.5, 5)
    assert span_seconds(records, 1) == (5.5, 4)
    assert compute_seconds(tmp_path / "r", warmup=2) == 1.0       # steps 4 and 5; step 3 synced
    got = measured(tmp_path / "r", warmup=1, tokens_per_step=100)
    assert got["tokens_per_s"] == pytest.approx(400 / 5.5) and got["peak_memory_bytes"] == 300
    rows = table_rows([{"row": {"key": "fsdp", "label": "FSDP over 4"}, "measured": got, "inter_node_wire_bytes": 2e6,
                        "predicted": {"tokens_per_s": 70.0, "inter_node_bytes": 2.1e6, "step_seconds": 1.5}}])
    assert rows[0]["x_baseline"] == 1.0
    assert "| FSDP over 4 | 73 | 1.00 | 70 | 2.0 | 2.1 | +5% |" in markdown(rows, "FSDP")


def test_prediction_of_fsdp_on_two_nodes_by_hand():
    """FSDP over 2 nodes x 2 ranks, gloo, 100 Mbit/s: one ring edge leaves each node; per step it carries
    the forward gather, the backward gather of all but the root module, and the reduce-scatter run as an
    all-reduce (twice the bytes), each 3/4 of the fp32 data; an evaluation gathers once per micro-batch."""
    row = next(r for r in all_rows(2, 2, 8) if r.key == "fsdp")
    common = ["--model", "llama-tiny", "--train-iters", "10", "--eval-iters", "2", "--seq-length", "128",
              "--micro-batch-size", "4"]
    p = predict_row(row, common, nodes=2, ranks_per_node=2, rate_mbit=100, compute_s=0.5, steps=10, warmup=1)
    per_step = (LLAMA_TINY + (LLAMA_TINY - LLAMA_TINY_ROOT) + 2 * LLAMA_TINY) * 4 * 3 / 4 * TCP_WIRE_OVERHEAD
    per_eval = 2 * LLAMA_TINY * 4 * 3 / 4 * TCP_WIRE_OVERHEAD
    assert p["inter_node_bytes"] == pytest.approx(2 * (10 * per_step + per_eval))
    assert p["step_seconds"] == pytest.approx(0.5 + per_step * 8 / 100e6)
    assert p["tokens_per_step"] == 4 * 128 * 4


def test_a_tuned_row_is_predicted_as_the_hand_row_of_the_mode_it_chose(tmp_path):
    """The --fl-tune row's prediction is that of the mode its last `tune` record names (its flags
    pin that mode): here the int4 + EF, 2 fragments, overlap 1 row's."""
    from fl_megatron.cost_model.tune import SyncMode

    rows = {r.key: r for r in all_rows(2, 2, 8)}
    common = ["--model", "llama-tiny", "--train-iters", "10", "--seq-length", "128", "--micro-batch-size", "4"]
    mode = SyncMode("int4", 1, 2, 8)
    run_dir = tmp_path / "tuned"
    run_dir.mkdir()
    records = [{"step": 8, "tune": {"mode": {"sync_interval": 8}, "flags": SyncMode("fp32", 0, 1, 8).flags()}},
               {"step": 9, "loss": 1.0}, {"step": 16, "tune": {"mode": mode.fields(), "flags": mode.flags()}}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    def predicted(row):
        return predict_row(row, common, nodes=2, ranks_per_node=2, rate_mbit=100, compute_s=0.5, steps=10, warmup=1)

    tuned = as_tuned(rows["fl-fsdp-tune"], run_dir)
    assert predicted(tuned) == predicted(rows["fl-fsdp-int4-frag2-overlap"])
    assert predicted(tuned) != predicted(rows["fl-fsdp"])
    assert as_tuned(rows["fl-fsdp-tune"], tmp_path / "missing") == rows["fl-fsdp-tune"]


@pytest.mark.skipif(os.geteuid() != 0, reason="shaped links need root (network namespaces)")
def test_small_benchmark_counters_match_the_cost_model(tmp_path):
    """A tiny model on 2 nodes x 2 ranks at 50 Mbit/s: every row's inter-node bytes from the link
    counters agree with the cost model within 5 %."""
    out = tmp_path / "bench"
    cmd = [sys.executable, str(TOOLS / "bench_cluster.py"), "--mode", "netns", "--rate-mbit", "50", "--steps", "4",
           "--sync-interval", "2", "--rows", "fsdp", "fl-fsdp", "--out", str(out), "--", *TINY, "--seq-length", "32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", FL_MEGATRON_CACHE=str(tmp_path / "cache")))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = {r["key"]: r for r in json.loads((out / "bench.json").read_text())["table"]}
    assert set(table) == {"fsdp", "fl-fsdp"}
    for row in table.values():
        assert row["inter_node_mb"] == pytest.approx(row["predicted_inter_node_mb"], rel=0.05), row
    assert table["fl-fsdp"]["inter_node_mb"] < table["fsdp"]["inter_node_mb"] / 2
    assert (out / "bench.md").exists() and (out / "plots" / "loss_vs_tokens.png").exists()
