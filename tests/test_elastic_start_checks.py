"""Elastic mode before the first sync: a federation whose groups do not match is refused within
seconds (every rank exits 2, one line names the groups and the settings that differ), a group
that joins a running federation with other settings is refused while the others go on, a wait
on the lighthouse is never silent (an address where nothing listens is named), and torchrun's
static rendezvous is named when it would share its store across restarts.

Pure parts (the signature, the status page, the rendezvous rule) run without processes; the
end-to-end cases start a torchft lighthouse and one torchrun job per group, as a user would.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fl_megatron.config.flags import parse_args
from fl_megatron.config.resolved import resolve
from fl_megatron.elastic.lighthouse_status import group_slot
from fl_megatron.elastic.signature import federation_signature, mismatch_text, parse_replica_id
from fl_megatron.pretrain import _shared_rendezvous_store_problem

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--model", "llama-tiny", "--num-layers", "1", "--hidden-size", "64", "--ffn-hidden-size", "96",
         "--num-attention-heads", "4", "--num-query-groups", "2", "--mock-data", "--seq-length", "32",
         "--micro-batch-size", "2", "--eval-iters", "0", "--lr-warmup-iters", "1", "--log-interval", "1"]


def _signature(world: int, *flags: str):
    cfg, _ = parse_args([*SMALL, *flags])
    return federation_signature(resolve(cfg, world), 1000)


# --- pure ------------------------------------------------------------------------------------------
def test_the_replica_id_carries_the_settings_and_names_what_differs():
    a = _signature(4, "--fl-group-size", "2", "--fl-sync-interval", "4")
    same = _signature(4, "--fl-group-size", "2", "--fl-sync-interval", "4")
    other_h = _signature(4, "--fl-group-size", "2", "--fl-sync-interval", "8")
    smaller = _signature(2, "--fl-group-size", "1", "--fl-sync-interval", "4")
    rid = a.replica_id(3)
    # torchft reads the slot from the trailing digits before ':'; the status page reader too
    assert re.fullmatch(r"[A-Za-z0-9._-]+_group_3", rid) and group_slot(rid + ":uuid") == 3
    assert parse_replica_id(rid + ":0f-uuid") == (3, tuple(v for _, v in a.items))
    assert parse_replica_id("group_1:uuid") is None and group_slot("group_1:uuid") == 1
    assert mismatch_text(a, 0, {1: parse_replica_id(same.replica_id(1))[1]}) is None
    assert mismatch_text(a, 0, {2: parse_replica_id(other_h.replica_id(2))[1]}) == \
        "--fl-sync-interval: group 0 has 4, group 2 has 8"
    text = mismatch_text(a, 0, {1: parse_replica_id(smaller.replica_id(1))[1]})
    assert text == "group 0 has 2 ranks, group 1 has 1 rank", text  # FSDP over the group: no separate shard line
    # every setting the sync depends on is compared: the model, the outer step, the seed, other --fl-* flags
    for flags, what in ((("--hidden-size", "128"), "model"), (("--fl-outer-optimizer", "nesterov"), "--fl-outer-optimizer"),
                        (("--seed", "7"), "--seed"), (("--fl-sick-loss-ratio", "2"), "other --fl-* settings"),
                        (("--lr", "0.1"), "training settings"), (("--fl-sync-dtype", "int8"), "--fl-sync-dtype")):
        changed = _signature(4, "--fl-group-size", "2", "--fl-sync-interval", "4", *flags)
        assert changed.replica_id(0) != a.replica_id(0), flags
        assert mismatch_text(a, 0, {1: parse_replica_id(changed.replica_id(1))[1]}).startswith(what), flags


def test_the_static_rendezvous_is_named_with_its_fix():
    restarts = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "1"}
    assert _shared_rendezvous_store_problem({**restarts, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None
    assert _shared_rendezvous_store_problem({"TORCHELASTIC_USE_AGENT_STORE": "False",
                                             "TORCHELASTIC_MAX_RESTARTS": "3"}) is None
    shared = _shared_rendezvous_store_problem(restarts)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in shared and "static" not in shared
    static = _shared_rendezvous_store_problem({**restarts, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert "static rendezvous" in static and "--rdzv-backend c10d" in static and "--standalone" in static


# --- end to end ------------------------------------------------------------------------------------
pytest.importorskip("torchft")

from fl_megatron.launching.lighthouse import lighthouse_command, start_lighthouse  # noqa: E402
from fl_megatron.launching.ports import free_port  # noqa: E402
from fl_megatron.launching.tree import stop_all  # noqa: E402


class _Leaving(Exception):
    pass


class _RecordedRefusal:
    """Stands in for Refusal: records the line instead of leaving the process."""

    def __init__(self):
        self.lines = []

    def published(self):
        return None

    def leave(self, line):  # the watch thread and the caller may both find it: the first one counts
        if not self.lines:
            self.lines.append(line)
        raise _Leaving(line)


def test_the_watch_refuses_only_once_its_own_group_is_seen_and_says_what_it_waits_for():
    from datetime import timedelta

    from torchft._torchft import LighthouseClient, LighthouseServer

    from fl_megatron.elastic.waiting import WaitWatch

    mine, other = _signature(4, "--fl-group-size", "2"), _signature(4, "--fl-group-size", "2", "--seed", "9")
    server = LighthouseServer(bind="[::]:0", min_replicas=3, heartbeat_timeout_ms=5000)
    lines, refusal = [], _RecordedRefusal()
    watch = WaitWatch(server.address(), 0, mine, 0, lines.append, refusal, every_s=0.6, poll_s=0.1,
                      problem_after_s=0.2)
    try:
        client = LighthouseClient(server.address(), connect_timeout=timedelta(seconds=5))
        client.heartbeat(other.replica_id(1) + ":uuid-1")  # a group that differs, but this one is not seen yet
        with pytest.raises(_Leaving):
            with watch.waiting(lambda: "the test's quorum"):
                time.sleep(1.0)
                assert refusal.lines == []  # leaving now would leave group 1 waiting for a group it never saw
                assert any("s waiting for the test's quorum, at the lighthouse" in ln and
                           "heartbeating now: group(s) 1" in ln for ln in lines), lines
                client.heartbeat(mine.replica_id(0) + ":uuid-0")
                watch.check_now()
        assert refusal.lines == ["group 0: the federation's groups do not match: --seed: group 0 has 1234, group 1 "
                                 "has 9. Every group must run with the same settings (groups of unequal size: give "
                                 "every group the same --fl-group-sizes); compare the groups' config.json"]
    finally:
        watch.close()
        server.shutdown()


def _env(fault: str = "") -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FL_MEGATRON_DEVICE": "cpu", "RUST_LOG": "warn",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    env.pop("FL_MEGATRON_FAULT", None)
    if fault:
        env["FL_MEGATRON_FAULT"] = fault
    return env


def _group(g: int, ranks: int, lighthouse: str, run_dir: Path, *flags: str, groups: int = 2, min_groups: int = 2,
           max_restarts: int = 0, steps: int = 8) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node",
            str(ranks), "--max-restarts", str(max_restarts), "-m", "fl_megatron.pretrain", *SMALL,
            "--train-iters", str(steps), "--fl-sync-interval", "4", "--run-dir", str(run_dir), "--fl-elastic",
            "--fl-lighthouse", lighthouse, "--fl-group-id", str(g), "--fl-num-groups", str(groups),
            "--fl-min-groups", str(min_groups), *flags]


def _start(argv: list, log: Path, fault: str = "") -> subprocess.Popen:
    return subprocess.Popen(argv, env=_env(fault), stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _run_groups(tmp_path: Path, lighthouse: str, commands: dict, *, fault: str = "", start_after: tuple = (),
                timeout: float = 150, join_timeout_ms: int = 60000) -> dict:
    """Start a lighthouse at `lighthouse`, then each group's torchrun (`start_after` = (g, other,
    text): group g once group `other`'s log shows `text`); wait for all. Returns {group: (seconds
    from its start to its exit, torchrun's exit code, its log)}."""
    log_dir = tmp_path / "launch"
    log_dir.mkdir(parents=True)
    logs = {g: log_dir / f"group_{g}.log" for g in commands}
    waits = {g: (other, text) for g, other, text in start_after}
    lighthouse_proc, _ = start_lighthouse(lighthouse_command(lighthouse, 2, join_timeout_ms=join_timeout_ms,
                                                             heartbeat_timeout_ms=5000), log_dir)
    procs, began, ended, begin = {}, {}, {}, time.monotonic()
    try:
        while time.monotonic() - begin < timeout and len(ended) < len(commands):
            for g, argv in commands.items():
                other, text = waits.get(g, (None, None))
                if g not in procs and (other is None or (other in procs and text in logs[other].read_text())):
                    procs[g], began[g] = _start(argv, logs[g], fault), time.monotonic()
            for g, p in procs.items():
                if g not in ended and p.poll() is not None:
                    ended[g] = time.monotonic()
            time.sleep(0.1)
    finally:
        stop_all([lighthouse_proc, *procs.values()])
    return {g: (ended.get(g, float("inf")) - began.get(g, 0), procs[g].returncode if g in procs else None,
                logs[g].read_text() if logs[g].exists() else "") for g in commands}


