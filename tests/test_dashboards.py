"""Dashboards (TensorBoard, wandb) carry metrics.jsonl's values; tools/plot_runs.py plots them."""

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
import torch.distributed as dist

from cli_utils import SGD, run_pretrain
from fl_megatron.config.flags import parse_args
from fl_megatron.config.training import TrainingConfig
from fl_megatron.pretrain import main
from fl_megatron.training import dashboards
from fl_megatron.training.dashboards import Dashboards, RunRecords, check_dashboard_packages, scalars
from tool_loader import tool_module

REPO = Path(__file__).resolve().parents[1]
needs_tensorboard = pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                                       reason="tensorboard is not installed")
needs_matplotlib = pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                                      reason="matplotlib is not installed")


def _plot_tool():
    return tool_module("plot_runs")


def _tensorboard_scalars(directory: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@needs_tensorboard
@pytest.mark.timeout(600)
def test_tensorboard_events_equal_metrics_jsonl(tmp_path):
    run_dir, tb_dir = tmp_path / "run", tmp_path / "tb"
    steps = run_pretrain(2, run_dir, tmp_path / "cache", *SGD, "--train-iters", "6", "--eval-interval", "3",
                         "--fl-group-size", "1", "--fl-sync-interval", "2", "--tensorboard-dir", str(tb_dir))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6] and [r["step"] for r in evals] == [3, 6]
    # the dashboards get metrics.jsonl's records: in this federated run, the federation's, at each sync
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [2, 4, 6]
    # elapsed_s: wall-clock seconds since training started, in file order
    elapsed = [r["elapsed_s"] for r in records]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0
    assert len(list(tb_dir.glob("events.out.tfevents.*"))) == 1  # rank 0 only
    got = _tensorboard_scalars(tb_dir)

    def expect(tag, key, rows):
        assert [s for s, _ in got[tag]] == [r["step"] for r in rows], tag
        assert [v for _, v in got[tag]] == pytest.approx([r[key] for r in rows], rel=1e-6), tag

    expect("train/loss", "loss", steps)
    expect("train/lr", "lr", steps)
    expect("train/elapsed_s", "elapsed_s", steps)
    expect("comm/inter_node_bytes", "inter_node_bytes", steps)
    expect("comm/inter_group_bytes", "inter_group_bytes", steps)
    synced = [r for r in steps if r["synced"]]
    assert [r["step"] for r in synced] == [2, 4, 6]
    # a sync's variance is agreed in the next sync's vote (the last sync's at once): the record of
    # step 4 carries step 2's, step 6's carries step 4's and its own
    expect("sync/param_variance", "param_variance", [r for r in synced if "param_variance" in r])
    assert [r["step"] for r in synced if "param_variance" in r] == [6]
    expect("sync/prev_sync_param_variance", "prev_sync_param_variance", synced[1:])
    assert [r["prev_sync_step"] for r in synced[1:]] == [2, 4] and "prev_sync_step" not in synced[0]
    expect("eval/loss", "eval_loss", evals)
    expect("eval/perplexity", "eval_perplexity", evals)


