#!/usr/bin/env python3
"""Launch the torchft peer: one lighthouse plus one torchrun job per replica group.

`torchft_commands(...)` builds the commands (argv + environment); `run_torchft(...)` starts them,
waits with a timeout and stops every process it started, with all their descendants, at the end
and on failure, timeout or Ctrl-C (fl_megatron.launching).
Quick run on loopback:

    python tools/peers/torchft_launch.py --groups 2 --ranks-per-group 2 -- \\
        --model llama-tiny --mock-data --train-iters 20 --fl-sync-interval 4 --run-dir runs/torchft

Per-group command prefixes (e.g. `ip netns exec node1`) put each group on its own emulated node;
the variables a job needs are then also passed through `env` after the prefix, so that a prefix
which resets the environment (sudo) cannot drop them.
"""

import argparse
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from fl_megatron.launching.commands import Command, flag_value, start
from fl_megatron.launching.lighthouse import LIGHTHOUSE_EXE, lighthouse_command, start_lighthouse
from fl_megatron.launching.ports import free_port
from fl_megatron.launching.tree import stop_all

WORKER = Path(__file__).resolve().parent / "torchft_train.py"


@dataclass(frozen=True)
class TorchftPlan:
    lighthouse: Command
    groups: list
    lighthouse_addr: str      # host:port the groups reach the lighthouse at
    run_dir: Path


@dataclass
class TorchftResult:
    exit_codes: list          # one per replica group (None: killed before it exited)
    run_dir: Path
    logs: dict                # process name -> log file
    seconds: float
    failure: Optional[str] = None   # why the run was stopped (None: every group exited 0)

    @property
    def ok(self) -> bool:
        return self.failure is None


def _prefixed(prefix: Sequence[str], argv: list, env: dict) -> list:
    """argv behind a prefix, with `env` repeated on the command line when there is a prefix."""
    if not prefix:
        return argv
    return [*prefix, "env", *(f"{k}={v}" for k, v in env.items()), *argv]


def _rendezvous(host: str, port: int, max_restarts: int) -> list:
    """torchrun's rendezvous flags of one group: its store at host:port; with restarts a fresh
    store per attempt instead (--standalone, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; the workers'
    MASTER_ADDR is host, MASTER_PORT a new port), since on the static one a restarted job reads
    its previous attempt's addresses (as in elastic_launch)."""
    if not max_restarts:
        return ["--master-addr", host, "--master-port", str(port)]
    return ["--max-restarts", str(max_restarts), "--standalone", "--local-addr", host]


