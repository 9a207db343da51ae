#!/usr/bin/env python3
"""The speed-up on an emulated two-tier cluster, measured beside the cost model and torchft.

Nodes are network namespaces (loopback inside a node), links between nodes are shaped with tbf
(needs root; without it everything runs unshaped on loopback, with a note). Every row trains the
same model, data, seed and steps; the table shows tokens/s over the same span of steps, the ratio
to FSDP, inter-node bytes from the links' counters beside the cost model's prediction, predicted
and measured time per step, final eval loss and peak memory per rank. Writes bench.json, bench.md
and PNG plots to --out.

  python tools/bench_cluster.py --nodes 2 --ranks-per-node 2 --rate-mbit 100         # 2x2 + peers
  python tools/bench_cluster.py --nodes 4 --ranks-per-node 2 --rate-mbit 100 \\
      --rows fsdp hsdp fl-fsdp fl-hsdp-naive fl-hsdp-split                          # HSDP layouts

--failure-compare replaces the rows by a failure comparison: one federation group per node, one
rank SIGKILLed in the forward-backward of --kill-step (default: the middle of the second sync
interval; --kill-rank, a federation rank, default rank 1 of group 1) in (a) one-world FL+FSDP saving
a checkpoint every sync, relaunched with --load after the job failed, (b) elastic FL+FSDP fp32
(--fl-elastic, torchrun --max-restarts 1 per group, the killed group heals from the live ones),
(b') elastic FL+FSDP in its best mode (int4 + error feedback, 2 fragments, overlap 1), (c) torchft
LocalSGD and (c') torchft DiLoCo (torchrun --max-restarts 1, the restarted group heals at the next
sync), each beside its fault-free run: wall time to the last step and goodput (tokens of the steps
that survived per second of the whole run: (a) counts every step once, redone steps included once;
the others leave out the killed group's steps from its last sync to its heal), with the ratio to
the fault-free run; checks that (b) lost at most the killed group's steps since its last sync plus
one heal, that (b') keeps >= 0.9 of its fault-free goodput and makes >= 1.3x (c)'s under the kill,
and that fault-free (b) makes >= 0.97x fault-free (a) (exit code 3 when an elastic check is not
met). --rows names the setups to run (keys one-world, elastic, elastic-best, torchft,
torchft-diloco; default all). tools/cluster_bench/failures.py explains the counting.
Writes bench.json and bench.md to --out (default runs/bench-cluster-failures):

  python tools/bench_cluster.py --failure-compare --nodes 3 --ranks-per-node 2 --steps 24 \\
      --sync-interval 4 --kill-step 6
  python tools/bench_cluster.py --failure-compare --nodes 3 --ranks-per-node 2 --steps 96 \\
      --sync-interval 4 --kill-step 6 --rows one-world elastic elastic-best torchft   # docs/benchmarks.md
"""

import argparse
import os
import shlex
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
REPO = TOOLS.parent
sys.path[:0] = [str(TOOLS), str(REPO)]

from cluster_bench import failures  # noqa: E402
from cluster_bench.bench_report import write_outputs  # noqa: E402
from cluster_bench.failures import default_kill, plan_problems  # noqa: E402
from cluster_bench.netns_cluster import EmulatedCluster, run_job  # noqa: E402
from cluster_bench.prediction import as_tuned, predict_row  # noqa: E402
from cluster_bench.rows import Row, all_rows, select_rows  # noqa: E402
from cluster_bench.run_outputs import compute_seconds, measured  # noqa: E402
from peers.torchft_launch import run_torchft, torchft_commands  # noqa: E402