def _worker_codes(log: str) -> list:
    """The exit codes torchrun reports for its workers."""
    return [int(c) for c in re.findall(r"^\s+exitcode\s*:\s*(-?\d+)", log, re.M)]


def _refusal(log: str) -> str:
    return re.search(r"error: (group \d+: the federation's groups do not match: .*)", log).group(1)


def test_groups_of_two_sizes_are_refused_in_seconds_naming_both(tmp_path):
    lighthouse = f"127.0.0.1:{free_port()}"
    got = _run_groups(tmp_path, lighthouse, {0: _group(0, 2, lighthouse, tmp_path / "run"),
                                             1: _group(1, 1, lighthouse, tmp_path / "run")})
    for g, (seconds, code, log) in got.items():
        assert code != 0 and seconds < 60, (g, seconds, log[-3000:])
        assert _worker_codes(log) == [2] * (2 if g == 0 else 1), log[-3000:]  # every rank: exit code 2
    assert _refusal(got[0][2]).endswith("group 0 has 2 ranks, group 1 has 1 rank. Every group must run with the "
                                        "same settings (groups of unequal size: give every group the same "
                                        "--fl-group-sizes); compare the groups' config.json")
    assert "group 1 has 1 rank, group 0 has 2 ranks." in _refusal(got[1][2])
    assert not list((tmp_path / "run").glob("group_*/metrics.jsonl"))  # nothing trained


