"""torchft's lighthouse (the quorum server of the replica groups): its command, started and
waited for until it listens."""

import subprocess
import sys
from pathlib import Path
from typing import Optional

from .commands import Command, flag_value, start
from .ports import wait_listening
from .tree import stop_all

LIGHTHOUSE_EXE = "torchft_lighthouse"  # installed beside the Python of torchft's environment


def lighthouse_command(bind: str, min_replicas: int, *, join_timeout_ms: int, heartbeat_timeout_ms: Optional[int] = None,
                       quorum_tick_ms: int = 100, python: str = sys.executable, env: Optional[dict] = None) -> Command:
    """The lighthouse listening on `bind` (HOST:PORT); heartbeat_timeout_ms None: its own default."""
    argv = [str(Path(python).parent / LIGHTHOUSE_EXE), "--bind", bind, "--min_replicas", str(min_replicas),
            "--quorum_tick_ms", str(quorum_tick_ms), "--join_timeout_ms", str(join_timeout_ms)]
    if heartbeat_timeout_ms is not None:
        argv += ["--heartbeat_timeout_ms", str(heartbeat_timeout_ms)]
    return Command("lighthouse", argv, {"RUST_LOG": "warn"} if env is None else env)


def start_lighthouse(command: Command, log_dir: Path, addr: Optional[str] = None,
                     timeout: float = 30.0) -> tuple[subprocess.Popen, Path]:
    """Start the lighthouse (commands.start) and wait until it listens at `addr` (default: its
    --bind address); stopped again if it does not within `timeout` s (RuntimeError)."""
    proc, log = start(command, log_dir)
    try:
        wait_listening(addr or flag_value(command.argv, "--bind"), proc, timeout)
    except BaseException:
        stop_all([proc])
        raise
    return proc, log
