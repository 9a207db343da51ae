"""tools/elastic_launch.py and fl_megatron.launching: the lines of the groups' logs the launcher
shows (sample lines as the ranks and torchrun print them), stopping a process tree whose members
sit in sessions of their own, and a real launch interrupted by SIGINT, which must leave nothing
running. The runs to completion are in tests/test_elastic_training.py (`_elastic` checks the
launcher's last line per group there)."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fl_megatron.launching.group_logs import GroupLogs, select_line
from fl_megatron.launching.tree import descendants, stop_all
from fl_megatron.processes import process_alive

ROOT = Path(__file__).resolve().parent.parent
LAUNCHER = ROOT / "tools" / "elastic_launch.py"

TORCHRUN = "E1204 03:38:47.509000 4034 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] "
SAME = "same"  # the text shown is the line, stripped
SAMPLES = [  # (group, line, kind select_line must give (None: not shown), text shown)
    (0, "fl-megatron pretrain", "start", SAME),
    (0, "  group 0 step  3/12 | loss 7.9020 | lr 2.00e-03 | grad 3.439 | 781 tok/s | ETA 0m07s", "progress",
     "step  3/12 | loss 7.9020 | lr 2.00e-03 | grad 3.439 | 781 tok/s | ETA 0m07s"),
    (0, "step  4/12 | loss 7.4011 | lr 1.96e-03 | grad 3.005 | 723 tok/s | sync 265 ms var 5.36e-06 | ETA 0m06s",
     "progress", SAME),
    (0, "  eval at step 80: loss 5.1234, perplexity 168.00", "progress", SAME),
    (1, "  group 1 step  5/12 | loss 7.3275 | lr 1.83e-03 | grad 4.086 | 704 tok/s | ETA 0m04s", None, None),  # not group 0
    (1, "step  4/12 | loss 7.4011 | lr 1.96e-03 | grad 3.005 | 726 tok/s | sync 60 ms var 5.36e-06 | ETA 0m06s", None, None),
    (2, "  group 2: meeting the live groups (lighthouse 127.0.0.1:57947)", None, None),
    (2, "  group 2: joined groups 0, 1, 2 at step 0", "event", "joined groups 0, 1, 2 at step 0"),
    (1, "  group 1: 30 s waiting for the groups' first meeting (at least --fl-min-groups 2 of 2 groups), at the "
        "lighthouse 127.0.0.1:29617; heartbeating now: group(s) 1", "event",
     "30 s waiting for the groups' first meeting (at least --fl-min-groups 2 of 2 groups), at the lighthouse "
     "127.0.0.1:29617; heartbeating now: group(s) 1"),
    (0, "fl_megatron.pretrain: error: group 0: the federation's groups do not match: group 0 has 2 ranks, group 1 "
        "has 1 rank. Every group must run with the same settings", "error", SAME),
    (0, "  step 8: group(s) 1 left the federation (live: 0, 2)", "event", SAME),
    (0, "  step 12: group(s) 1 joined the federation", "event", SAME),
    (2, "  step 12: group(s) 1 healed from the live group(s) 0, 2", "event", SAME),
    (1, "  group 1: healed from the live groups at step 12 in 23.40 s (no checkpoint read)", "event",
     "healed from the live groups at step 12 in 23.40 s (no checkpoint read)"),
    (2, "  group 2: behind the live groups, healed at their step 16 in 1.20 s", "event",
     "behind the live groups, healed at their step 16 in 1.20 s"),
    (0, "  step 8: the sync failed (a peer lost during it) and was voted down: every group restored", "event", SAME),
    (0, "  step 8: federation group(s) 1 left out of the average (non-finite shards or a diverged loss)", "event", SAME),
    (0, "  stopping after step 8 (too few groups at the sync of step 8: missing group(s) 1)", "event", SAME),
    (1, "fl-megatron: injected fault: SIGKILL to rank 3 during forward-backward of step 6", "event", SAME),
    (1, "fl_megatron.pretrain: error: rank 0: a collective failed during forward-backward of step 6", "error", SAME),
    (0, "fl_megatron.pretrain: error: group 0: fewer than --fl-min-groups 3 groups met within the quorum timeout",
     "error", SAME),
    (1, "[rank1]: RuntimeError: CUDA out of memory", "error", SAME),
    (1, "torch.distributed.elastic.multiprocessing.api.SignalException: Process 7033 got signal: 15", None, None),
    (1, "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ", None, None),
    (1, TORCHRUN + "failed (exitcode: -9) local_rank: 1 (pid: 4140) of binary: /work/main/.venv/bin/python", "failed",
     "torchrun: failed (exitcode: -9) local_rank: 1 (pid: 4140) of binary: /work/main/.venv/bin/python"),
    (1, TORCHRUN.replace("E1204", "I1204") + "[default] Worker group FAILED. 1/1 attempts left; will restart worker group",
     "event", "torchrun: [default] Worker group FAILED. 1/1 attempts left; will restart worker group"),
    (1, TORCHRUN.replace("E1204", "W1204") + "Sending process 4139 closing signal SIGTERM", None, None),
    (0, "done: 16 steps in 0m39s, 315 tok/s, final train loss 6.5734", "final", SAME),
    (0, "  bytes per rank: intra-group 552.3 MiB, inter-group 38.5 MiB; summary in /tmp/r/group_00000/summary.json",
     None, None),
    (0, "[group_0:cb7aae58-3f7c-416e-90e7-4156627628e6/1 - step 8] Unable to reset NCCL flight recorder recording",
     None, None),
    (0, "/work/main/.venv/lib/python3.11/site-packages/torch/distributed/_serialization.py:63: UserWarning: The "
        "given buffer is not writable", None, None),
    (0, '::ffff:127.0.0.1 - - [04/Dec/2026 03:39:16] "GET /checkpoint/12/full HTTP/1.1" 200 -', None, None),
    (0, "  saved checkpoint /tmp/r/ckpt/group_00000/iter_0000008", None, None),
    (0, "  4 ranks on 2 nodes x 2", None, None),
]


@pytest.mark.parametrize("group,line,kind,text", SAMPLES, ids=[f"{i}" for i in range(len(SAMPLES))])
def test_select_line_on_sample_lines(group, line, kind, text):
    expected = None if kind is None else (kind, line.strip() if text == SAME else text)
    assert select_line(group, line) == expected


def test_group_logs_follow_growing_files_and_name_each_groups_last_word(tmp_path):
    paths = {0: tmp_path / "group_0.log", 1: tmp_path / "group_1.log"}
    shown = []
    logs = GroupLogs(paths, shown.append)
    logs.poll()  # no file yet
    paths[0].write_text("fl-megatron pretrain\n  group 0: joined groups 0, 1 at step 0\n  group 0 step  1/4 | loss 8.1")
    paths[1].write_text("fl-megatron pretrain\n")
    logs.poll()
    assert shown == ["[group 0] joined groups 0, 1 at step 0"]  # the progress line is not finished yet
    with open(paths[0], "a") as f:
        f.write(" | ETA 0m01s\ndone: 4 steps in 0m01s, 9 tok/s, final train loss 7.0\n")
    with open(paths[1], "a") as f:
        f.write("fl_megatron.pretrain: error: rank 1: boom\n" + TORCHRUN + "failed (exitcode: 2) local_rank: 1\n"
                "fl-megatron pretrain\n" + TORCHRUN + "failed (exitcode: -9) local_rank: 0\n")
    logs.poll()
    assert shown[1:] == ["[group 0] step  1/4 | loss 8.1 | ETA 0m01s", "[group 1] fl_megatron.pretrain: error: rank 1: boom",
                         "[group 1] torchrun: failed (exitcode: 2) local_rank: 1", "[group 1] restarted by torchrun (attempt 2)",
                         "[group 1] torchrun: failed (exitcode: -9) local_rank: 0"]
    # the last attempt's word counts: group 1's second attempt printed no error of its own
    assert logs.final_lines({0: 0, 1: 1}) == ["[group 0] exit code 0: done: 4 steps in 0m01s, 9 tok/s, final train loss 7.0",
                                              "[group 1] exit code 1: torchrun: failed (exitcode: -9) local_rank: 0"]
    assert logs.final_lines({1: None}) == ["[group 1] stopped while running (its last word: torchrun: failed "
                                           "(exitcode: -9) local_rank: 0)"]


def test_nothing_else_in_the_package_imports_the_launching_leaf():
    from test_import_layers import PACKAGE, _imports

    users = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != "launching"
             and any(m.startswith("fl_megatron.launching") for m in _imports(p))]
    assert users == []
    assert any(m.startswith("fl_megatron.launching") for m in _imports(PACKAGE / "launching" / "lighthouse.py"))


# A process in its own session whose child starts one more in a session of its own: as torchrun
# starts its workers. Signalling the first one's process group reaches neither of the others.
NESTED = textwrap.dedent("""
    import subprocess, sys, time
    inner = "import subprocess, time; subprocess.Popen(['sleep', '300'], start_new_session=True); time.sleep(300)"
    subprocess.Popen([sys.executable, "-c", inner], start_new_session=True)
    time.sleep(300)
