"""A process to start (argv plus environment), started in its own session with its output in a log file."""

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence


@dataclass(frozen=True)
class Command:
    """One process to start: argv and the variables to add to the launcher's environment."""

    name: str
    argv: list
    env: dict = field(default_factory=dict)


def flag_value(flags: Sequence[str], name: str) -> Optional[str]:
    """The value of `name` in a command line (`--flag VALUE` or `--flag=VALUE`), or None."""
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            return flags[i + 1]
        if flag.startswith(name + "="):
            return flag.split("=", 1)[1]
    return None


def start(command: Command, log_dir: Path) -> tuple[subprocess.Popen, Path]:
    """Start `command` in a new session (its PID is its process group's id), stdin closed,
    stdout and stderr to log_dir/NAME.log. Stop it with tree.stop_all."""
    log = Path(log_dir) / f"{command.name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(command.argv, env={**os.environ, **command.env}, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log
