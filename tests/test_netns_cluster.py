"""Tests of the emulated two-tier cluster (tools/cluster_bench); the netns ones need root."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))

from cluster_bench.netns_cluster import EmulatedCluster, cleanup_stale, run_job  # noqa: E402
from cluster_bench.netns_ops import list_namespaces, tbf_params  # noqa: E402

PROBE = str(TOOLS / "cluster_bench" / "allreduce_probe.py")
RATE_MBIT = 50
SIZE_MIB = 4
ITERS = 2
FRAME_OVER_MSS = 1514 / 1448  # Ethernet frame (no FCS) per TCP segment payload at MTU 1500


def _netns_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    name = f"flmprobe{os.getpid()}"
    proc = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"`ip netns add` failed: {proc.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


@pytest.fixture(scope="module")
def netns():
    reason = _netns_skip_reason()
    if reason:
        pytest.skip(reason)


def _ours(prefix: str) -> list[str]:
    """Namespaces and host interfaces whose names contain the prefix."""
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [ns for ns in list_namespaces() if ns.startswith(prefix)] + \
        [line for line in links.splitlines() if prefix in line]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _probe_argv(cluster, port, rank):
    return [sys.executable, PROBE, "--init-method", f"tcp://{cluster.node_ip(0)}:{port}",
            "--rank", str(rank), "--world-size", "2", "--iters", str(ITERS),
            "--size-mib", str(SIZE_MIB)]


@pytest.fixture(scope="module")
def shaped_run(netns):
    """One all_reduce job (1 rank on each of 2 nodes) on a 50 Mbit/s cluster."""
    with EmulatedCluster(2, RATE_MBIT, mode="netns") as cluster:
        assert cluster.mode == "netns" and cluster.note is None
        port = cluster.pick_port()
        before = cluster.counters()
        procs = [cluster.popen(k, _probe_argv(cluster, port, k), stdout=subprocess.PIPE,
                               text=True) for k in range(2)]
        outs = [p.communicate(timeout=60)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outs
        delta = [a - b for a, b in zip(cluster.counters(), before)]
    results = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    return {"cluster": cluster, "delta": delta, "results": results}


def test_tbf_params_scale_with_rate():
    low, high = tbf_params(10, 1500, 1.0, 50.0), tbf_params(10_000, 1500, 1.0, 50.0)
    assert low["burst"] == 4 * 1514 and high["burst"] == 1_250_000
    assert high["limit"] == 1_250_000 + 62_500_000 and low["limit"] == 4 * 1514 + 512 * 1024
    assert low["rate_bit"] == 10_000_000
    with pytest.raises(ValueError, match="rate_mbit must be > 0, got 0"):
        tbf_params(0, 1500, 1.0, 20.0)


def test_counters_match_ring_bytes_on_the_wire(shaped_run):
    payload = SIZE_MIB * 2**20 * ITERS  # per node: 2 * (k-1)/k * size = size for k = 2
    assert all(r["ok"] for r in shaped_run["results"])
    for node in shaped_run["delta"]:
        factor = node.wire_tx_bytes / payload
        print(f"wire tx / payload = {factor:.4f} (frames alone: {FRAME_OVER_MSS:.4f}), "
              f"device tx / payload = {node.tx_bytes / payload:.4f}, drops {node.wire_tx_drops}")
        # data frames plus ACKs (~2 %) and the rendezvous/barriers
        assert 0.99 * FRAME_OVER_MSS <= factor <= 1.06 * FRAME_OVER_MSS
        assert node.wire_rx_bytes >= payload * FRAME_OVER_MSS * 0.99


def test_all_reduce_not_faster_than_the_link(shaped_run):
    wire_s = SIZE_MIB * 2**20 * FRAME_OVER_MSS * 8 / (RATE_MBIT * 1e6)
    for i in range(ITERS):
        secs = max(r["seconds"][i] for r in shaped_run["results"])
        print(f"all_reduce {secs:.3f} s, data frames at the rate {wire_s:.3f} s")
        assert 0.97 * wire_s <= secs <= 2.5 * wire_s


def test_teardown_leaves_nothing(shaped_run):
    cluster = shaped_run["cluster"]
    assert _ours(cluster.prefix) == []
    assert cluster.teardown_seconds is not None and cluster.setup_seconds < 5


def test_exception_tears_down(netns):
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedCluster(2, RATE_MBIT, mode="netns") as cluster:
            sleeper = cluster.popen(0, ["sleep", "600"])
            assert _ours(cluster.prefix)
            raise RuntimeError("boom")
    assert _ours(cluster.prefix) == [] and not _alive(sleeper.pid)
    with pytest.raises(RuntimeError, match="not active"):
        cluster.counters()


# The child takes SIGINT as an interactive program does: a suite started from a script in the
# background (`make test &`, nohup) hands its children SIGINT ignored, which the cluster respects.
CHILD = textwrap.dedent("""
    import signal, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, {tools!r})
    from cluster_bench.netns_cluster import EmulatedCluster
    with EmulatedCluster(2, 50, mode="netns") as c:
        p = c.popen(1, ["sleep", "600"])
        print(c.prefix, p.pid, flush=True)
        time.sleep(600)