""")


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what} within {timeout:.0f} s")


def test_stop_all_reaches_descendants_in_sessions_of_their_own():
    top = subprocess.Popen([sys.executable, "-c", NESTED], start_new_session=True)
    tree = _wait_for(lambda: len(descendants(top.pid)) == 2 and descendants(top.pid), 30, "two descendants")
    try:
        assert all(os.getsid(pid) != top.pid for pid in tree)  # each its own session
        stop_all([top], grace_s=2.0)
        assert top.returncode is not None and not any(process_alive(p) for p in tree)
    finally:
        for pid in tree:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _sigint_default() -> None:
    """A suite started in the background hands its children SIGINT ignored; the launcher's user presses Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.timeout(180)
def test_sigint_while_training_leaves_no_process_of_the_tree_running(tmp_path):
    """2 groups of 2 ranks training; the ranks take SIGTERM as "save and stop at the next sync"
    (--exit-signal-handler), which is 400 steps away: a launcher that only signals the process
    groups it started (torchrun's agents) leaves them running once it gives up on the agents."""
    pytest.importorskip("torchft")
    run, shown = tmp_path / "run", tmp_path / "launcher.out"
    argv = [sys.executable, str(LAUNCHER), "--groups", "2", "--ranks-per-group", "2", "--min-groups", "2",
            "--heartbeat-timeout-ms", "1000", "--", "--config", str(ROOT / "examples" / "demo.json"),
            "--train-iters", "400", "--seq-length", "32", "--micro-batch-size", "1", "--eval-iters", "0",
            "--eval-interval", "0", "--log-interval", "1", "--fl-sync-interval", "400", "--exit-signal-handler",
            "--save", str(tmp_path / "ckpt"), "--run-dir", str(run)]
    env = {k: v for k, v in os.environ.items() if k != "FL_MEGATRON_FAULT"}
    env.update(OMP_NUM_THREADS="1", FL_MEGATRON_DEVICE="cpu", RUST_LOG="warn")
    with open(shown, "w") as out:
        launcher = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    preexec_fn=_sigint_default)
    tree = []
    try:
        # training has begun, and the launcher shows it: group 0's progress lines
        _wait_for(lambda: launcher.poll() is not None or "[group 0] step " in shown.read_text(), 120,
                  "no progress line of group 0 shown")
        assert launcher.poll() is None, shown.read_text()
        tree = descendants(launcher.pid)
        children = [p for p in tree if _ppid(p) == launcher.pid]
        workers = [p for p in tree if p not in children and "fl_megatron.pretrain" in _cmdline(p)]
        assert len(children) == 3 and len(workers) == 4, [(p, _ppid(p), _cmdline(p)[:120]) for p in tree]
        assert all(os.getsid(w) == w for w in workers)  # torchrun starts each in a session of its own
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=60) == 130
        alive = [(p, _cmdline(p)[:120]) for p in tree if process_alive(p)]
        text = shown.read_text()
        assert not alive, f"still running after the launcher exited: {alive}\n{text[-3000:]}"
    finally:  # on a failure: what is left (the PIDs of the dead may be reused: only the live ones)
        stop_all([launcher], grace_s=1.0, extra=[p for p in tree if process_alive(p)])
    assert re.search(r"elastic_launch: interrupted \(SIGINT\): stopped the lighthouse, group_0 \(\d+ processes\), "
                     r"group_1 \(\d+ processes\)", text), text[-3000:]
    assert "[group 0] joined groups 0, 1 at step 0" in text and "[group 1] joined groups 0, 1 at step 0" in text
    assert not re.search(r"\[group 1\] step ", text)  # progress of group 0 only
    assert "[group 0] stopped while running" in text and "[group 1] stopped while running" in text