CALIBRATION_STEPS = 10


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--rate-mbit", type=float, default=100.0, help="link rate between nodes (0: unshaped)")
    p.add_argument("--sync-interval", type=int, default=8, help="H of the federated rows")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--warmup", type=int, help="steps left out of the timed span of every row (default: H, "
                                              "so that first-step set-up and the first sync are outside it)")
    p.add_argument("--repeats", type=int, default=1, help="run the rows this many times, interleaved; the "
                                                          "table shows the median repeat and the range")
    p.add_argument("--rows", nargs="+", help="row keys (default: every row the cluster shape allows); with "
                   "--failure-compare the setups to run (default: one-world elastic elastic-best torchft "
                   "torchft-diloco)")
    p.add_argument("--out", help="output folder (default runs/bench-cluster, with --failure-compare "
                                 "runs/bench-cluster-failures)")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per row")
    p.add_argument("--mode", choices=["auto", "netns", "loopback"], default="auto")
    p.add_argument("--config", default=str(REPO / "examples" / "demo.json"), help="model and training config")
    p.add_argument("--jitter-ms", type=float, default=0.0,
                   help="every group of an fl-megatron row stalls before every step for a random time of this "
                        "mean (exponential, seeded: FL_MEGATRON_FAULT=jitter), as slow nodes and pauses do")
    p.add_argument("--jitter-seed", type=int, default=1)
    p.add_argument("--failure-compare", action="store_true",
                   help="instead of the rows: kill a rank in one-world FL, elastic FL and torchft LocalSGD, each "
                        "beside its fault-free run (wall time, goodput; see the docstring)")
    p.add_argument("--kill-step", type=int, help="--failure-compare: the step whose forward-backward the kill lands "
                                                 "in (default H + H/2)")
    p.add_argument("--kill-rank", type=int, help="--failure-compare: federation rank killed (group * ranks per node "
                                                 "+ rank; default rank 1 of group 1)")
    p.add_argument("--relaunch-delay", type=float, default=0.0,
                   help="--failure-compare: seconds between the one-world job's failure and its relaunch (a "
                        "scheduler's requeue), counted in its wall time")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="-- then pretrain flags for every row")
    args = p.parse_args(argv)
    args.warmup = args.sync_interval if args.warmup is None else args.warmup
    problems = [f"--{k.replace('_', '-')} must be at least {low}" for k, low in
                (("nodes", 1), ("ranks_per_node", 1), ("steps", 2), ("sync_interval", 1), ("repeats", 1),
                 ("jitter_ms", 0)) if getattr(args, k) < low]
    if not 0 <= args.warmup < args.steps or args.warmup % args.sync_interval:
        problems.append(f"--warmup {args.warmup} must be a multiple of H={args.sync_interval} (rows log every H "
                        f"steps) below --steps {args.steps}")
    if args.failure_compare:
        default_step, default_rank = default_kill(args.ranks_per_node, args.sync_interval)
        args.kill_step = default_step if args.kill_step is None else args.kill_step
        args.kill_rank = default_rank if args.kill_rank is None else args.kill_rank
        problems += plan_problems(args.nodes, args.ranks_per_node, args.steps, args.sync_interval, args.kill_step,
                                  args.kill_rank)
        problems += [f"{flag} is not used with --failure-compare" for flag, used in
                     (("--repeats", args.repeats > 1), ("--jitter-ms", args.jitter_ms),
                      ("--warmup", args.warmup != args.sync_interval)) if used]
        if args.relaunch_delay < 0:
            problems.append("--relaunch-delay must be at least 0")
        problems += [f"--rows {key}: not a setup of --failure-compare (setups: {', '.join(failures.SETUPS)})"
                     for key in args.rows or () if key not in failures.SETUPS]
    elif any(v is not None for v in (args.kill_step, args.kill_rank)) or args.relaunch_delay:
        problems.append("--kill-step, --kill-rank and --relaunch-delay go with --failure-compare")
    if problems:
        p.error("; ".join(problems))
    args.out = args.out or ("runs/bench-cluster-failures" if args.failure_compare else "runs/bench-cluster")
    return args


def common_flags(args, steps: int | None = None) -> list[str]:
    """Flags of every row. Rows log every H steps unless the extra flags say otherwise (a logged
    step reduces its loss inside each group only; the torchft peer reduces nothing in its loop)."""
    return ["--config", args.config, "--train-iters", str(steps or args.steps), "--lr-warmup-iters", "2",
            "--eval-interval", "0", "--eval-iters", "2", "--log-interval", str(args.sync_interval),
            *[a for a in args.extra if a != "--"]]


