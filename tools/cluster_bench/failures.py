"""The failure comparison of the two-tier benchmark (`bench_cluster.py --failure-compare`).

One rank is SIGKILLed in the forward-backward of the same step (FL_MEGATRON_FAULT=
kill:forward-backward:STEP:RANK, RANK a federation rank = group * group size + rank in group) in
five setups on the emulated cluster, one federation group (replica group) per node, each beside
its own fault-free run (elastic-best: the elastic setup with int4 + error feedback, 2 fragments and
overlap 1; torchft-diloco: the torchft setup with DiLoCo's outer step):

  one-world  fl_megatron.pretrain as one job (FL+FSDP, --fl-group-size = ranks per node) saving a
             checkpoint at every sync (--save-interval H). The kill fails the job; it is relaunched
             at once (after --relaunch-delay) with --load and runs to the last step.
  elastic    --fl-elastic (tools/elastic_launch.py's commands): a lighthouse on node 0 and one
             torchrun job per group with --max-restarts 1, --fl-min-groups F - 1. The killed group
             restarts and heals from the live groups at a later sync; the others never stop.
  torchft    the torchft LocalSGD peer (tools/peers), lighthouse --min_replicas F - 1, torchrun
             --max-restarts 1: the restarted group heals at the live groups' next sync (torchft's
             checkpoint transport) and trains on from there (torchft_train.rejoin).

The fault-free runs are the same commands without the kill (the one-world run saves as often).

Wall time: from the first process's start until the last group has exited (the run's final
evaluation and summary included), measured here; for one-world the failed attempt (until the job
is noticed to have failed and is stopped), the relaunch delay and the relaunch together.

Goodput = tokens that survived / wall time. Tokens of a step count once if its result is part of
the final model:
  one-world  every step 1 ... N once: the steps redone after the reload (from the last checkpoint to
             the kill) are trained twice but counted once, and the killed attempt's work after the
             checkpoint counts nothing.
  elastic,   group-steps: N steps x F groups, less the killed group's steps from its last sync
  torchft    before the kill (whose local progress died with it) to the sync where it healed
             (it was down or waiting; it receives the live groups' state there). Tokens per
             group-step = tokens per step / F. For elastic this equals the groups' own
             `skipped_samples` x sequence length, which is checked.
So a run without failures counts N x tokens per step in every setup, and the ratio of goodputs
(faulted / fault-free) is the share of useful throughput the failure left.

Expectation checked for elastic: the killed group loses at most its steps since the last sync
plus one heal, i.e. the live groups never restart and train every step, the killed group heals
exactly once, and it heals at the first sync after it is back (its wait in the healing quorum,
`heal_s`, is at most one sync interval of the live groups, measured on their clock, plus the
transfer) - the lost group-steps are then (kill step - 1 - last sync) trained and lost plus the
steps it missed while restarting and waiting for that one heal.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from cluster_bench.bench_report import header_lines
from cluster_bench.cluster_jobs import run_job

SETUPS = ("one-world", "elastic", "elastic-best", "torchft", "torchft-diloco")
LABELS = {"one-world": "(a) one-world FL+FSDP fp32, --save every sync, relaunch --load",
          "elastic": "(b) elastic FL+FSDP fp32 (--fl-elastic), torchrun --max-restarts 1",
          "elastic-best": "(b') elastic FL+FSDP, int4 + EF, 2 fragments, overlap 1",
          "torchft": "(c) torchft LocalSGD, torchrun --max-restarts 1",
          "torchft-diloco": "(c') torchft DiLoCo, torchrun --max-restarts 1"}
# setups run fault-free only, and why: the row says so
NO_KILL = {"torchft-diloco": "not run under the kill: this harness's torchft peer heals a restarted group for "
                             "LocalSGD only (it does not hand over DiLoCo's outer state)"}
BEST_KEPT = 0.9         # elastic in its best mode keeps this share of its fault-free goodput under the kill
BEST_OVER_TORCHFT = 1.3  # ... and makes this many times torchft LocalSGD's goodput under the same kill
ELASTIC_OVER_ONE_WORLD = 0.97  # fault-free elastic fp32 against fault-free one-world fp32
JOIN_TIMEOUT_MS = 60000      # lighthouse: above the time a restart takes (docs/failures.md)
HEARTBEAT_TIMEOUT_MS = 2000  # lighthouse: a silent group counts as gone after this
HEAL_SLACK_S = 2.0           # the heal's transfer and scheduling noise on top of one interval


# ----- the plan and the counting (pure)
def last_sync_before(kill_step: int, sync_interval: int) -> int:
    """The last sync a rank killed in the forward-backward of `kill_step` completed: steps are
    1-based and step s syncs at its end when s is a multiple of H."""
    return (kill_step - 1) // sync_interval * sync_interval


def default_kill(ranks_per_node: int, sync_interval: int) -> tuple[int, int]:
    """(step, federation rank) killed by default: the middle of the second sync interval, rank 1
    of group 1 (rank 0 when a group has one rank)."""
    return sync_interval + max(1, sync_interval // 2), ranks_per_node + min(1, ranks_per_node - 1)


def plan_problems(nodes: int, ranks_per_node: int, steps: int, sync_interval: int, kill_step: int,
                  kill_rank: int) -> list[str]:
    """What makes a failure comparison impossible or meaningless, one sentence each."""
    h, problems = sync_interval, []
    if nodes < 2:
        problems.append("--failure-compare needs at least 2 nodes (groups): the others go on without the killed one")
    if steps % h:
        problems.append(f"--steps {steps} must be a multiple of --sync-interval {h} (every run ends with a sync)")
    if not h < kill_step <= steps - h:
        problems.append(f"--kill-step {kill_step} must lie in ({h}, {steps - h}]: after the first sync (so that "
                        f"there is a checkpoint and a sync to lose work since) and at least one sync before the end")
    if not 0 <= kill_rank < nodes * ranks_per_node:
        problems.append(f"--kill-rank {kill_rank} must be a rank of the {nodes * ranks_per_node} ranks")
    return problems


def fault_spec(kill_step: int, kill_rank: int) -> str:
    return f"kill:forward-backward:{kill_step}:{kill_rank}"


def one_world_count(steps: int, tokens_per_step: int, resumed_at: int | None, kill_step: int | None) -> dict:
    """Steps trained and tokens counted of a one-world run: each of steps 1 ... N counts once; the
    steps from the checkpoint it resumed at (`resumed_at`) to before the killed step were trained
    twice (`redone`), the killed step itself was cut short."""
    redone = 0 if resumed_at is None or kill_step is None else max(kill_step - 1 - resumed_at, 0)
    return {"tokens": steps * tokens_per_step, "group_steps_lost": 0, "steps_redone": redone,
            "steps_trained": steps + redone}


def federated_count(steps: int, num_groups: int, tokens_per_step: int, outages: dict) -> dict:
    """Tokens counted of an elastic or torchft run: N x F group-steps less each restarted group's
    lost ones. outages: {group: (last sync before it died, sync step it healed at, or None if
    it never came back)}."""
    lost = {g: (steps if healed is None else healed) - last for g, (last, healed) in outages.items()}
    if any(v < 0 for v in lost.values()):
        raise ValueError(f"a group healed before its last sync: {outages}")
    per_group_step = tokens_per_step // num_groups
    group_steps = steps * num_groups - sum(lost.values())
    return {"tokens": group_steps * per_group_step, "group_steps_lost": sum(lost.values()),
            "lost_by_group": lost, "steps_redone": 0, "group_steps_trained": group_steps}


def goodput(tokens: int, wall_s: float) -> float:
    return tokens / wall_s if wall_s > 0 else 0.0


def heal_expectation(kill_step: int, sync_interval: int, healed_at: int | None, heal_s: float | None,
                     interval_s: float | None, live_groups_whole: bool, heals: int,
                     slack_s: float = HEAL_SLACK_S, last_sync: int | None = None) -> tuple[bool, str]:
    """Whether an elastic run lost at most the killed group's steps since its last sync plus one
    heal (see the module's docstring), and a sentence saying so. `last_sync`: the last sync the
    killed group took part in, where the records show it (with fragments a sync of one fragment
    may come between the full ones); else the last multiple of H before the kill."""
    last = last_sync_before(kill_step, sync_interval) if last_sync is None else last_sync
    if healed_at is None:
        return False, f"the killed group never healed: it lost every step from its last sync (step {last}) on"
    since, waiting = kill_step - 1 - last, healed_at - (kill_step - 1)
    one_heal = heal_s is not None and interval_s is not None and heal_s <= interval_s + slack_s
    ok = one_heal and live_groups_whole and heals == 1
    text = (f"the killed group lost {healed_at - last} group-steps = {since} trained since its last sync "
            f"(step {last}) + {waiting} while it restarted and waited for its heal at step {healed_at}; "
            f"its heal took {_s(heal_s)} (one sync interval of the live groups: {_s(interval_s)}, "
            f"+{slack_s:g} s slack), {heals} heal(s), the live groups "
            + ("trained every step without a restart" if live_groups_whole else "did NOT train every step unbroken"))
    return ok, text


def _s(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f} s"


def table_rows(results: list[dict]) -> list[dict]:
    """One row per run with goodput and wall time beside the same setup's fault-free run."""
    free = {r["setup"]: r for r in results if not r["faulted"]}
    rows = []
    for r in results:
        base = free.get(r["setup"])
        rows.append({
            "setup": r["setup"], "label": LABELS[r["setup"]], "run": "kill" if r["faulted"] else "fault-free",
            "wall_s": r["wall_s"], "tokens": r["tokens"], "goodput": r["goodput"],
            "goodput_ratio": r["goodput"] / base["goodput"] if base and base["goodput"] else None,
            "wall_ratio": r["wall_s"] / base["wall_s"] if base and base["wall_s"] else None,
            "group_steps_lost": r.get("group_steps_lost", 0), "steps_redone": r.get("steps_redone", 0),
            "eval_loss": r.get("eval_loss"), "note": r.get("note", "")})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| setup | run | wall s | x wall | tokens counted | goodput tok/s | x goodput | steps redone "
             "| group-steps lost | eval loss | what happened |", "|" + " --- |" * 11]
    for r in rows:
        ratio = lambda v: f"{v:.2f}" if v is not None else "-"  # noqa: E731
        loss = f"{r['eval_loss']:.4f}" if r["eval_loss"] is not None else "-"
        lines.append(f"| {r['label']} | {r['run']} | {r['wall_s']:.1f} | {ratio(r['wall_ratio'])} | {r['tokens']:,} | "
                     f"{r['goodput']:,.0f} | {ratio(r['goodput_ratio'])} | {r['steps_redone']} | "
                     f"{r['group_steps_lost']} | {loss} | {r['note']} |")
    return "\n".join(lines) + "\n"