def torchft_commands(num_groups: int, ranks_per_group: int, worker_flags: Sequence[str], *,
                     prefixes: Optional[Sequence[Sequence[str]]] = None,
                     advertise_hosts: Optional[Sequence[str]] = None,
                     lighthouse_addr: Optional[str] = None, lighthouse_bind: Optional[str] = None,
                     lighthouse_prefix: Sequence[str] = (), master_ports: Optional[Sequence[int]] = None,
                     python: str = sys.executable, join_timeout_ms: int = 10000,
                     quorum_tick_ms: int = 100, min_replicas: Optional[int] = None, max_restarts: int = 0,
                     heartbeat_timeout_ms: Optional[int] = None) -> TorchftPlan:
    """The lighthouse command and one torchrun command per replica group.

    prefixes / advertise_hosts / master_ports: one per group (default: no prefix, 127.0.0.1,
    free loopback ports; master_ports go unused with max_restarts). lighthouse_addr: host:port the
    groups connect to (default 127.0.0.1 and a free port); lighthouse_bind: what it listens on (default lighthouse_addr).
    Failures: min_replicas (default all groups) is the lighthouse's --min_replicas and the
    workers' --min-replicas, the groups a sync needs; max_restarts is torchrun's --max-restarts of
    each group (a restarted group heals from the live ones, torchft_train.rejoin);
    heartbeat_timeout_ms how long the lighthouse counts a silent group as live (default: its own)."""
    problems = []
    if num_groups < 1 or ranks_per_group < 1:
        problems.append(f"groups={num_groups} and ranks per group={ranks_per_group} must be at least 1")
    if min_replicas is not None and not 1 <= min_replicas <= num_groups:
        problems.append(f"min_replicas={min_replicas} must lie in [1, {num_groups}]")
    if max_restarts < 0:
        problems.append(f"max_restarts={max_restarts} must be at least 0")
    for name, values in (("prefixes", prefixes), ("advertise_hosts", advertise_hosts),
                         ("master_ports", master_ports)):
        if values is not None and len(values) != num_groups:
            problems.append(f"{name} has {len(values)} entries for {num_groups} replica groups")
    for flag in ("--advertise-host", "--min-replicas", "--fl-num-groups", "--world-size"):
        if flag_value(worker_flags, flag) is not None or flag in worker_flags:
            problems.append(f"{flag} is set by the launcher; drop it from the worker flags")
    if problems:
        raise ValueError("; ".join(problems))
    prefixes = [list(p) for p in prefixes] if prefixes is not None else [[] for _ in range(num_groups)]
    hosts = list(advertise_hosts) if advertise_hosts is not None else ["127.0.0.1"] * num_groups
    ports = list(master_ports) if master_ports is not None else [free_port() for _ in range(num_groups)]
    lighthouse_addr = lighthouse_addr or f"127.0.0.1:{free_port()}"
    bare = lighthouse_command(lighthouse_bind or lighthouse_addr, min_replicas or num_groups,
                              join_timeout_ms=join_timeout_ms, heartbeat_timeout_ms=heartbeat_timeout_ms,
                              quorum_tick_ms=quorum_tick_ms, python=python)
    replicas = ["--min-replicas", str(min_replicas)] if min_replicas is not None else []
    lighthouse = Command("lighthouse", _prefixed(lighthouse_prefix, bare.argv, bare.env), bare.env)
    groups = []
    for g in range(num_groups):
        env = {"TORCHFT_LIGHTHOUSE": f"http://{lighthouse_addr}", "REPLICA_GROUP_ID": str(g),
               "NUM_REPLICA_GROUPS": str(num_groups), "RUST_LOG": "warn", "OMP_NUM_THREADS": "1"}
        if max_restarts:  # a fresh rendezvous store per attempt (see _rendezvous)
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        argv = [python, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(ranks_per_group),
                *_rendezvous(hosts[g], ports[g], max_restarts), str(WORKER),
                *worker_flags, *replicas, "--advertise-host", hosts[g]]
        groups.append(Command(f"group{g}", _prefixed(prefixes[g], argv, env), env))
    run_dir = Path(flag_value(worker_flags, "--run-dir") or "runs/latest")
    return TorchftPlan(lighthouse, groups, lighthouse_addr, run_dir)


STRANDED_GRACE_S = 60.0  # normal ends of groups are seconds apart; a stranded group waits far longer


class StrandedWatch:
    """Groups that can no longer meet a quorum of min_replicas: some group finished (exit code 0)
    and fewer than min_replicas are still running - a restarted group that came back after the
    others' last sync waits for one in vain (up to its quorum timeout). `check` names them once
    that has lasted grace_s."""

    def __init__(self, min_replicas: int, grace_s: float = STRANDED_GRACE_S):
        self.min_replicas, self.grace_s, self.since = min_replicas, grace_s, None

    def check(self, codes: list, now: float) -> Optional[str]:
        running = [i for i, c in enumerate(codes) if c is None]
        if not (running and 0 in codes and len(running) < self.min_replicas):
            self.since = None
            return None
        self.since = now if self.since is None else self.since
        if now - self.since < self.grace_s:
            return None
        return (f"group(s) {running} still wait for a quorum of {self.min_replicas} groups {now - self.since:.0f} s "
                "after the others finished (a restarted group came back after their last sync: train longer "
                "or kill earlier)")


