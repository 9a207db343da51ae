#!/usr/bin/env python3
"""Elastic federation on one machine: a torchft lighthouse plus one torchrun job per federation
group, each its own world and failure domain (torchrun restarts a failed group up to
--max-restarts times; the other groups go on without it). The CPU demo and the tests use it:

    python tools/elastic_launch.py --groups 3 --ranks-per-group 2 --min-groups 2 -- \\
        --config examples/demo.json --run-dir runs/demo-elastic

Each group writes RUN_DIR/group_GGGGG/ (its own metrics, config and summary) and logs to
RUN_DIR/launch/group_G.log. While they run, the launcher shows group 0's progress lines and every
group's leaves, joins, heals, restarts, stops and errors from those logs, then each group's last
line with its exit code (--quiet: only the exit codes). Ctrl-C, SIGTERM, --timeout or an error
stops every process it started, with all their descendants (exit code 130 on Ctrl-C).
The lighthouse's settings come from the flags here: --min_replicas is --min-groups (the groups'
--fl-min-groups), --join_timeout_ms how long a quorum waits for a group that heartbeats but has
not asked to join, --heartbeat_timeout_ms how long a silent group counts as live. See
docs/failures.md.
"""

import argparse
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from fl_megatron.launching.commands import Command, flag_value, start
from fl_megatron.launching.group_logs import GroupLogs
from fl_megatron.launching.lighthouse import lighthouse_command, start_lighthouse
from fl_megatron.launching.ports import free_port
from fl_megatron.launching.tree import become_subreaper, stop_tree

SET_BY_LAUNCHER = ("--fl-elastic", "--fl-lighthouse", "--fl-group-id", "--fl-num-groups", "--fl-group-sizes",
                   "--fl-min-groups", "--world-size")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Terminated(BaseException):
    """SIGTERM or SIGHUP reached the launcher (SIGINT raises KeyboardInterrupt)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _terminate(signum, frame) -> None:
    raise Terminated(signum)


def elastic_commands(num_groups: int, ranks_per_group, min_groups: int, flags: Sequence[str], *,
                     lighthouse: str, max_restarts: int = 3, join_timeout_ms: int = 60000,
                     heartbeat_timeout_ms: int = 5000, python: str = sys.executable) -> list[Command]:
    """The lighthouse's command, then one torchrun command per group. `ranks_per_group`: every
    group's size, or a list of one size per group (groups of unequal size: --fl-group-sizes)."""
    problems = [f"{f} is set by the launcher; drop it" for f in SET_BY_LAUNCHER
                if f in flags or flag_value(flags, f) is not None]
    unequal = not isinstance(ranks_per_group, int)
    sizes = list(ranks_per_group) if unequal else [ranks_per_group] * max(num_groups, 0)
    if unequal and len(sizes) != num_groups:
        problems.append(f"{len(sizes)} group sizes for {num_groups} groups: give one per group")
    if num_groups < 1 or min(sizes, default=0) < 1 or not 1 <= min_groups <= num_groups:
        problems.append(f"groups={num_groups}, ranks per group={ranks_per_group} and min groups={min_groups}: "
                        "need groups >= 1, ranks >= 1 and 1 <= min groups <= groups")
    if problems:
        raise ValueError("; ".join(problems))
    # a fresh rendezvous store per torchrun restart: on the shared one a restarted rank can read
    # its dead predecessor's address (pretrain refuses elastic restarts without this)
    env = {"RUST_LOG": "warn", "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    commands = [lighthouse_command(lighthouse, min_groups, join_timeout_ms=join_timeout_ms,
                                   heartbeat_timeout_ms=heartbeat_timeout_ms, python=python, env=env)]
    groups = ["--fl-group-sizes", ",".join(map(str, sizes))] if unequal else ["--fl-num-groups", str(num_groups)]
    for g in range(num_groups):
        argv = [python, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                "--nproc-per-node", str(sizes[g]), "--max-restarts", str(max_restarts),
                "-m", "fl_megatron.pretrain", *flags, "--fl-elastic", "--fl-lighthouse", lighthouse,
                "--fl-group-id", str(g), *groups, "--fl-min-groups", str(min_groups)]
        commands.append(Command(f"group_{g}", argv, env))
    return commands


def _say(text: str) -> None:
    print(text, flush=True)


class _SignalsHeld:
    """Ignore the stop signals while the processes are being stopped (main thread only)."""

    def __enter__(self):
        main = threading.current_thread() is threading.main_thread()
        self.saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS} if main else {}

    def __exit__(self, *exc):
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)