def write_outputs(out: Path, setup: dict, results: list[dict], checks: list[dict]) -> tuple[Path, Path, str]:
    """bench.json (everything) and bench.md (setup, table, checks) in `out`."""
    rows = table_rows(results)
    table = markdown(rows)
    json_path, md_path = out / "bench.json", out / "bench.md"
    json_path.write_text(json.dumps({"setup": setup, "table": rows, "checks": checks, "results": results},
                                    indent=2) + "\n")
    lines = [*header_lines("Failure comparison", setup),
             f"{setup['steps']} steps, H = {setup['sync_interval']}; federation rank {setup['kill_rank']} "
             f"(group {setup['kill_group']}) SIGKILLed in the forward-backward of step {setup['kill_step']} "
             f"(its last sync: step {setup['last_sync_before_kill']}); goodput = tokens of surviving steps / wall "
             "time (tools/cluster_bench/failures.py)", "", table, ""]
    lines += [f"- {'OK' if c['ok'] else 'NOT MET'}: {c['setup']}: {c['text']}" for c in checks]
    ran = {r["setup"] for r in results}
    lines += [f"- {LABELS[setup]}: {why}" for setup, why in NO_KILL.items() if setup in ran]
    md_path.write_text("\n".join(lines) + "\n")
    return json_path, md_path, table


