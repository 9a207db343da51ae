"""The benchmark's table: measured beside predicted, as text, markdown and JSON."""

import json
from pathlib import Path

MB = 1e6


def _err(measured, predicted) -> str:
    return f"{(predicted - measured) / measured:+.0%}" if measured and predicted is not None else "-"


def table_rows(results: list[dict], baseline_key: str = "fsdp") -> list[dict]:
    """One flat dict per row with the ratios to the baseline row."""
    base = next((r for r in results if r["row"]["key"] == baseline_key), None)
    out = []
    for r in results:
        m, p = r["measured"], r["predicted"]
        out.append({
            "row": r["row"]["label"], "key": r["row"]["key"], "tokens_per_s": m["tokens_per_s"],
            "tokens_per_s_repeats": r.get("tokens_per_s_repeats", [m["tokens_per_s"]]),
            "x_baseline": m["tokens_per_s"] / base["measured"]["tokens_per_s"] if base else None,
            "predicted_tokens_per_s": p["tokens_per_s"],
            "inter_node_mb": r["inter_node_wire_bytes"] / MB if r["inter_node_wire_bytes"] is not None else None,
            "predicted_inter_node_mb": p["inter_node_bytes"] / MB,
            "step_s": m["step_seconds"], "predicted_step_s": p["step_seconds"],
            "inter_group_payload_mb": (m["inter_group_payload_bytes"] / MB
                                       if m.get("inter_group_payload_bytes") is not None else None),
            "eval_loss": m["eval_loss"], "peak_mib_per_rank": m["peak_memory_bytes"] / 2**20})
    return out


def markdown(rows: list[dict], baseline_label: str) -> str:
    head = ("| row | tokens/s (range of repeats) | x " + baseline_label
            + " | predicted tokens/s | inter-node MB (counters) | predicted MB "
            "| err | s/step | predicted s/step | err | inter-group payload MB | eval loss | peak MiB/rank |")
    lines = [head, "|" + " --- |" * 13]
    for r in rows:
        mb = f"{r['inter_node_mb']:.1f}" if r["inter_node_mb"] is not None else "n/a"
        payload = f"{r['inter_group_payload_mb']:.1f}" if r["inter_group_payload_mb"] is not None else "-"
        ratio = f"{r['x_baseline']:.2f}" if r["x_baseline"] is not None else "-"
        loss = f"{r['eval_loss']:.4f}" if r["eval_loss"] is not None else "-"
        runs = r.get("tokens_per_s_repeats") or [r["tokens_per_s"]]
        spread = f" ({min(runs):,.0f}-{max(runs):,.0f})" if len(runs) > 1 else ""
        lines.append(
            f"| {r['row']} | {r['tokens_per_s']:,.0f}{spread} | {ratio} | {r['predicted_tokens_per_s']:,.0f} | {mb} | "
            f"{r['predicted_inter_node_mb']:.1f} | {_err(r['inter_node_mb'], r['predicted_inter_node_mb'])} | "
            f"{r['step_s']:.3f} | {r['predicted_step_s']:.3f} | {_err(r['step_s'], r['predicted_step_s'])} | "
            f"{payload} | {loss} | {r['peak_mib_per_rank']:.0f} |")
    return "\n".join(lines) + "\n"


def header_lines(title: str, setup: dict) -> list[str]:
    """A bench.md's first lines: the title with the cluster's shape and rate, the command, the
    cluster's mode (and why it is unshaped, if it is)."""
    return [f"# {title}: {setup['nodes']} nodes x {setup['ranks_per_node']} ranks, "
            f"{setup['rate_mbit'] or 'unshaped'} Mbit/s between nodes", "",
            f"command: `{setup['command']}`", "", f"cluster: {setup['cluster_mode']}"
            + (f" ({setup['note']})" if setup.get("note") else "")]


def write_outputs(out: Path, setup: dict, results: list[dict]) -> tuple[Path, Path, str]:
    """bench.json (everything) and bench.md (setup and table) in `out`; returns the paths and the table."""
    base = next((r["row"]["label"] for r in results if r["row"]["key"] == "fsdp"), "baseline")
    rows = table_rows(results)
    table = markdown(rows, base.split(" over")[0])
    json_path, md_path = out / "bench.json", out / "bench.md"
    json_path.write_text(json.dumps({"setup": setup, "table": rows, "results": results}, indent=2) + "\n")
    lines = [*header_lines("Two-tier benchmark", setup),
             f"timed span: steps {setup['warmup'] + 1}-{setup['steps']} of every row "
             f"(H = {setup['sync_interval']}, {setup.get('repeats', 1)} repeat(s), median shown); compute per step (calibrated): "
             + ", ".join(f"{k} {v:.3f} s" for k, v in setup["compute_seconds"].items()), "", table]
    md_path.write_text("\n".join(lines))
    return json_path, md_path, table