def test_other_sync_intervals_are_refused_and_a_restart_does_not_retry(tmp_path):
    lighthouse = f"127.0.0.1:{free_port()}"
    got = _run_groups(tmp_path, lighthouse, {0: _group(0, 1, lighthouse, tmp_path / "run", max_restarts=2),
                                             1: _group(1, 1, lighthouse, tmp_path / "run", "--fl-sync-interval", "2")})
    for g, (seconds, code, log) in got.items():
        assert code != 0 and seconds < 60, (g, seconds, log[-3000:])
    first = _refusal(got[0][2])
    assert "--fl-sync-interval: group 0 has 4, group 1 has 2." in first
    assert "--fl-sync-interval: group 1 has 2, group 0 has 4." in _refusal(got[1][2])
    # torchrun restarted group 0 twice: each attempt says at once why it does not try again
    restarts = re.findall(r"error: not restarting: this job's previous attempt was refused: (.*)", got[0][2])
    assert restarts == [first, first], got[0][2][-3000:]
    assert _worker_codes(got[0][2])[-1] == 2


NO_WAIT = ("--fl-start-wait-seconds", "0")


def test_a_group_joining_with_other_settings_is_refused_and_the_federation_goes_on(tmp_path):
    lighthouse, run = f"127.0.0.1:{free_port()}", tmp_path / "run"
    common = dict(groups=3, min_groups=2, steps=12)
    # groups 0 and 1 meet, sync at step 4 and pause before step 6, while group 2 comes with another seed
    # (they meet without waiting for slot 2 to start: --fl-start-wait-seconds 0)
    got = _run_groups(tmp_path, lighthouse, {0: _group(0, 1, lighthouse, run, *NO_WAIT, **common),
                                             1: _group(1, 1, lighthouse, run, *NO_WAIT, **common),
                                             2: _group(2, 1, lighthouse, run, "--seed", "7", **common)},
                      fault="delay:0:6:25,delay:1:6:25", start_after=((2, 0, "joined groups 0, 1"),), timeout=240)
    assert [got[g][1] for g in (0, 1)] == [0, 0], got[0][2][-3000:] + got[1][2][-3000:]
    assert got[2][0] < 60 and _worker_codes(got[2][2]) == [2], got[2][2][-3000:]
    assert "--seed: group 2 has 7, group 0 has 1234" in _refusal(got[2][2])
    syncs = [[json.loads(line) for line in (run / f"group_{g:05d}" / "metrics.jsonl").read_text().splitlines()]
             for g in (0, 1)]
    assert {(r["step"], tuple(r["groups"])) for records in syncs for r in records if "groups" in r} == \
        {(4, (0, 1)), (8, (0, 1)), (12, (0, 1))}  # group 2 never took part
    assert not (run / "group_00002" / "metrics.jsonl").exists()


def test_a_lighthouse_address_where_nothing_listens_is_named_within_a_minute(tmp_path):
    dead, log = f"127.0.0.1:{free_port()}", tmp_path / "group.log"
    proc = _start(_group(0, 1, dead, tmp_path / "run"), log)
    begin, line = time.monotonic(), None
    try:
        while time.monotonic() - begin < 60 and line is None:
            line = next((ln for ln in log.read_text().splitlines() if "nothing listens there" in ln), None)
            time.sleep(0.5)
    finally:
        stop_all([proc])
    assert line is not None, log.read_text()[-3000:]
    assert f"at the lighthouse {dead}: nothing listens there (connection refused); check --fl-lighthouse" in line


def test_torchrun_static_rendezvous_with_restarts_is_named_with_its_fix(tmp_path):
    argv = _group(0, 1, f"127.0.0.1:{free_port()}", tmp_path / "run", max_restarts=1)
    at = argv.index("--standalone")
    argv[at:at + 1] = ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]  # static rendezvous
    done = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    errors = re.findall(r"fl_megatron\.pretrain: error: (.*)", done.stderr)
    assert errors and "torchrun's static rendezvous" in errors[0], done.stderr[-3000:]
    assert "--rdzv-backend c10d" in errors[0] and "--standalone" in errors[0]