def test_missing_tensorboard_fails_before_any_process_group(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(dashboards, "_importable", lambda package: package != "tensorboard")
    argv = ["--model", "llama-tiny", "--tensorboard-dir", str(tmp_path / "tb"), "--run-dir", str(tmp_path / "run")]
    cfg, _ = parse_args(argv)
    with pytest.raises(ValueError, match=r'--tensorboard-dir needs .*pip install -e "\.\[tensorboard\]"'):
        check_dashboard_packages(cfg.training)
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1").items():
        monkeypatch.setenv(key, value)
    assert main(argv) == 2
    assert 'pip install -e ".[tensorboard]"' in capsys.readouterr().err
    assert not dist.is_initialized() and not (tmp_path / "run").exists()


def test_missing_wandb_names_its_extra_and_name_needs_a_project(monkeypatch):
    monkeypatch.setattr(dashboards, "_importable", lambda package: False)
    cfg, _ = parse_args(["--wandb-project", "p"])
    with pytest.raises(ValueError, match=r'--wandb-project needs .*pip install -e "\.\[wandb\]"'):
        check_dashboard_packages(cfg.training)
    check_dashboard_packages(TrainingConfig())  # nothing asked for: nothing needed
    with pytest.raises(ValueError, match="wandb_exp_name='x' is set but wandb_project is not"):
        TrainingConfig(wandb_exp_name="x").validate()


class _FakeWandbRun:
    def __init__(self, **kwargs):
        self.init, self.logged, self.finished = kwargs, [], False

    def log(self, values, step):
        self.logged.append((step, values))

    def finish(self):
        self.finished = True


def test_wandb_gets_every_record_with_its_step_from_the_writer_only(monkeypatch, tmp_path):
    runs = []
    fake = types.SimpleNamespace(init=lambda **kw: runs.append(_FakeWandbRun(**kw)) or runs[-1])
    monkeypatch.setitem(sys.modules, "wandb", fake)
    training = TrainingConfig(run_dir=str(tmp_path / "my-run"), wandb_project="proj")
    Dashboards(training, {"a": 1}, enabled=False).log({"step": 1, "loss": 2.0})
    assert runs == []  # not the writer rank: wandb is never initialised

    class Lines:
        def __init__(self):
            self.lines, self.closed = [], False

        def log(self, record):
            self.lines.append(record)

        def close(self):
            self.closed = True

    files = Lines()
    records = RunRecords(files, Dashboards(training, {"a": 1}, enabled=True))
    step = {"step": 2, "tokens": 64, "loss": 3.5, "lr": 0.1, "synced": True, "sync_seconds": 0.25,
            "inter_node_bytes": 1024, "param_variance": 1e-6}
    records.log(step)
    records.log({"step": 2, "elapsed_s": 1.5, "eval_loss": 3.25, "eval_perplexity": 25.8})
    records.close()
    (run,) = runs
    assert run.init == {"project": "proj", "name": "my-run", "dir": training.run_dir, "config": {"a": 1}}
    assert run.logged == [(2, scalars(step)), (2, {"eval/elapsed_s": 1.5, "eval/loss": 3.25,
                                                   "eval/perplexity": 25.8})]
    assert scalars(step) == {"train/tokens": 64.0, "train/loss": 3.5, "train/lr": 0.1, "sync/synced": 1.0,
                             "sync/seconds": 0.25, "comm/inter_node_bytes": 1024.0, "sync/param_variance": 1e-6}
    assert run.finished and files.closed and [r["step"] for r in files.lines] == [2, 2]


MIB = 2 ** 20


def _write_run(directory: Path, steps: list, evals: list) -> None:
    directory.mkdir()
    lines = [json.dumps(r) for r in steps + evals] + ['{"step": 99, "lo']  # a torn last line
    (directory / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def _step(step, loss, elapsed, per_step=100, inter=0):
    return {"step": step, "tokens": step * per_step, "elapsed_s": elapsed, "loss": loss,
            "intra_node_bytes": step * 2 ** 20, "inter_node_bytes": inter}


@needs_matplotlib
def test_plot_runs_draws_each_runs_values(tmp_path, capsys):
    tool = _plot_tool()
    # run b was resumed after step 2: its process counted elapsed_s from 0 again
    a = [_step(1, 5.0, 1.0), _step(2, 4.5, 2.0), _step(3, 4.0, 3.0)]
    b = [_step(1, 5.5, 2.0, 200, 10 * 2 ** 20), _step(2, 5.0, 4.0, 200, 20 * 2 ** 20),
         _step(3, 4.2, 1.5, 200, 30 * 2 ** 20)]
    _write_run(tmp_path / "a", a, [{"step": 3, "eval_loss": 4.1, "eval_perplexity": 60.3}])
    _write_run(tmp_path / "b", b, [])
    out = tmp_path / "plots"
    assert tool.main([str(tmp_path / "a"), str(tmp_path / "b"), "--label", "A", "B", "--out", str(out)]) == 0
    names = ["bytes_per_tier.png", "eval_loss_vs_tokens.png", "loss_vs_time.png", "loss_vs_tokens.png"]
    assert sorted(p.name for p in out.glob("*.png")) == names
    assert all((out / n).read_bytes()[:4] == b"\x89PNG" for n in names)

    figures = tool.plot_runs([tool.load_run(tmp_path / "a", "A"), tool.load_run(tmp_path / "b", "B")])

    def lines(name, panel=0):
        return {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata()))
                for ln in figures[name].axes[panel].get_lines()}

    assert lines("loss_vs_tokens.png") == {"A": ([100, 200, 300], [5.0, 4.5, 4.0]),
                                           "B": ([200, 400, 600], [5.5, 5.0, 4.2])}
    assert lines("loss_vs_time.png") == {"A": ([1.0, 2.0, 3.0], [5.0, 4.5, 4.0]),
                                         "B": ([2.0, 4.0, 5.5], [5.5, 5.0, 4.2])}
    assert lines("eval_loss_vs_tokens.png") == {"A": ([300.0], [4.1])}
    assert lines("bytes_per_tier.png", 0) == {"A": ([1, 2, 3], [1.0, 2.0, 3.0]), "B": ([1, 2, 3], [1.0, 2.0, 3.0])}
    assert lines("bytes_per_tier.png", 1) == {"A": ([1, 2, 3], [0.0, 0.0, 0.0]), "B": ([1, 2, 3], [10.0, 20.0, 30.0])}

    assert "consensus.png" not in figures  # no run measured DBench metrics

    # a gossip run: consensus before each sync (log scale), the graph it used, cumulative bytes
    c = [dict(_step(2, 5.0, 1.0), consensus_relative=2e-4, graph="complete", group_bytes=[MIB, MIB]),
         dict(_step(4, 4.8, 2.0), consensus_relative=1e-4, graph="none", group_bytes=[0, 0]),
         dict(_step(6, 4.6, 3.0), consensus_relative=3e-4, graph="one-peer-exponential", group_bytes=[MIB, 3 * MIB])]
    _write_run(tmp_path / "c", c, [])
    gossip = tool.plot_runs([tool.load_run(tmp_path / "c", "C")])["consensus.png"]
    left, right = gossip.axes
    assert [(ln.get_label(), list(ln.get_ydata())) for ln in left.get_lines()] == [("C", [2e-4, 1e-4, 3e-4])]
    assert sorted(col.get_label() for col in left.collections) == ["C: complete", "C: none", "C: one-peer-exponential"]
    assert [list(ln.get_ydata()) for ln in right.get_lines()] == [[2.0, 2.0, 6.0]]
    assert "sync_telemetry.png" not in figures  # no run recorded per-sync telemetry

    # per-sync telemetry: MB/s per tier during the exchange, and the share of time waiting on the sync;
    # an overlapped sync's landing (a record without a loss, step 3) is one of the points
    landing = {"step": 3, "tokens": 3, "elapsed_s": 1.5, "synced": True, "sync_exchange_seconds": 0.7,
               "sync_inter_node_bytes_per_s": 1e6, "sync_wait_fraction": 0.125}
    d = [dict(_step(2, 5.0, 1.0), sync_exchange_seconds=0.5, sync_inter_node_bytes_per_s=2e6,
              sync_intra_node_bytes_per_s=8e6, sync_wait_fraction=0.25), landing,
         dict(_step(4, 4.8, 2.0), sync_exchange_seconds=0.4, sync_inter_node_bytes_per_s=3e6, sync_wait_fraction=0.5)]
    _write_run(tmp_path / "d", d, [])
    telemetry = tool.plot_runs([tool.load_run(tmp_path / "d", "D")])["sync_telemetry.png"]
    rates, waits = telemetry.axes
    assert {ln.get_label(): list(ln.get_ydata()) for ln in rates.get_lines()} == {"D: inter-node": [2.0, 1.0, 3.0],
                                                                                   "D: intra-node": [8.0]}
    assert [list(ln.get_ydata()) for ln in waits.get_lines()] == [[0.25, 0.125, 0.5]]

    assert tool.main([str(tmp_path / "a"), str(tmp_path / "missing"), "--out", str(out)]) == 2
    assert "missing has no metrics.jsonl" in capsys.readouterr().err
    assert tool.main([str(tmp_path / "a"), "--label", "A", "B"]) == 2
    assert "2 --label value(s) for 1 run directories" in capsys.readouterr().err


def test_plot_runs_names_the_extra_when_matplotlib_is_missing(tmp_path, monkeypatch, capsys):
    tool = _plot_tool()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert tool.main([str(tmp_path)]) == 2
    assert 'matplotlib is not installed: pip install -e ".[plots]"' in capsys.readouterr().err