# ----- commands
def one_world_flags(base: list[str], ckpt: Path, sync_interval: int, load: bool) -> list[str]:
    """pretrain flags of the one-world setup: a checkpoint after every sync, --load on the relaunch."""
    return [*base, "--save", str(ckpt), "--save-interval", str(sync_interval), *(["--load", str(ckpt)] if load else [])]


def elastic_plan(cluster, num_groups: int, ranks_per_group: int, flags: list[str], python: str = sys.executable):
    """(lighthouse command, group commands) of the elastic setup: elastic_launch's, the lighthouse
    on node 0 at its address, group g on node g."""
    from elastic_launch import elastic_commands
    lighthouse = f"{cluster.node_ip(0)}:{cluster.pick_port()}"
    commands = elastic_commands(num_groups, ranks_per_group, num_groups - 1, flags, lighthouse=lighthouse,
                                max_restarts=1, join_timeout_ms=JOIN_TIMEOUT_MS,
                                heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS, python=python)
    return commands[0], commands[1:], lighthouse


def torchft_plan(cluster, num_groups: int, ranks_per_group: int, flags: list[str]):
    """The torchft setup's plan: min replicas F - 1, torchrun --max-restarts 1, the lighthouse's
    timeouts as in the elastic setup."""
    from peers.torchft_launch import torchft_commands
    netns = cluster.mode == "netns"
    plan = torchft_commands(
        num_groups, ranks_per_group, flags,
        prefixes=[cluster.node_prefix(k) for k in range(num_groups)] if netns else None,
        advertise_hosts=[cluster.node_ip(k) for k in range(num_groups)],
        lighthouse_addr=f"{cluster.node_ip(0)}:{cluster.pick_port()}",
        lighthouse_prefix=cluster.node_prefix(0) if netns else (),
        min_replicas=num_groups - 1, max_restarts=1, join_timeout_ms=JOIN_TIMEOUT_MS,
        heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
    for command in plan.groups:
        if netns:
            command.env["GLOO_SOCKET_IFNAME"] = "eth0"
    return plan


# ----- running
def _fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def _json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()] if path.exists() else []


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def run_one_world(cluster, ranks_per_node: int, flags: list[str], run_dir: Path, sync_interval: int, timeout: float,
                  fault: str | None, relaunch_delay: float = 0.0) -> dict:
    """The one-world setup once: a job saving every sync; with a fault, the failed job, then the
    relaunch from its last checkpoint. Returns the wall time and what the last job's summary says."""
    run_dir, ckpt = _fresh(run_dir), run_dir / "checkpoints"
    env = {k: v for k, v in os.environ.items() if k != "FL_MEGATRON_FAULT"}

    def job(load: bool) -> list[str]:
        return ["-m", "fl_megatron.pretrain", *one_world_flags([*flags, "--run-dir", str(run_dir)], ckpt,
                                                               sync_interval, load)]

    start = time.perf_counter()
    attempts = []
    first = run_job(cluster, ranks_per_node, job(False), timeout,
                    env={**env, "FL_MEGATRON_FAULT": fault} if fault else env,
                    log_dir=str(run_dir / "logs" / "attempt1"))
    attempts.append(time.perf_counter() - start)
    if first.timed_out:
        raise RuntimeError(f"one-world: the first attempt timed out; logs in {run_dir / 'logs'}")
    if fault and first.ok:
        raise RuntimeError(f"one-world: the job with {fault} finished instead of failing; logs in {run_dir / 'logs'}")
    if not fault and not first.ok:
        raise RuntimeError(f"one-world failed (exit codes {first.returncodes}):\n{first.stderr_tails[0][-3000:]}")
    resumed_at = None
    if fault:
        latest = ckpt / "latest_checkpointed_iteration.txt"
        resumed_at = int(latest.read_text().strip()) if latest.exists() else None
        if resumed_at is None:
            raise RuntimeError(f"one-world: the failed job left no checkpoint under {ckpt}")
        time.sleep(relaunch_delay)
        again = time.perf_counter()
        second = run_job(cluster, ranks_per_node, job(True), timeout, env=env,
                         log_dir=str(run_dir / "logs" / "relaunch"))
        attempts.append(time.perf_counter() - again)
        if not second.ok:
            raise RuntimeError(f"one-world relaunch failed (exit codes {second.returncodes}, timed out: "
                               f"{second.timed_out}):\n{second.stderr_tails[0][-3000:]}")
    wall = time.perf_counter() - start
    summary = _json(run_dir / "summary.json")
    return {"wall_s": wall, "attempts_s": attempts, "failed_exit_codes": first.returncodes if fault else None,
            "resumed_at": resumed_at, "summary": summary, "run_dir": str(run_dir)}


