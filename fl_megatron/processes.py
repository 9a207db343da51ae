"""Local processes by id: whether one still runs (the dead-rank checks and the benchmark's cleanup)."""

import os


def process_alive(pid: int) -> bool:
    """Whether a local process runs (a zombie, killed but not yet reaped, counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