def run_row(cluster, args, row: Row, run_dir: Path, steps: int, jitter_ms: float | None = None) -> list | None:
    """Train one row in the cluster (with --jitter-ms unless `jitter_ms` is given); returns the
    per-node counter deltas (None on loopback)."""
    jitter_ms = args.jitter_ms if jitter_ms is None else jitter_ms
    flags = [*common_flags(args, steps), *row.flags(), "--ranks-per-node", str(args.ranks_per_node),
             "--run-dir", str(run_dir)]
    if not row.is_peer and "--fl-tune" not in row.extra:
        flags.append("--no-fl-link-probe")  # its few MB would be in the counters, beside no prediction
    if not row.is_peer:
        faults = [f for f in (row.fault, f"jitter:{jitter_ms / 1000:g}:{args.jitter_seed}" if jitter_ms
                              else "") if f]
        env = dict(os.environ, FL_MEGATRON_FAULT=",".join(faults)) if faults else None
        result = run_job(cluster, args.ranks_per_node, ["-m", "fl_megatron.pretrain", *flags], args.timeout,
                         env=env, log_dir=str(run_dir / "logs"))
        if not result.ok:
            raise RuntimeError(f"{row.label} failed (exit codes {result.returncodes}, timed out: {result.timed_out})"
                               f"\n{result.stdout_tails[0][-1500:]}\n{result.stderr_tails[0][-3000:]}")
        return result.counters
    netns = cluster.mode == "netns"
    plan = torchft_commands(
        args.nodes, args.ranks_per_node, flags,
        prefixes=[["ip", "netns", "exec", cluster.node_ns(k)] for k in range(args.nodes)] if netns else None,
        advertise_hosts=[cluster.node_ip(k) for k in range(args.nodes)],
        lighthouse_addr=f"{cluster.node_ip(0)}:{cluster.pick_port()}",
        lighthouse_prefix=["ip", "netns", "exec", cluster.node_ns(0)] if netns else ())
    for command in plan.groups:
        if netns:
            command.env["GLOO_SOCKET_IFNAME"] = "eth0"
    before = cluster.counters()
    result = run_torchft(plan, timeout=args.timeout, log_dir=run_dir / "logs")
    after = cluster.counters()
    if not result.ok:
        logs = "\n".join(f"{name}: {path}" for name, path in result.logs.items())
        raise RuntimeError(f"{row.label} failed: {result.failure}\nlogs:\n{logs}")
    return None if before is None else [a - b for a, b in zip(after, before)]


def calibrate(cluster, args, backend: str, out: Path) -> float:
    """Median step time of groups of one node that never average: compute plus on-node collectives."""
    row = Row(f"calibrate-{backend}", "calibration", args.ranks_per_node, backend=backend,
              extra=("--log-interval", "1"))  # every step's time, whatever the rows log
    run_dir = out / row.key
    run_row(cluster, args, row, run_dir, CALIBRATION_STEPS, jitter_ms=0.0)  # compute alone: jitter is predicted apart
    return compute_seconds(run_dir, warmup=2)


def main(argv=None) -> int:
    try:
        return _main(argv)
    except RuntimeError as e:  # a row failed: its logs are named; the cluster is already torn down
        print(f"error: {e}", file=sys.stderr)
        return 1


