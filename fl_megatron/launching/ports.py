"""A free local port, and waiting until something listens at HOST:PORT."""

import socket
import subprocess
import time
from typing import Optional


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (another process may take it before the caller does)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_listening(addr: str, proc: Optional[subprocess.Popen], timeout: float, what: str = "the lighthouse") -> None:
    """Return once a connection to addr (HOST:PORT, [IPv6]:PORT) succeeds; raise RuntimeError if
    `proc` exits first or nothing listens within `timeout` s."""
    host, port = addr.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on {addr} within {timeout:.0f} s")