def run_elastic(commands: list[Command], log_dir: Path, timeout: float, delays: dict,
                follow: Optional[Callable[[str], None]] = None) -> dict:
    """Start the lighthouse, then each group (group g after delays.get(g, 0) s); wait until every
    group has exited (at most `timeout` s); stop every process started and all their descendants
    (the lighthouse; on a timeout, Ctrl-C, SIGTERM or an error the groups too, named). follow:
    gets the lines of the groups' logs worth showing (GroupLogs) and at the end each group's
    last line. Returns {group name: exit code} (None: still running when stopped)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    lighthouse_cmd, group_cmds = commands[0], commands[1:]
    logs = GroupLogs({g: log_dir / f"{c.name}.log" for g, c in enumerate(group_cmds)}, follow) if follow else None
    started, procs, begin, why = {}, {}, time.monotonic(), None
    try:
        started["lighthouse"], _ = start_lighthouse(lighthouse_cmd, log_dir)
        waiting = sorted(range(len(group_cmds)), key=lambda g: delays.get(g, 0.0))
        while time.monotonic() - begin < timeout:
            elapsed = time.monotonic() - begin
            while waiting and delays.get(waiting[0], 0.0) <= elapsed:
                command = group_cmds[waiting.pop(0)]
                procs[command.name] = started[command.name] = start(command, log_dir)[0]
                _say(f"elastic_launch: started {command.name} at {elapsed:.1f} s")
            if logs is not None:
                logs.poll()
            if not waiting and all(p.poll() is not None for p in procs.values()):
                break
            time.sleep(0.1)
        else:
            why = f"timed out after {timeout:.0f} s"
    except KeyboardInterrupt:
        why = "interrupted (SIGINT)"
        raise
    except Terminated as e:
        why = f"terminated ({e})"
        raise
    except BaseException as e:
        why = f"stopping on {e!r}"
        raise
    finally:
        with _SignalsHeld():
            codes = {name: p.poll() for name, p in procs.items()}
            trees = stop_tree(list(started.values()))
            if logs is not None:
                logs.poll(flush=True)
                for line in logs.final_lines({g: codes[c.name] for g, c in enumerate(group_cmds) if c.name in codes}):
                    follow(line)
            if why:  # a run that ended by itself had only the lighthouse left to stop
                named = ["the lighthouse" if name == "lighthouse" else f"{name} ({1 + len(trees[p.pid])} processes)"
                         for name, p in started.items() if p.pid in trees]
                _say(f"elastic_launch: {why}: stopped {', '.join(named) or 'nothing'}")
    return codes


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s [options] -- PRETRAIN_FLAGS")
    parser.add_argument("--groups", type=int, help="federation group slots F (one torchrun job each; default 2, or "
                                                   "the count of --ranks-per-group's list)")
    parser.add_argument("--ranks-per-group", default="2", metavar="N or N,N,...",
                        help="ranks of each group's job, or one count per group for groups of unequal size "
                             "(passed on as --fl-group-sizes)")
    parser.add_argument("--min-groups", type=int, default=1, help="live groups a sync needs (--fl-min-groups)")
    parser.add_argument("--max-restarts", type=int, default=3, help="torchrun restarts of a failed group")
    parser.add_argument("--lighthouse", metavar="HOST:PORT", help="lighthouse address (default 127.0.0.1:free port)")
    parser.add_argument("--join-timeout-ms", type=int, default=60000, help="lighthouse: wait for heartbeating groups")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=5000, help="lighthouse: silence before a group is dropped")
    parser.add_argument("--start-delay", action="append", default=[], metavar="G:SECONDS",
                        help="start group G this many seconds after the others (a group joining a running federation)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before everything is stopped")
    parser.add_argument("--quiet", action="store_true", help="show nothing of the groups' logs, only the exit codes")
    parser.add_argument("--print-only", action="store_true", help="print the commands, start nothing")
    args, rest = parser.parse_known_args(argv)
    flags = rest[1:] if rest[:1] == ["--"] else rest
    try:
        delays = {int(g): float(s) for g, s in (item.split(":", 1) for item in args.start_delay)}
        sizes = [int(n) for n in args.ranks_per_group.split(",")]
        ranks = sizes[0] if "," not in args.ranks_per_group else sizes
        if args.groups is None:
            args.groups = len(sizes) if "," in args.ranks_per_group else 2
        commands = elastic_commands(args.groups, ranks, args.min_groups, flags,
                                    lighthouse=args.lighthouse or f"127.0.0.1:{free_port()}",
                                    max_restarts=args.max_restarts, join_timeout_ms=args.join_timeout_ms,
                                    heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    except ValueError as e:
        parser.error(str(e))
    if args.print_only:
        for command in commands:
            print(" ".join(f"{k}={v}" for k, v in command.env.items()), shlex.join(command.argv))
        return 0
    run_dir = Path(flag_value(flags, "--run-dir") or "runs/latest")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, _terminate)
    become_subreaper()  # orphans of the groups' process trees come here, where stopping finds them
    try:
        codes = run_elastic(commands, run_dir / "launch", args.timeout, delays, follow=None if args.quiet else _say)
    except KeyboardInterrupt:
        return 130
    except Terminated as e:
        return 128 + e.signum
    print(f"elastic_launch: exit codes {codes}; logs in {run_dir / 'launch'}; each group's records in "
          f"{run_dir}/group_GGGGG/", flush=True)
    return 0 if codes and all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
