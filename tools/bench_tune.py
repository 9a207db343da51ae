#!/usr/bin/env python3
"""--fl-tune against every hand-picked sync mode on the emulated two-tier cluster, one run per rate.

For each --rates value (Mbit/s between nodes) this runs tools/bench_cluster.py once with the
hand-picked FL+FSDP rows (fp32, bf16, int8 + EF with and without a one-step overlap, int4 + EF
with and without it, int4 + EF in 2 and in 4 fragments with the overlap) and the --fl-tune row (int4
allowed), side by side on the same model, data, seed and steps. Then it reports, per rate: the
tuned run's tokens/s over the whole run (every step timed, from the start of step 1, with the
tuned run's own start-up added: its link probe and the timing of the device's products) against
the best hand-picked row's over its whole run (target: at least 0.95), the mode it chose (from
its metrics.jsonl), and its eval loss against the hand-picked row of the same mode and against
the fp32 average (docs/sync-modes.md: within 1 % of fp32 for the compressed modes). Writes
tune.json and tune.md to --out; exit code 3 when a target is missed.

  python tools/bench_tune.py --rates 10 100 1000          # 2 nodes x 2 ranks, H = 8, ~25 min on 2 cores
  python tools/bench_tune.py --repeats 2                  # every row twice, interleaved: the median repeats
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
HAND_ROWS = ("fl-fsdp", "fl-fsdp-bf16", "fl-fsdp-int8", "fl-fsdp-int8-overlap", "fl-fsdp-int4", "fl-fsdp-int4-overlap",
             "fl-fsdp-int4-frag2-overlap", "fl-fsdp-int4-frag4-overlap")
TUNE_ROW = "fl-fsdp-tune"
SPEED_TARGET = 0.95
LOSS_BOUND = 0.01  # relative eval loss against the fp32 average (docs/sync-modes.md, "Let it choose")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--rates", type=float, nargs="+", default=[10.0, 100.0, 1000.0], help="Mbit/s between nodes")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--sync-interval", type=int, default=8)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1, help="run every row this many times, interleaved; each row's "
                                                          "median repeat is compared (bench_cluster --repeats)")
    p.add_argument("--out", default="runs/bench-tune")
    p.add_argument("--reuse", action="store_true", help="report from the bench.json files already in --out")
    return p.parse_args(argv)


def row_mode(flags: list[str], sync_interval: int) -> dict:
    """The sync mode a row's flags ask for (the fields SyncMode.fields() has)."""
    def value(flag, default):
        return type(default)(flags[flags.index(flag) + 1]) if flag in flags else default
    dtype = value("--fl-sync-dtype", "fp32")
    return {"sync_dtype": dtype, "error_feedback": "--fl-error-feedback" in flags,
            "overlap_steps": value("--fl-overlap-steps", 0), "fragments": value("--fl-fragments", 1),
            "sync_interval": sync_interval}


def tuned_mode(run_dir: Path) -> tuple[dict, list[str]]:
    """(the mode the tuned run trained in at its end, every decision's console text)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    decisions = [r for r in records if "tune" in r]
    if not decisions:
        raise RuntimeError(f"{run_dir}: the --fl-tune run made no decision (no 'tune' record)")
    texts = [f"step {d['step']}: {d['tune']['label']} ({d['tune']['reason']})" for d in decisions]
    return decisions[-1]["tune"]["mode"], texts


def tuner_startup_seconds(run_dir: Path) -> float:
    """What the tuned run spent before step 1 that the hand-picked rows do not: its link probe
    and the timing of the device's products (config.json)."""
    config = json.loads((run_dir / "config.json").read_text())
    rate = (config.get("fl_tune_start") or {}).get("device_rate") or {}
    return (config.get("link_probe") or {}).get("seconds", 0.0) + rate.get("wall_seconds", 0.0)


def with_startup(measured: dict, startup_s: float) -> float:
    """tokens/s over the timed span with `startup_s` added to it."""
    span = measured["span_seconds"]
    return measured["tokens_per_s"] * span / (span + startup_s)