def run_torchft(plan: TorchftPlan, timeout: float = 600.0, log_dir: Optional[Path] = None,
                wait_lighthouse: Optional[bool] = None) -> TorchftResult:
    """Start the lighthouse and every group; wait for the groups (at most `timeout` s); stop
    the lighthouse. Logs go to log_dir (default RUN_DIR/torchft_logs). The lighthouse is probed
    for readiness unless it runs behind a prefix (another namespace) or wait_lighthouse=False."""
    log_dir = Path(log_dir or plan.run_dir / "torchft_logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    if wait_lighthouse is None:
        wait_lighthouse = plan.lighthouse.argv[0].endswith(LIGHTHOUSE_EXE)
    started, groups, logs, codes, failure = [], [], {}, [None] * len(plan.groups), None
    stranded = StrandedWatch(int(flag_value(plan.lighthouse.argv, "--min_replicas") or len(plan.groups)))
    begin = time.monotonic()
    try:
        if wait_lighthouse:
            lighthouse, logs["lighthouse"] = start_lighthouse(plan.lighthouse, log_dir, plan.lighthouse_addr)
        else:
            lighthouse, logs["lighthouse"] = start(plan.lighthouse, log_dir)
        started.append(lighthouse)
        for command in plan.groups:
            proc, logs[command.name] = start(command, log_dir)
            started.append(proc)
            groups.append(proc)
        while failure is None:
            codes = [p.poll() for p in groups]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                failure = "; ".join(f"group {i} exited with code {c}" for i, c in failed)
            elif all(c == 0 for c in codes):
                break
            elif lighthouse.poll() is not None:
                failure = f"the lighthouse exited with code {lighthouse.returncode}"
            elif time.monotonic() - begin > timeout:
                failure = f"timed out after {timeout:.0f} s"
            else:
                failure = stranded.check(codes, time.monotonic())
                time.sleep(0.1)
    finally:
        stop_all(started)  # the lighthouse always, and any group still running, with their descendants
    return TorchftResult([p.returncode for p in groups] if failure else codes, plan.run_dir, logs,
                         time.monotonic() - begin, failure)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s [options] -- WORKER_FLAGS")
    parser.add_argument("--groups", type=int, default=2, help="replica groups F")
    parser.add_argument("--ranks-per-group", type=int, default=1, help="ranks G of each torchrun job")
    parser.add_argument("--prefix", action="append", metavar="CMD",
                        help="command prefix of one group, e.g. 'ip netns exec node1' (once per group)")
    parser.add_argument("--advertise-host", action="append", metavar="IP", help="address of one group (once per group)")
    parser.add_argument("--lighthouse", metavar="HOST:PORT", help="lighthouse address (default 127.0.0.1:free port)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before everything is killed")
    parser.add_argument("--print-only", action="store_true", help="print the commands, start nothing")
    args, rest = parser.parse_known_args(argv)
    worker_flags = rest[1:] if rest[:1] == ["--"] else rest
    prefixes = [shlex.split(p) for p in args.prefix] if args.prefix else None
    try:
        plan = torchft_commands(args.groups, args.ranks_per_group, worker_flags, prefixes=prefixes,
                                advertise_hosts=args.advertise_host, lighthouse_addr=args.lighthouse)
    except ValueError as e:
        parser.error(str(e))
    if args.print_only:
        for command in (plan.lighthouse, *plan.groups):
            print(" ".join(f"{k}={v}" for k, v in command.env.items()), shlex.join(command.argv))
        return 0
    result = run_torchft(plan, args.timeout)
    print(f"{'ok' if result.ok else 'FAILED: ' + result.failure}: exit codes {result.exit_codes} in "
          f"{result.seconds:.1f} s; run dir {result.run_dir}; logs {', '.join(map(str, result.logs.values()))}")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
