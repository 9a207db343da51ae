"""tools/bench_latency.py: the one-way delays a sync waits in sequence across 4 groups, ours
against torchft LocalSGD, counted by the delay the tool injects at each collective (not timed).

The reference is the closed form of each sync's collectives over F = 4 groups, a ring all-reduce
waiting 2(F - 1) one-way delays: ours makes one data bucket with the vote riding in it (1
all-reduce); with its metrics in a round of their own, 2; torchft LocalSGD one all-reduce per parameter tensor
plus a round trip for its quorum."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))

from cluster_bench.latency import hops  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_hops_of_each_collective_over_a_ring():
    assert [hops("allreduce_", n) for n in (1, 2, 4)] == [0, 2, 6]
    assert [hops(op, 4) for op in ("_allgather_base_", "alltoall_base_", "broadcast_", "send", "recv_")] == \
        [3, 3, 3, 1, 1]
    assert hops("barrier", 3) == 4 and hops("not_a_collective", 4) == 0


def test_a_sync_waits_two_ring_all_reduces_of_delay_and_torchft_one_per_tensor(tmp_path):
    layers = 1
    cmd = [sys.executable, str(TOOLS / "bench_latency.py"), "--repeats", "1", "--delays-ms", "0", "2",
           "--num-layers", str(layers), "--hidden-size", "64", "--ffn-hidden-size", "96", "--vocab-size", "256",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    ring = 2 * (4 - 1)
    tensors = 9 * layers + 3  # a Llama block's 9 tensors, the embedding, the final norm and the output
    assert result["hops"] == {"ours": ring, "ours_metrics_round": 2 * ring,
                              "torchft_localsgd": 2 + tensors * ring}
    assert set(result["median_s"]) == {"ours", "ours_metrics_round", "torchft_localsgd"}
    assert "| ours | 6 |" in proc.stdout and (tmp_path / "bench.md").read_text().count("\n") == 5