def test_groups_of_unequal_size_get_their_own_torchrun_sizes_and_the_list():
    """--ranks-per-group 2,1: one torchrun job of 2 ranks and one of 1, each told every group's size
    (--fl-group-sizes, not --fl-num-groups); a list of the wrong length, or the flag given by hand,
    is refused. Printed by the launcher itself (--print-only), as a user would see it."""
    done = subprocess.run([sys.executable, str(LAUNCHER), "--ranks-per-group", "2,1", "--print-only", "--",
                           "--config", "examples/demo.json"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    groups = [line for line in done.stdout.splitlines() if "fl_megatron.pretrain" in line]
    assert len(groups) == 2
    for g, line in enumerate(groups):
        assert f"--nproc-per-node {2 - g} " in line and f"--fl-group-id {g} " in line, line
        assert "--fl-group-sizes 2,1 " in line and "--fl-num-groups" not in line, line
    for argv, needle in ((["--groups", "3", "--ranks-per-group", "2,1"], "2 group sizes for 3 groups"),
                         (["--ranks-per-group", "2,1", "--", "--fl-group-sizes", "2,1"],
                          "--fl-group-sizes is set by the launcher")):
        refused = subprocess.run([sys.executable, str(LAUNCHER), "--print-only", *argv], capture_output=True,
                                 text=True, timeout=60, cwd=ROOT)
        assert refused.returncode == 2 and needle in refused.stderr, refused.stderr
