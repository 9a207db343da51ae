"""Removing namespaces left behind by a cluster whose process was SIGKILLed.

Cluster namespaces are named `flm<pid>x<seq>-...` with the PID of the creating process; a
namespace of ours whose creator is gone is stale. Leftover processes inside it (orphaned
ranks of the dead run) are killed, then the namespace is deleted. Caveat: the PID check is
only meaningful for creators in the same PID namespace as the caller.
"""

import os
import re
import signal

from cluster_bench.netns_ops import NetnsError, delete_namespace, list_namespaces, namespace_pids

DEFAULT_PATTERN = r"flm(?P<pid>\d+)x\d+-"


def pid_exists(pid: int) -> bool:
    """True if a process with this PID exists (zombies included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(prefix_pattern: str = DEFAULT_PATTERN) -> list[str]:
    """Delete namespaces matching `prefix_pattern` (a regex, anchored at the start, with a
    group `pid`) whose creating PID no longer exists; return the names removed."""
    regex = re.compile(prefix_pattern)
    if "pid" not in regex.groupindex:
        raise ValueError(f"prefix_pattern needs a named group 'pid': {prefix_pattern!r}")
    removed = []
    for name in list_namespaces():
        match = regex.match(name)
        if not match or pid_exists(int(match["pid"])):
            continue
        for pid in namespace_pids(name):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            delete_namespace(name)
            removed.append(name)
        except NetnsError:
            pass  # raced with another cleaner
    return removed