def report_rate(bench: dict, rate: float, sync_interval: int) -> dict:
    by_key = {r["row"]["key"]: r for r in bench["results"]}
    hand = {k: by_key[k] for k in HAND_ROWS if k in by_key}
    tuned = by_key[TUNE_ROW]
    best_key = max(hand, key=lambda k: hand[k]["measured"]["tokens_per_s"])
    best = hand[best_key]["measured"]["tokens_per_s"]
    startup = tuner_startup_seconds(Path(tuned["run_dir"]))
    tuned_speed = with_startup(tuned["measured"], startup)
    mode, decisions = tuned_mode(Path(tuned["run_dir"]))
    same = next((k for k, r in hand.items() if row_mode(r["row"]["extra"], sync_interval) == mode), None)
    fp32_loss = hand["fl-fsdp"]["measured"]["eval_loss"]
    loss = tuned["measured"]["eval_loss"]
    speed = tuned_speed / best
    vs_fp32 = (loss - fp32_loss) / fp32_loss
    return {"rate_mbit": rate, "tuned_tokens_per_s": tuned_speed, "tuner_startup_seconds": startup,
            "tuned_tokens_per_s_without_startup": tuned["measured"]["tokens_per_s"], "best_row": best_key,
            "best_tokens_per_s": best, "speed_ratio": speed, "speed_ok": speed >= SPEED_TARGET,
            "chosen": mode, "same_mode_row": same, "decisions": decisions,
            "eval_loss": loss, "eval_loss_fp32": fp32_loss, "eval_loss_vs_fp32": vs_fp32,
            "eval_loss_same_mode_row": hand[same]["measured"]["eval_loss"] if same else None,
            "loss_ok": vs_fp32 <= LOSS_BOUND,
            "tuned_tokens_per_s_repeats": tuned.get("tokens_per_s_repeats"),
            "rows": {k: {"tokens_per_s": r["measured"]["tokens_per_s"], "eval_loss": r["measured"]["eval_loss"],
                         "tokens_per_s_repeats": r.get("tokens_per_s_repeats")} for k, r in hand.items()}}


def markdown(results: list[dict]) -> str:
    lines = ["| Mbit/s | --fl-tune tok/s | best hand-picked (tok/s) | ratio | chose | eval loss | same mode by hand | "
             "fp32 | vs fp32 |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        same = f"{r['eval_loss_same_mode_row']:.4f} ({r['same_mode_row']})" if r["same_mode_row"] else "-"
        lines.append(f"| {r['rate_mbit']:g} | {r['tuned_tokens_per_s']:,.0f} | {r['best_row']} "
                     f"({r['best_tokens_per_s']:,.0f}) | {r['speed_ratio']:.3f} | {r['decisions'][-1].split(' (')[0]} | "
                     f"{r['eval_loss']:.4f} | {same} | {r['eval_loss_fp32']:.4f} | {r['eval_loss_vs_fp32']:+.2%} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse(argv)
    out = Path(args.out).resolve()
    results = []
    for rate in args.rates:
        rate_dir = out / f"rate-{rate:g}"
        if not args.reuse:
            cmd = [sys.executable, str(TOOLS / "bench_cluster.py"), "--nodes", str(args.nodes), "--ranks-per-node",
                   str(args.ranks_per_node), "--rate-mbit", f"{rate:g}", "--sync-interval", str(args.sync_interval),
                   "--steps", str(args.steps), "--warmup", "0", "--repeats", str(args.repeats), "--rows",
                   *HAND_ROWS, TUNE_ROW,
                   "--out", str(rate_dir)]
            print(f"[{rate:g} Mbit/s] {' '.join(cmd[1:])}", flush=True)
            if subprocess.run(cmd).returncode != 0:
                print(f"error: the benchmark at {rate:g} Mbit/s failed", file=sys.stderr)
                return 1
        bench = json.loads((rate_dir / "bench.json").read_text())
        results.append(report_rate(bench, rate, args.sync_interval))
    table = markdown(results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tune.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "tune.md").write_text(table + "\n")
    print("\n" + table)
    for r in results:
        print(f"{'OK' if r['speed_ok'] else 'NOT MET'}: {r['rate_mbit']:g} Mbit/s: --fl-tune at {r['speed_ratio']:.3f} "
              f"of the best hand-picked mode ({r['best_row']}); target {SPEED_TARGET}")
        print(f"{'OK' if r['loss_ok'] else 'NOT MET'}: {r['rate_mbit']:g} Mbit/s: eval loss {r['eval_loss_vs_fp32']:+.2%} "
              f"against the fp32 average; bound +{LOSS_BOUND:.0%}")
        spread = r["tuned_tokens_per_s_repeats"]
        if spread and len(spread) > 1:
            print(f"    the tuned row's repeats: {', '.join(f'{v:,.0f}' for v in spread)} tok/s; the best row's: "
                  + ", ".join(f"{v:,.0f}" for v in r["rows"][r["best_row"]]["tokens_per_s_repeats"]))
    print(f"wrote {out / 'tune.json'} and {out / 'tune.md'}")
    return 0 if all(r["speed_ok"] and r["loss_ok"] for r in results) else 3


if __name__ == "__main__":
    sys.exit(main())