def _main(argv=None) -> int:
    args = parse(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("FL_MEGATRON_CACHE", str(out / "cache"))
    os.environ["OMP_NUM_THREADS"] = "1"
    if args.failure_compare:
        return _failure_compare(args, argv, out)
    try:
        rows = select_rows(all_rows(args.nodes, args.ranks_per_node, args.sync_interval), args.rows)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rate = args.rate_mbit or None
    for row in rows:  # every row's configuration is valid before anything starts
        try:
            predict_row(row, common_flags(args), args.nodes, args.ranks_per_node, rate, 0.0, args.steps, args.warmup)
        except ValueError as e:
            print(f"error: row {row.key}: {e}", file=sys.stderr)
            return 2
    compute = {}
    with EmulatedCluster(args.nodes, rate, mode=args.mode) as cluster:
        if cluster.note:
            print(f"NOTE: {cluster.note}", flush=True)
        print(f"cluster: {args.nodes} nodes x {args.ranks_per_node} ranks, {cluster.mode}, "
              f"{f'{rate:g} Mbit/s' if rate else 'unshaped'} between nodes", flush=True)
        for backend in sorted({r.backend for r in rows}):
            compute[backend] = calibrate(cluster, args, backend, out)
            print(f"  calibrated compute per step ({backend}): {compute[backend]:.3f} s", flush=True)
        runs: dict = {row.key: [] for row in rows}
        for repeat in range(args.repeats):
            for row in rows:
                run_dir = out / row.key / (f"repeat{repeat + 1}" if args.repeats > 1 else "")
                runs[row.key].append(_measure_row(cluster, args, row, run_dir, rate, compute[row.backend]))
        results = [_median_run(runs[row.key]) for row in rows]
        setup = {"nodes": args.nodes, "ranks_per_node": args.ranks_per_node, "rate_mbit": rate,
                 "sync_interval": args.sync_interval, "steps": args.steps, "warmup": args.warmup,
                 "repeats": args.repeats,
                 "cluster_mode": cluster.mode, "note": cluster.note, "compute_seconds": compute,
                 "command": shlex.join([Path(sys.argv[0]).name if argv is None else "bench_cluster.py",
                                        *(sys.argv[1:] if argv is None else argv)])}
    json_path, md_path, table = write_outputs(out, setup, results)
    print("\n" + table + f"\nwrote {json_path} and {md_path}")
    _plots(out, results)
    return 0


# elastic FL in its best mode on slow links (int4 + error feedback, 2 fragments, overlap 1)
BEST_ELASTIC = ("--fl-sync-dtype", "int4", "--fl-error-feedback", "--fl-fragments", "2", "--fl-overlap-steps", "1")


def failure_comparison(args) -> "failures.Comparison":
    """The failure comparison's setups from the arguments: FL+FSDP in groups of one node's ranks
    (the fl-fsdp row's flags) for one-world and elastic, the torchft-localsgd row's for torchft."""
    rows = {r.key: r for r in all_rows(args.nodes, args.ranks_per_node, args.sync_interval)}
    node = ["--ranks-per-node", str(args.ranks_per_node)]
    return failures.Comparison(
        steps=args.steps, sync_interval=args.sync_interval, kill_step=args.kill_step, kill_rank=args.kill_rank,
        ranks_per_node=args.ranks_per_node, timeout=args.timeout, relaunch_delay=args.relaunch_delay,
        fl_flags=(*common_flags(args), *rows["fl-fsdp"].flags(), *node),
        peer_flags=(*common_flags(args), *rows["torchft-localsgd"].flags(), *node),
        best_flags=BEST_ELASTIC if args.sync_interval % 2 == 0 else ("--fl-sync-dtype", "int4", "--fl-error-feedback"),
        diloco_flags=("--algorithm", "diloco"),
        setups=tuple(k for k in failures.SETUPS if k in args.rows) if args.rows else failures.SETUPS)


def _failure_compare(args, argv, out: Path) -> int:
    rate = args.rate_mbit or None
    comparison = failure_comparison(args)
    with EmulatedCluster(args.nodes, rate, mode=args.mode, node_hostnames=True) as cluster:
        if cluster.note:
            print(f"NOTE: {cluster.note}", flush=True)
        print(f"cluster: {args.nodes} nodes x {args.ranks_per_node} ranks, {cluster.mode}, "
              f"{f'{rate:g} Mbit/s' if rate else 'unshaped'} between nodes; failure comparison: "
              f"{comparison.fault} (FL_MEGATRON_FAULT)", flush=True)
        results, checks = failures.compare(cluster, comparison, out, say=lambda text: print(text, flush=True))
        setup = {"nodes": args.nodes, "ranks_per_node": args.ranks_per_node, "rate_mbit": rate,
                 "sync_interval": args.sync_interval, "steps": args.steps, "kill_step": args.kill_step,
                 "kill_rank": args.kill_rank, "kill_group": args.kill_rank // args.ranks_per_node,
                 "last_sync_before_kill": failures.last_sync_before(args.kill_step, args.sync_interval),
                 "relaunch_delay": args.relaunch_delay, "cluster_mode": cluster.mode, "note": cluster.note,
                 "fl_flags": list(comparison.fl_flags), "peer_flags": list(comparison.peer_flags),
                 "best_flags": list(comparison.best_flags), "diloco_flags": list(comparison.diloco_flags),
                 "lighthouse": {"join_timeout_ms": failures.JOIN_TIMEOUT_MS,
                                "heartbeat_timeout_ms": failures.HEARTBEAT_TIMEOUT_MS},
                 "command": shlex.join([Path(sys.argv[0]).name if argv is None else "bench_cluster.py",
                                        *(sys.argv[1:] if argv is None else argv)])}
    json_path, md_path, table = failures.write_outputs(out, setup, results, checks)
    print("\n" + table)
    for check in checks:
        print(f"{'OK' if check['ok'] else 'NOT MET'}: {check['setup']}: {check['text']}")
    print(f"wrote {json_path} and {md_path}")
    return 0 if all(c["ok"] for c in checks if c["setup"].startswith("elastic")) else 3


def _measure_row(cluster, args, row: Row, run_dir: Path, rate, compute_s: float) -> dict:
    """Run one row once; what it measured beside what the cost model predicts."""
    counters = run_row(cluster, args, row, run_dir, args.steps)
    # a --fl-tune row is predicted in the mode it chose (its first choice comes before the timed span)
    pred = predict_row(as_tuned(row, run_dir), common_flags(args), args.nodes, args.ranks_per_node, rate, compute_s,
                       args.steps, args.warmup, jitter_s=0.0 if row.is_peer else args.jitter_ms / 1000)
    got = measured(run_dir, args.warmup, pred["tokens_per_step"])
    _check_layout(row, got.get("layout"), args.nodes * args.ranks_per_node)
    wire = sum(c.wire_tx_bytes for c in counters) if counters else None
    print(f"  {row.label:<36} {got['tokens_per_s']:>8,.0f} tok/s (predicted {pred['tokens_per_s']:,.0f}), "
          f"{got['step_seconds']:.3f} s/step (predicted {pred['step_seconds']:.3f}), inter-node "
          + (f"{wire / 1e6:.1f} MB" if wire is not None else "n/a")
          + f" (predicted {pred['inter_node_bytes'] / 1e6:.1f} MB)", flush=True)
    return {"row": {**row.__dict__, "extra": list(row.extra)}, "run_dir": str(run_dir), "measured": got,
            "predicted": pred, "inter_node_wire_bytes": wire,
            "counters": [c.as_dict() for c in counters] if counters else None}


def _median_run(repeats: list[dict]) -> dict:
    """The repeat with the median tokens/s (the lower middle of an even count), with every repeat's tokens/s."""
    ordered = sorted(repeats, key=lambda r: r["measured"]["tokens_per_s"])
    chosen = dict(ordered[(len(ordered) - 1) // 2])
    chosen["tokens_per_s_repeats"] = [r["measured"]["tokens_per_s"] for r in repeats]
    return chosen


def _check_layout(row: Row, layout: dict | None, world: int) -> None:
    """The run trained the layout the row asked for (a config file cannot silently override it)."""
    if layout is None:  # a summary without a layout (nothing to check)
        return
    want = (world // row.group_size, row.group_size // (row.shard_size or row.group_size))
    got = (layout["num_groups"], layout["replicas"])
    if got != want:
        raise RuntimeError(f"{row.label}: the run used {got[0]} groups x {got[1]} replicas, not {want}")


def _plots(out: Path, results: list[dict]) -> None:
    """Loss against tokens and time, bytes per tier: one figure per kind, every row in it."""
    try:
        import plot_runs
        plot_runs.main([*(r["run_dir"] for r in results), "--label", *(r["row"]["label"] for r in results),
                        "--out", str(out / "plots")])
    except (ImportError, ValueError) as e:
        print(f"no plots: {e}")


if __name__ == "__main__":
    sys.exit(main())