""")


def _start_child(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(tools=str(TOOLS)))
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    prefix, pid = child.stdout.readline().split()
    return child, prefix, int(pid)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_tears_down(netns, tmp_path, sig):
    child, prefix, sleeper = _start_child(tmp_path)
    assert _ours(prefix) and _alive(sleeper)
    child.send_signal(sig)
    assert child.wait(timeout=30) == -sig  # previous handler restored and the signal re-sent
    assert _ours(prefix) == [] and not _alive(sleeper)


def test_stale_namespaces_of_a_killed_run_are_removed(netns, tmp_path):
    child, prefix, sleeper = _start_child(tmp_path)
    child.kill()
    child.wait(timeout=30)
    assert len(_ours(prefix)) == 3 and _alive(sleeper)
    removed = cleanup_stale()
    assert {f"{prefix}-br", f"{prefix}-n0", f"{prefix}-n1"} <= set(removed)
    deadline = time.monotonic() + 5
    while _alive(sleeper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _ours(prefix) == [] and not _alive(sleeper)


def test_run_job_torchrun_across_namespaces(netns):
    with EmulatedCluster(2, 1000, mode="netns") as cluster:
        result = run_job(cluster, 1, [PROBE, "--size-mib", "1"], timeout=60)
    assert result.ok, result.stderr_tails
    assert all(json.loads(t.strip().splitlines()[-1])["ok"] for t in result.stdout_tails)
    assert all(c.wire_tx_bytes > 2**20 for c in result.counters)


def test_loopback_fallback_runs_unshaped():
    with EmulatedCluster(2, RATE_MBIT, mode="loopback") as cluster:
        assert cluster.mode == "loopback" and "NOT shaped" in cluster.note
        assert cluster.node_ip(1) == "127.0.0.1"
        assert cluster.counters() is None
        result = run_job(cluster, 1, [PROBE, "--size-mib", str(SIZE_MIB), "--iters", "2"],
                         timeout=60)
    assert result.ok, result.stderr_tails
    assert result.counters is None
    results = [json.loads(t.strip().splitlines()[-1]) for t in result.stdout_tails]
    wire_s = SIZE_MIB * 2**20 * FRAME_OVER_MSS * 8 / (RATE_MBIT * 1e6)
    assert all(r["ok"] and r["seconds"][-1] < wire_s / 2 for r in results)  # not shaped


def test_auto_mode_without_root_falls_back(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with EmulatedCluster(3, None) as cluster:
        assert cluster.mode == "loopback" and "not running as root" in cluster.note
        assert "unshaped" in cluster.note and cluster.node_ip(2) == "127.0.0.1"
    with pytest.raises(RuntimeError, match="not running as root"):
        with EmulatedCluster(2, 10, mode="netns"):
            pass


def test_run_job_stops_all_on_failure_and_on_timeout(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] == '1' and '--fail' in sys.argv:\n"
                      "    sys.exit(3)\n"
                      "time.sleep(600)\n")
    with EmulatedCluster(2, None, mode="loopback") as cluster:
        failed = run_job(cluster, 1, [str(script), "--fail"], timeout=60)
        hung = run_job(cluster, 1, [str(script)], timeout=3)
    assert not failed.ok and not failed.timed_out and failed.returncodes[1] != 0
    assert failed.returncodes[0] != 0 and failed.elapsed_seconds < 30
    assert hung.timed_out and not hung.ok and 3 <= hung.elapsed_seconds < 10
    assert all(rc != 0 for rc in hung.returncodes)