def _wait_listening(cluster, host: str, port: int, proc, timeout: float = 30.0) -> None:
    """Wait until something listens at host:port as seen from node 0 (a probe started there)."""
    probe = ("import socket,sys,time\nend=time.time()+%r\nwhile time.time()<end:\n"
             " try:\n  socket.create_connection((%r,%d),timeout=0.5).close(); sys.exit(0)\n"
             " except OSError: time.sleep(0.1)\nsys.exit(1)\n") % (timeout, host, port)
    checker = cluster.popen(0, [sys.executable, "-c", probe], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if checker.wait(timeout + 10) != 0 or proc.poll() is not None:
        raise RuntimeError(f"the lighthouse did not listen on {host}:{port} (exit code {proc.poll()})")


def run_elastic(cluster, ranks_per_node: int, flags: list[str], run_dir: Path, timeout: float,
                fault: str | None) -> dict:
    """The elastic setup once: lighthouse on node 0, group g's torchrun on node g."""
    from peers.torchft_launch import StrandedWatch
    run_dir = _fresh(run_dir)
    logs = run_dir / "launch"
    logs.mkdir()
    lighthouse_cmd, group_cmds, address = elastic_plan(cluster, cluster.nodes, ranks_per_node,
                                                       [*flags, "--run-dir", str(run_dir)])
    env = {k: v for k, v in os.environ.items() if k != "FL_MEGATRON_FAULT"}
    started, groups, stranded = [], [], StrandedWatch(cluster.nodes - 1)
    start = time.perf_counter()
    try:
        with open(logs / "lighthouse.log", "wb") as out:
            lighthouse = cluster.popen(0, lighthouse_cmd.argv, env={**env, **lighthouse_cmd.env}, stdout=out,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        started.append(lighthouse)
        host, port = address.rsplit(":", 1)
        _wait_listening(cluster, host, int(port), lighthouse)
        for g, command in enumerate(group_cmds):
            group_env = {**env, **command.env, **({"FL_MEGATRON_FAULT": fault} if fault else {})}
            with open(logs / f"{command.name}.log", "wb") as out:
                groups.append(cluster.popen(g, command.argv, env=group_env, stdout=out, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL))
            started.append(groups[-1])
        while any(p.poll() is None for p in groups):
            if time.perf_counter() - start > timeout:
                raise RuntimeError(f"elastic: timed out after {timeout:.0f} s; logs in {logs}")
            if lighthouse.poll() is not None:
                raise RuntimeError(f"elastic: the lighthouse exited ({lighthouse.returncode}); logs in {logs}")
            if why := stranded.check([p.poll() for p in groups], time.perf_counter()):
                raise RuntimeError(f"elastic: {why}; logs in {logs}")
            time.sleep(0.1)
        wall = time.perf_counter() - start
    finally:
        cluster.stop(started)
    codes = [p.returncode for p in groups]
    if any(codes):
        raise RuntimeError(f"elastic: group exit codes {codes}; logs in {logs}\n"
                           + _tail(logs / f"group_{codes.index(next(c for c in codes if c))}.log"))
    groups_dirs = [run_dir / f"group_{g:05d}" for g in range(cluster.nodes)]
    return {"wall_s": wall, "exit_codes": codes, "run_dir": str(run_dir),
            "summaries": [_json(d / "summary.json") for d in groups_dirs],
            "syncs": [[r for r in _jsonl(d / "metrics.jsonl") if "groups" in r] for d in groups_dirs],
            "config": _json(groups_dirs[0] / "config.json")}


def run_torchft_setup(cluster, ranks_per_node: int, flags: list[str], run_dir: Path, timeout: float,
                      fault: str | None) -> dict:
    """The torchft setup once (tools/peers/torchft_launch.run_torchft on the cluster's nodes)."""
    from peers.torchft_launch import run_torchft
    run_dir = _fresh(run_dir)
    plan = torchft_plan(cluster, cluster.nodes, ranks_per_node, [*flags, "--run-dir", str(run_dir)])
    saved = os.environ.pop("FL_MEGATRON_FAULT", None)
    for command in plan.groups:
        if fault:
            command.env["FL_MEGATRON_FAULT"] = fault
    try:
        result = run_torchft(plan, timeout=timeout, log_dir=run_dir / "launch")
    finally:
        if saved is not None:
            os.environ["FL_MEGATRON_FAULT"] = saved
    if not result.ok:
        logs = "\n".join(f"{name}: {path}" for name, path in result.logs.items())
        raise RuntimeError(f"torchft failed: {result.failure}\nlogs:\n{logs}")
    records = [_json(run_dir / "groups" / f"torchft_group_{g:05d}.json") for g in range(cluster.nodes)]
    return {"wall_s": result.seconds, "exit_codes": result.exit_codes, "run_dir": str(run_dir),
            "summary": _json(run_dir / "summary.json"), "groups": records}


# ----- reading a run back into the table's terms
def tokens_per_step_of(summary: dict) -> int:
    """Tokens of one step of the whole federation, from a summary (tokens over its steps)."""
    return summary["tokens"] // (summary["last_step"] - summary["first_step"] + 1)


def one_world_result(run: dict, steps: int, kill_step: int | None) -> dict:
    s = run["summary"]
    tps = tokens_per_step_of(s)
    count = one_world_count(steps, tps, run["resumed_at"], kill_step)
    note = "" if kill_step is None else (
        f"job failed (exit codes {run['failed_exit_codes']}) after {run['attempts_s'][0]:.1f} s; relaunched from "
        f"the checkpoint of step {run['resumed_at']}, {run['attempts_s'][1]:.1f} s")
    return {**count, "wall_s": run["wall_s"], "goodput": goodput(count["tokens"], run["wall_s"]),
            "eval_loss": s.get("eval_loss"), "tokens_per_step": tps, "note": note}


def elastic_result(run: dict, steps: int, sync_interval: int, kill_step: int | None) -> tuple[dict, dict | None]:
    """(the row's result, the expectation check or None) of an elastic run."""
    summaries, syncs = run["summaries"], run["syncs"]
    # each group's summary counts the tokens of the steps it trained itself, one group's share of each step
    tps = tokens_per_step_of(summaries[0])
    restarted = {g: s["elastic"]["healed_at_step"] for g, s in enumerate(summaries)
                 if s["elastic"].get("healed_at_step") is not None}
    live = [g for g in range(len(summaries)) if g not in restarted]
    outages = {}
    for g, healed in restarted.items():
        seen = [r["step"] for r in syncs[live[0]] if g in r["groups"] and r["step"] < healed] if live else []
        outages[g] = (max(seen, default=0), healed)
    count = federated_count(steps, len(summaries), tps, outages)
    losses = [s["eval_loss"] for s in summaries if s.get("eval_loss") is not None]
    skipped = summaries[live[0]]["elastic"]["skipped_samples"] if live else None
    seq = run["config"]["training"]["seq_length"]
    result = {**count, "wall_s": run["wall_s"], "goodput": goodput(count["tokens"], run["wall_s"]),
              "eval_loss": sum(losses) / len(losses) if losses else None, "tokens_per_step": tps,
              "skipped_tokens": None if skipped is None else skipped * seq,
              "note": "; ".join(f"group {g} restarted, last sync before the kill: step {last}, healed at step {healed}"
                                for g, (last, healed) in outages.items())}
    if skipped is not None and skipped * seq != sum(count["lost_by_group"].values()) * (tps // len(summaries)):
        result["note"] += f"; NOTE skipped_samples x seq ({skipped * seq}) differs from the lost tokens counted here"
    if kill_step is None:
        return result, None
    kill_group = next(iter(restarted), None)
    healed_at = restarted.get(kill_group) if kill_group is not None else None
    heal_s = interval_s = None
    if kill_group is not None:
        own = [r for r in syncs[kill_group] if r["step"] == healed_at and "heal_s" in r]
        heal_s = own[0]["heal_s"] if own else None
        times = {r["step"]: r["elapsed_s"] for r in syncs[live[0]] if "elapsed_s" in r} if live else {}
        # one sync interval of the live groups before the heal (an overlapped sync is recorded at its
        # landing: the last record at least H steps before the heal)
        before = [step for step in times if step <= healed_at - sync_interval]
        if healed_at in times and before:
            interval_s = times[healed_at] - times[max(before)]
    whole = all(summaries[g]["first_step"] == 1 and summaries[g]["last_step"] == steps for g in live)
    heals = summaries[live[0]]["elastic"].get("healed", 0) if live else 0
    ok, text = heal_expectation(kill_step, sync_interval, healed_at, heal_s, interval_s, whole, heals,
                                last_sync=outages[kill_group][0] if kill_group is not None else None)
    return result, {"setup": "elastic", "ok": ok, "text": text, "healed_at": healed_at, "heal_s": heal_s,
                    "interval_s": interval_s}


def torchft_result(run: dict, steps: int, sync_interval: int, kill_step: int | None) -> dict:
    s, groups = run["summary"], run["groups"]
    tps = s["tokens"] // (s["last_step"] - s["first_step"] + 1)
    outages = {r["group"]: (last_sync_before(kill_step, sync_interval) if kill_step else 0, r["healed_at_step"])
               for r in groups if r["restarts"]}
    count = federated_count(steps, len(groups), tps, outages)
    note = "; ".join(f"group {r['group']} restarted, healed at step {r['healed_at_step']} "
                     f"(waited and healed {r['heal_s']:.2f} s)" for r in groups if r["restarts"])
    return {**count, "wall_s": run["wall_s"], "goodput": goodput(count["tokens"], run["wall_s"]),
            "eval_loss": s.get("eval_loss"), "tokens_per_step": tps, "note": note}


# ----- the whole comparison
@dataclass(frozen=True)
class Comparison:
    """What every setup trains (flags without --run-dir) and where the kill lands."""

    steps: int
    sync_interval: int
    kill_step: int
    kill_rank: int
    ranks_per_node: int
    fl_flags: tuple          # pretrain flags of the one-world and elastic setups
    peer_flags: tuple        # torchft peer flags
    timeout: float = 1200.0
    relaunch_delay: float = 0.0
    best_flags: tuple = ()   # the elastic setup in its best mode: fl_flags and these
    diloco_flags: tuple = ()  # torchft DiLoCo: peer_flags and these
    setups: tuple = SETUPS

    @property
    def fault(self) -> str:
        return fault_spec(self.kill_step, self.kill_rank)


def warm_up(cluster, c: Comparison, out: Path) -> float:
    """One short one-world job of the same flags (--exit-interval 1, which saves a checkpoint first):
    it builds the data caches that every setup then reads, so that no measured run pays for them."""
    start = time.perf_counter()
    run_dir = _fresh(out / "warm-up")
    result = run_job(cluster, c.ranks_per_node, ["-m", "fl_megatron.pretrain", *c.fl_flags, "--exit-interval", "1",
                                                 "--save", str(run_dir / "checkpoints"), "--run-dir", str(run_dir)],
                     c.timeout,
                     env={k: v for k, v in os.environ.items() if k != "FL_MEGATRON_FAULT"},
                     log_dir=str(run_dir / "logs"))
    if not result.ok:
        raise RuntimeError(f"warm-up failed (exit codes {result.returncodes}):\n{result.stderr_tails[0][-3000:]}")
    return time.perf_counter() - start


def torchft_check(run: dict, c: Comparison) -> dict:
    """The torchft setup measured against the same expectation as the elastic one."""
    groups = run["groups"]
    restarted = [r for r in groups if r["restarts"]]
    healed_at = restarted[0]["healed_at_step"] if restarted else None
    records = {r["step"]: r["elapsed_s"] for r in _jsonl(Path(run["run_dir"]) / "metrics.jsonl") if "elapsed_s" in r}
    interval_s = (records[healed_at] - records[healed_at - c.sync_interval]
                  if healed_at is not None and {healed_at, healed_at - c.sync_interval} <= records.keys() else None)
    whole = all(r["first_step"] == 1 and r["last_step"] == c.steps for r in groups if not r["restarts"])
    ok, text = heal_expectation(c.kill_step, c.sync_interval, healed_at,
                                restarted[0]["heal_s"] if restarted else None, interval_s, whole, len(restarted))
    return {"setup": "torchft", "ok": ok, "text": text, "healed_at": healed_at, "interval_s": interval_s}


def one_world_check(run: dict, c: Comparison) -> dict:
    want = last_sync_before(c.kill_step, c.sync_interval)
    ok = run["resumed_at"] == want and run["summary"]["last_step"] == c.steps
    text = (f"the job failed in step {c.kill_step} and was relaunched from the checkpoint of step {run['resumed_at']} "
            f"(the last sync before the kill: {want}); it redid {c.kill_step - 1 - run['resumed_at']} step(s) "
            f"and ended at step {run['summary']['last_step']}")
    return {"setup": "one-world", "ok": ok, "text": text}


def ratio_checks(results: list[dict]) -> list[dict]:
    """The goodput ratios the issue of elastic mode asks for, where both runs were made."""
    got = {(r["setup"], r["faulted"]): r["goodput"] for r in results}
    checks = []

    def check(setup: str, num: tuple, den: tuple, bound: float, what: str) -> None:
        if num in got and den in got and got[den] > 0:
            value = got[num] / got[den]
            checks.append({"setup": setup, "ok": value >= bound, "ratio": value, "bound": bound,
                           "text": f"{what}: {value:.3f} (goal >= {bound:g})"})

    check("elastic-best", ("elastic-best", True), ("elastic-best", False), BEST_KEPT,
          "elastic in its best mode keeps this share of its fault-free goodput under the kill")
    check("elastic-best", ("elastic-best", True), ("torchft", True), BEST_OVER_TORCHFT,
          "elastic in its best mode under the kill, against torchft LocalSGD under the same kill")
    check("elastic-fp32", ("elastic", False), ("one-world", False), ELASTIC_OVER_ONE_WORLD,
          "fault-free elastic fp32 against fault-free one-world fp32")
    return checks


def compare(cluster, c: Comparison, out: Path, say=print) -> tuple[list[dict], list[dict]]:
    """Every setup fault-free, then with the kill; returns (results, checks)."""
    say(f"  warm-up (data caches): {warm_up(cluster, c, out):.1f} s")
    results, checks = [], []
    for setup in c.setups:
        if setup in NO_KILL:
            say(f"  {LABELS[setup]}: {NO_KILL[setup]}")
        for faulted in (False,) if setup in NO_KILL else (False, True):
            fault = c.fault if faulted else None
            run_dir = out / setup / ("kill" if faulted else "fault-free")
            kill = c.kill_step if faulted else None
            if setup == "one-world":
                run = run_one_world(cluster, c.ranks_per_node, list(c.fl_flags), run_dir, c.sync_interval, c.timeout,
                                    fault, c.relaunch_delay)
                result, check = one_world_result(run, c.steps, kill), one_world_check(run, c) if faulted else None
            elif setup in ("elastic", "elastic-best"):
                flags = [*c.fl_flags, *(c.best_flags if setup == "elastic-best" else ())]
                run = run_elastic(cluster, c.ranks_per_node, flags, run_dir, c.timeout, fault)
                result, check = elastic_result(run, c.steps, c.sync_interval, kill)
                if check is not None:
                    check["setup"] = setup
            else:
                flags = [*c.peer_flags, *(c.diloco_flags if setup == "torchft-diloco" else ())]
                run = run_torchft_setup(cluster, c.ranks_per_node, flags, run_dir, c.timeout, fault)
                result, check = torchft_result(run, c.steps, c.sync_interval, kill), \
                    torchft_check(run, c) if faulted else None
                if check is not None:
                    check["setup"] = setup
            results.append({"setup": setup, "faulted": faulted, "run_dir": str(run_dir), **result})
            if check:
                checks.append(check)
            say(f"  {LABELS[setup]}, {'kill' if faulted else 'fault-free'}: {result['wall_s']:.1f} s, "
                f"{result['tokens']:,} tokens counted, goodput {result['goodput']:,.0f} tok/s"
                + (f" ({result['note']})" if result.get("note") else ""))
    return results, checks + ratio_checks(results)
