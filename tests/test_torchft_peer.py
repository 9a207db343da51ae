"""The torchft peer (tools/peers) trains exactly what fl_megatron's FL+FSDP trains.

On loopback, 2 replica groups x 2 ranks (FSDP2 inside each), AdamW with clipping and warm-up,
H = 2, 7 steps (so the last sync is the extra one after a partial interval):
- torchft LocalSGD gives the per-step losses of `fl_megatron.pretrain --fl-group-size 2` on
  4 ranks: same initial shards, batches and averaging. Only the order in which the logged loss
  is averaged over ranks differs (gloo's 4-rank sum there, a group sum then torchft's
  cross-group sum here), hence a relative tolerance of 1e-6 instead of bitwise equality.
- torchft DiLoCo with outer SGD lr 1, momentum 0 takes the step p = saved - mean(saved - local),
  which is mean(local) (LocalSGD) up to float rounding of the subtraction.
"""

import json
import shutil
import sys
from pathlib import Path

import pytest

from cli_utils import TINY, run_pretrain, step_records

pytest.importorskip("torchft", reason="torchft is not installed (pip install torchft); the peer needs it")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "peers"))
from torchft_launch import run_torchft, torchft_commands  # noqa: E402

from fl_megatron.launching.lighthouse import LIGHTHOUSE_EXE  # noqa: E402

pytestmark = pytest.mark.timeout(300)

GROUPS, RANKS = 2, 2
FLAGS = ["--optimizer", "adamw", "--lr", "0.003", "--lr-warmup-iters", "2", "--train-iters", "7",
         "--fl-sync-interval", "2"]
REL = 1e-6


def _torchft_run(run_dir: Path, cache: Path, *extra: str) -> Path:
    plan = torchft_commands(GROUPS, RANKS, [*TINY, *FLAGS, "--data-cache-path", str(cache),
                                            "--run-dir", str(run_dir), *extra])
    result = run_torchft(plan, timeout=120)
    logs = "\n".join(f"--- {name}\n{Path(path).read_text()[-3000:]}" for name, path in result.logs.items())
    assert result.ok, f"{result.failure}\n{logs}"
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if shutil.which(LIGHTHOUSE_EXE, path=str(Path(sys.executable).parent)) is None:
        pytest.skip(f"{LIGHTHOUSE_EXE} is not next to {sys.executable}")
    tmp = tmp_path_factory.mktemp("torchft_peer")
    cache = tmp / "cache"
    run_pretrain(GROUPS * RANKS, tmp / "fl", cache, *FLAGS, "--fl-group-size", str(RANKS))
    _torchft_run(tmp / "localsgd", cache)
    _torchft_run(tmp / "diloco", cache, "--algorithm", "diloco", "--outer-lr", "1", "--outer-momentum", "0")
    return {name: tmp / name for name in ("fl", "localsgd", "diloco")}


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _assert_same_steps(got: list, want: list) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, 8))
    assert [r["synced"] for r in got] == [r["synced"] for r in want] == [False, True, False, True, False, True, True]
    assert [r["lr"] for r in got] == [r["lr"] for r in want]
    assert [r["tokens"] for r in got] == [r["tokens"] for r in want]
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=REL), f"step {g['step']}"
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=REL), f"step {g['step']}"


def test_localsgd_losses_match_fl_fsdp(runs):
    _assert_same_steps(step_records(runs["localsgd"]), step_records(runs["fl"]))


def test_localsgd_summary_matches_fl_fsdp(runs):
    ours, peer = _summary(runs["fl"]), _summary(runs["localsgd"])
    assert peer["system"] == "torchft-localsgd"
    assert peer["tokens"] == ours["tokens"] == 7 * 2 * 32 * GROUPS * RANKS
    assert peer["final_train_loss"] == pytest.approx(ours["final_train_loss"], rel=REL)
    assert peer["eval_loss"] == pytest.approx(ours["eval_loss"], rel=REL)
    assert peer["eval_perplexity"] == pytest.approx(ours["eval_perplexity"], rel=1e-5)
    assert (peer["syncs_committed"], peer["syncs_expected"], peer["last_sync_step"]) == (4, 4, 7)
    assert len(peer["peak_memory_bytes_per_rank"]) == GROUPS * RANKS
    assert all(p > 0 for p in peer["peak_memory_bytes_per_rank"])
    assert peer["wall_seconds"] > 0 and peer["tokens_per_s"] == pytest.approx(peer["tokens"] / peer["wall_seconds"])


def test_diloco_unit_outer_step_equals_localsgd(runs):
    _assert_same_steps(step_records(runs["diloco"]), step_records(runs["localsgd"]))
    diloco = _summary(runs["diloco"])
    assert diloco["system"] == "torchft-diloco"
    assert diloco["torchft"]["outer_lr"] == 1.0 and diloco["torchft"]["outer_momentum"] == 0.0
    assert diloco["eval_loss"] == pytest.approx(_summary(runs["localsgd"])["eval_loss"], rel=REL)


def test_commands_carry_each_groups_environment_behind_its_prefix():
    plan = torchft_commands(2, 3, ["--model", "llama-tiny", "--run-dir", "runs/x"],
                            prefixes=[["ip", "netns", "exec", "n1"], ["ip", "netns", "exec", "n2"]],
                            advertise_hosts=["10.0.0.1", "10.0.0.2"], lighthouse_addr="10.0.0.1:29510",
                            master_ports=[29601, 29602])
    assert plan.lighthouse.argv[-8:] == ["--bind", "10.0.0.1:29510", "--min_replicas", "2", "--quorum_tick_ms",
                                         "100", "--join_timeout_ms", "10000"]
    assert plan.run_dir == Path("runs/x")
    for g, command in enumerate(plan.groups):
        env = {"TORCHFT_LIGHTHOUSE": "http://10.0.0.1:29510", "REPLICA_GROUP_ID": str(g),
               "NUM_REPLICA_GROUPS": "2", "RUST_LOG": "warn", "OMP_NUM_THREADS": "1"}
        assert command.env == env
        assert command.argv[:5] == ["ip", "netns", "exec", f"n{g + 1}", "env"]
        assert command.argv[5:10] == [f"{k}={v}" for k, v in env.items()]
        argv = " ".join(command.argv)
        assert f"--nproc-per-node 3 --master-addr 10.0.0.{g + 1} --master-port {29601 + g}" in argv
        assert argv.endswith(f"--run-dir runs/x --advertise-host 10.0.0.{g + 1}")


def test_commands_reject_mismatched_lists_and_launcher_owned_flags():
    with pytest.raises(ValueError, match="advertise_hosts has 1 entries for 2 replica groups"):
        torchft_commands(2, 1, [], advertise_hosts=["10.0.0.1"])
    with pytest.raises(ValueError, match="--advertise-host is set by the launcher"):
        torchft_commands(2, 1, ["--advertise-host", "10.0.0.1"])
