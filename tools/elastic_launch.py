#!/usr/bin/env python3
"""Elastic federation on one machine: a torchft lighthouse plus one torchrun job per federation
group, each its own world and failure domain (torchrun restarts a failed group up to
--max-restarts times; the other groups go on without it). The CPU demo and the tests use it:

    python tools/elastic_launch.py --groups 3 --ranks-per-group 2 --min-groups 2 -- \\
        --config examples/demo.json --run-dir runs/demo-elastic

Each group writes RUN_DIR/group_GGGGG/ (its own metrics, config and summary) and logs to
RUN_DIR/launch/group_G.log. The lighthouse's settings come from the flags here:
--min_replicas is --min-groups (the groups' --fl-min-groups), --join_timeout_ms how long a quorum
waits for a group that heartbeats but has not asked to join, --heartbeat_timeout_ms how long a
silent group counts as live. See docs/failures.md.
"""

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
from torchft_launch import (LIGHTHOUSE_EXE, Command, _flag_value, _kill, _start, _wait_listening,  # noqa: E402
                            free_port)

SET_BY_LAUNCHER = ("--fl-elastic", "--fl-lighthouse", "--fl-group-id", "--fl-num-groups", "--fl-min-groups",
                   "--world-size")


def elastic_commands(num_groups: int, ranks_per_group: int, min_groups: int, flags: Sequence[str], *,
                     lighthouse: str, max_restarts: int = 3, join_timeout_ms: int = 60000,
                     heartbeat_timeout_ms: int = 5000, python: str = sys.executable) -> list[Command]:
    """The lighthouse's command, then one torchrun command per group."""
    problems = [f"{f} is set by the launcher; drop it" for f in SET_BY_LAUNCHER
                if f in flags or _flag_value(flags, f) is not None]
    if num_groups < 1 or ranks_per_group < 1 or not 1 <= min_groups <= num_groups:
        problems.append(f"groups={num_groups}, ranks per group={ranks_per_group} and min groups={min_groups}: "
                        "need groups >= 1, ranks >= 1 and 1 <= min groups <= groups")
    if problems:
        raise ValueError("; ".join(problems))
    # a fresh rendezvous store per torchrun restart: on the shared one a restarted rank can read
    # its dead predecessor's address (pretrain refuses elastic restarts without this)
    env = {"RUST_LOG": "warn", "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    commands = [Command("lighthouse", [str(Path(python).parent / LIGHTHOUSE_EXE), "--bind", lighthouse,
                                       "--min_replicas", str(min_groups), "--quorum_tick_ms", "100",
                                       "--join_timeout_ms", str(join_timeout_ms),
                                       "--heartbeat_timeout_ms", str(heartbeat_timeout_ms)], env)]
    for g in range(num_groups):
        argv = [python, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                "--nproc-per-node", str(ranks_per_group), "--max-restarts", str(max_restarts),
                "-m", "fl_megatron.pretrain", *flags, "--fl-elastic", "--fl-lighthouse", lighthouse,
                "--fl-group-id", str(g), "--fl-num-groups", str(num_groups), "--fl-min-groups", str(min_groups)]
        commands.append(Command(f"group_{g}", argv, env))
    return commands


def run_elastic(commands: list[Command], log_dir: Path, timeout: float, delays: dict) -> dict:
    """Start the lighthouse, then each group (group g after delays.get(g, 0) s); wait until every
    group has exited (at most `timeout` s), stop the lighthouse. Returns {group name: exit code}
    (None: killed at the timeout)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    lighthouse_cmd, group_cmds = commands[0], commands[1:]
    started, procs, begin = [], {}, time.monotonic()
    try:
        lighthouse, _ = _start(lighthouse_cmd, log_dir)
        started.append(lighthouse)
        _wait_listening(lighthouse_cmd.argv[lighthouse_cmd.argv.index("--bind") + 1], lighthouse, 30.0)
        waiting = sorted(range(len(group_cmds)), key=lambda g: delays.get(g, 0.0))
        while time.monotonic() - begin < timeout:
            elapsed = time.monotonic() - begin
            while waiting and delays.get(waiting[0], 0.0) <= elapsed:
                g = waiting.pop(0)
                procs[group_cmds[g].name], _ = _start(group_cmds[g], log_dir)
                started.append(procs[group_cmds[g].name])
                print(f"elastic_launch: started {group_cmds[g].name} at {elapsed:.1f} s", flush=True)
            if not waiting and all(p.poll() is not None for p in procs.values()):
                break
            time.sleep(0.1)
    finally:
        _kill(started)
    return {name: p.returncode for name, p in procs.items()}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s [options] -- PRETRAIN_FLAGS")
    parser.add_argument("--groups", type=int, default=2, help="federation group slots F (one torchrun job each)")
    parser.add_argument("--ranks-per-group", type=int, default=2, help="ranks of each group's job")
    parser.add_argument("--min-groups", type=int, default=1, help="live groups a sync needs (--fl-min-groups)")
    parser.add_argument("--max-restarts", type=int, default=3, help="torchrun restarts of a failed group")
    parser.add_argument("--lighthouse", metavar="HOST:PORT", help="lighthouse address (default 127.0.0.1:free port)")
    parser.add_argument("--join-timeout-ms", type=int, default=60000, help="lighthouse: wait for heartbeating groups")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=5000, help="lighthouse: silence before a group is dropped")
    parser.add_argument("--start-delay", action="append", default=[], metavar="G:SECONDS",
                        help="start group G this many seconds after the others (a group joining a running federation)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before everything is killed")
    parser.add_argument("--print-only", action="store_true", help="print the commands, start nothing")
    args, rest = parser.parse_known_args(argv)
    flags = rest[1:] if rest[:1] == ["--"] else rest
    try:
        delays = {int(g): float(s) for g, s in (item.split(":", 1) for item in args.start_delay)}
        commands = elastic_commands(args.groups, args.ranks_per_group, args.min_groups, flags,
                                    lighthouse=args.lighthouse or f"127.0.0.1:{free_port()}",
                                    max_restarts=args.max_restarts, join_timeout_ms=args.join_timeout_ms,
                                    heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    except ValueError as e:
        parser.error(str(e))
    if args.print_only:
        for command in commands:
            print(" ".join(f"{k}={v}" for k, v in command.env.items()), shlex.join(command.argv))
        return 0
    run_dir = Path(_flag_value(flags, "--run-dir") or "runs/latest")
    codes = run_elastic(commands, run_dir / "launch", args.timeout, delays)
    print(f"elastic_launch: exit codes {codes}; logs in {run_dir / 'launch'}; each group's records in "
          f"{run_dir}/group_GGGGG/", flush=True)
    return 0 if codes and all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
