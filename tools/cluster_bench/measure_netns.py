#!/usr/bin/env python3
"""Measure the emulated cluster itself (needs root): tbf accuracy, framing, setup time.

    PYTHONPATH=tools python -m cluster_bench.measure_netns [--rates 100 1000] [--what ...]

bulk:  goodput of one TCP transfer node0 -> node1 against the set rate; `vs_ideal` divides by
       the most TCP can carry over Ethernet at MTU 1500 (rate * 1448/1514).
gloo:  all_reduce (1 rank per node) wire bytes per node / payload bytes per node and its time
       against the time the wire bytes take at the set rate.
setup: seconds to build and to tear down clusters of 2, 4 and 8 nodes.
Prints one JSON object per measurement.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from cluster_bench.netns_cluster import EmulatedCluster

HERE = Path(__file__).resolve().parent
TCP_PAYLOAD_PER_FRAME = 1448 / 1514  # MSS with timestamps / frame without FCS at MTU 1500


def _run_pair(cluster, server_argv, client_argv, timeout=120):
    """Start server on node 1, client on node 0; return the server's last stdout line."""
    server = cluster.popen(1, server_argv, stdout=subprocess.PIPE, text=True)
    server.stdout.readline()  # "listening" or first output line
    client = cluster.popen(0, client_argv)
    client.wait(timeout=timeout)
    out = server.communicate(timeout=timeout)[0].strip().splitlines()
    return out[-1] if out else ""


def _ratio(num: float, rate_mbit: float) -> float | None:
    return round(num / rate_mbit, 4) if rate_mbit else None


def bulk(rate_mbit: float, seconds: float, **kw) -> dict:
    mbytes = max(2.0, (rate_mbit or 10_000) * seconds / 8 * 0.95)
    with EmulatedCluster(2, rate_mbit or None, mode="netns", **kw) as cluster:
        before = cluster.counters()
        line = _run_pair(
            cluster, [sys.executable, str(HERE / "tcp_bulk.py"), "recv", "--port", "5201"],
            [sys.executable, str(HERE / "tcp_bulk.py"), "send", "--host", cluster.node_ip(1),
             "--port", "5201", "--mbytes", str(mbytes)])
        delta = [a - b for a, b in zip(cluster.counters(), before)]
    res = json.loads(line)
    payload = res["bytes"]
    return {"what": "bulk", "rate_mbit": rate_mbit, "mbytes": mbytes,
            "goodput_mbit": round(res["goodput_mbit"], 2),
            "goodput_vs_rate": _ratio(res["goodput_mbit"], rate_mbit),
            "goodput_vs_ideal": _ratio(res["goodput_mbit"] / TCP_PAYLOAD_PER_FRAME, rate_mbit),
            "wire_tx_over_payload": round(delta[0].wire_tx_bytes / payload, 4),
            "dev_tx_over_payload": round(delta[0].tx_bytes / payload, 4),
            "tx_drops": delta[0].wire_tx_drops, "tbf": cluster.tbf}


def gloo(rate_mbit: float, size_mib: float, iters: int, **kw) -> dict:
    with EmulatedCluster(2, rate_mbit or None, mode="netns", **kw) as cluster:
        port = cluster.pick_port()
        before = cluster.counters()
        procs = [cluster.popen(k, [sys.executable, str(HERE / "allreduce_probe.py"),
                                   "--init-method", f"tcp://{cluster.node_ip(0)}:{port}",
                                   "--rank", str(k), "--world-size", "2", "--iters", str(iters),
                                   "--size-mib", str(size_mib)],
                               stdout=subprocess.PIPE, text=True) for k in range(2)]
        outs = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1])
                for p in procs]
        delta = [a - b for a, b in zip(cluster.counters(), before)]
    payload = outs[0]["bytes"] * iters  # per node for 2 ranks: 2 * (k-1)/k * size = size
    secs = [max(o["seconds"][i] for o in outs) for i in range(iters)]
    wire = max(d.wire_tx_bytes for d in delta)
    median = sorted(secs)[len(secs) // 2]
    return {"what": "gloo", "rate_mbit": rate_mbit, "size_mib": size_mib, "iters": iters,
            "wire_over_payload": round(wire / payload, 4),
            "dev_over_payload": round(max(d.tx_bytes for d in delta) / payload, 4),
            "median_s": round(median, 4),
            "median_vs_wire_time": _ratio(median * 1e6 / (wire / iters * 8), 1 / rate_mbit)
            if rate_mbit else None,
            "tx_drops": [d.wire_tx_drops for d in delta], "ok": all(o["ok"] for o in outs)}


def setup(nodes: int, repeats: int) -> dict:
    ups, downs = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        with EmulatedCluster(nodes, 100, mode="netns") as cluster:
            ups.append(time.perf_counter() - start)
        downs.append(cluster.teardown_seconds)
    return {"what": "setup", "nodes": nodes, "setup_s": round(sorted(ups)[repeats // 2], 4),
            "teardown_s": round(sorted(downs)[repeats // 2], 4)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--what", nargs="+", default=["bulk", "gloo", "setup"])
    parser.add_argument("--rates", type=float, nargs="+", default=[10, 100, 1000],
                        help="Mbit/s; 0 = unshaped")
    parser.add_argument("--seconds", type=float, default=3.0, help="bulk transfer length")
    parser.add_argument("--size-mib", type=float, default=4.0)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--burst-ms", type=float, default=1.0)
    parser.add_argument("--queue-ms", type=float, default=50.0)
    args = parser.parse_args(argv)
    kw = {"burst_ms": args.burst_ms, "queue_ms": args.queue_ms}
    for rate in args.rates if "bulk" in args.what else []:
        print(json.dumps(bulk(rate, args.seconds, **kw)), flush=True)
    for rate in args.rates if "gloo" in args.what else []:
        print(json.dumps(gloo(rate, args.size_mib, args.iters, **kw)), flush=True)
    for nodes in (2, 4, 8) if "setup" in args.what else []:
        print(json.dumps(setup(nodes, 5)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
