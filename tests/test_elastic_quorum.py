"""Elastic mode's inter-group tier: torchft's quorum group, entered in torch's registry, carries
every collective of the engine's averaging (all-reduce, all-to-all, all-gather, broadcast,
point-to-point) over the live groups, and follows a group leaving for good.

Three one-rank groups (three processes, three worlds) and a lighthouse; round 0 has all three,
then group 2 leaves and round 1 has groups 0 and 1. Checked against closed forms of the same values."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fl_megatron.launching.lighthouse import lighthouse_command, start_lighthouse
from fl_megatron.launching.ports import free_port
from fl_megatron.launching.tree import stop_all

pytest.importorskip("torchft")
from elastic_quorum_worker import shards_of  # noqa: E402

WORKER = Path(__file__).parent / "elastic_quorum_worker.py"


def _run(tmp_path: Path) -> list[list[dict]]:
    addr = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
    lighthouse, _ = start_lighthouse(lighthouse_command(addr, 2, join_timeout_ms=2000, heartbeat_timeout_ms=1000),
                                       tmp_path)
    workers = []
    try:
        outs = [tmp_path / f"group{g}.json" for g in range(3)]
        workers = [subprocess.Popen([sys.executable, str(WORKER), str(g), f"http://{addr}", "2", str(out)], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                   for g, out in enumerate(outs)]
        for g, w in enumerate(workers):
            log, _ = w.communicate(timeout=180)
            assert w.returncode == 0, f"group {g} failed:\n{log[-4000:]}"
        return [json.loads(out.read_text()) for out in outs]
    finally:
        for p in workers:
            if p.poll() is None:
                p.kill()
                p.wait()
        stop_all([lighthouse])


def test_quorum_group_carries_every_collective_and_follows_a_leave(tmp_path):
    records = _run(tmp_path)
    assert [len(r) for r in records] == [2, 2, 1]  # group 2 left after round 0
    for r, live in ((0, (0, 1, 2)), (1, (0, 1))):
        seen = [records[g][r] for g in live]
        for g, rec in zip(live, seen):
            assert rec["groups"] == list(live) and rec["rank"] == live.index(g) == rec["rank_in_group"]
            assert rec["size"] == len(live) and rec["backend"] == "gloo" and rec["commit"] is True
        values = {g: shards_of(g, r) for g in live}
        for i in range(2):
            mean = torch.stack([values[g][i] for g in live]).mean(0)
            contributors = torch.stack([values[g][i] for g in live[:-1]]).mean(0)
            for g, rec in zip(live, seen):
                fp32, int8 = torch.tensor(rec["fp32"][i]), torch.tensor(rec["int8"][i])
                torch.testing.assert_close(fp32, mean, rtol=0, atol=1e-6)
                # int8 blocks: the error is bounded by the block scale (|x| <= 5 here: 5/127)
                assert float((int8 - contributors).abs().max()) < 0.05
                assert not torch.equal(int8, mean)  # the left-out group's values are not in it
                previous = live[(live.index(g) - 1) % len(live)]
                torch.testing.assert_close(torch.tensor(rec["gossip"][i]), 0.5 * values[g][i] + 0.5 * values[previous][i],
                                           rtol=0, atol=1e-6)
            # every live group ends with the same bits after an average (fp32 and int8)
            assert all(rec["fp32"][i] == seen[0]["fp32"][i] and rec["int8"][i] == seen[0]["int8"][i] for rec in seen)
