"""Stopping started processes with all their descendants, by PID.

Launched processes get their own session (process group), but torchrun starts its workers in
new sessions too, so killing the group alone can orphan them: the descendants are collected
from /proc before any signal is sent and signalled one by one. A launcher that is a child
subreaper (become_subreaper) also gets the orphans of its tree as children, so that
stop_tree finds those too.
"""

import ctypes
import os
import signal
import subprocess
import time

from fl_megatron.processes import process_alive

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def _children_map() -> dict[int, list[int]]:
    """Parent PID -> child PIDs, from /proc/<pid>/stat."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    return children


def descendants(pid: int) -> list[int]:
    """All descendants of `pid` (children first, then their children, ...)."""
    children = _children_map()
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop(0)
        found.append(child)
        todo.extend(children.get(child, []))
    return found


def become_subreaper() -> bool:
    """Make this process the child subreaper of its tree (Linux): a descendant whose parent
    dies is re-parented here instead of to init. Returns whether that worked."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):  # gone, or not ours to signal (behind sudo)
            pass


def _killpg(proc: subprocess.Popen, sig: int) -> None:
    """Signal `proc`'s group while `proc` is unreaped (so its PID, the group id, is not reused)."""
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_all(procs: list[subprocess.Popen], grace_s: float = 3.0, extra: list[int] = ()) -> dict[int, list[int]]:
    """SIGTERM each proc's process group, all their descendants and `extra`; after `grace_s`
    SIGKILL what is left, then reap the procs. Returns {PID of each proc not yet reaped: its
    descendants found before the first signal}.

    Each proc must have been started with start_new_session=True (its PID is its group id).
    """
    me = os.getpid()
    procs = [proc for proc in procs if proc.returncode is None]  # reaped: PID may be reused
    trees = {proc.pid: descendants(proc.pid) for proc in procs}
    pids = [p for p in dict.fromkeys([*(d for tree in trees.values() for d in tree), *extra]) if p != me]
    for proc in procs:
        _killpg(proc, signal.SIGTERM)
    _signal(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        done = all(proc.poll() is not None for proc in procs)
        if done and not any(process_alive(p) for p in pids):
            break
        time.sleep(0.02)
    pids += [d for p in pids if process_alive(p) for d in descendants(p)]
    for proc in procs:
        _killpg(proc, signal.SIGKILL)
    _signal([p for p in pids if process_alive(p) and p != me], signal.SIGKILL)
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
    return trees


def stop_tree(procs: list[subprocess.Popen], grace_s: float = 3.0, rounds: int = 3) -> dict[int, list[int]]:
    """stop_all(procs) plus every descendant of this process (with become_subreaper: orphans
    too), again while any is left (at most `rounds` times). Returns stop_all's first answer."""
    trees = stop_all(procs, grace_s, extra=descendants(os.getpid()))
    for _ in range(rounds - 1):
        left = [p for p in descendants(os.getpid()) if process_alive(p)]
        if not left:
            break
        stop_all([], grace_s, extra=left)
    return trees
