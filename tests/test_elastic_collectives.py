"""Elastic mode pays the network's latency once per sync: every collective of two torchrun jobs
(2 groups of 2 ranks, a torchft lighthouse) is recorded in the training loop's main thread
(tests/elastic_collectives_worker.py), and each sync's collectives over the peer group (a group
other than the job's own ranks) are counted. The latency-bound ones (a few numbers) must be one per
sync, the vote, whose size is the vote's closed form; everything else the peer group carries is the
data's (the shards' buckets, int8 payloads and scales, the averaged moments). FedAvg, and nesterov
+ int8 + error feedback + 2 fragments + an overlapped sync + averaged moments (its exchange runs in
a thread of its own: the main thread meets the others only in the launch's vote, then for the
moments at the landing, and in the last sync, which blocks)."""

import json
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from fl_megatron.federation.vote import GROUP_SLOTS
from fl_megatron.launching.ports import free_port

pytest.importorskip("torchft")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import elastic_launch  # noqa: E402

GROUPS, RANKS, STEPS, SMALL = 2, 2, 8, 1024
FLAGS = ["--config", str(ROOT / "examples" / "demo.json"), "--seq-length", "64", "--micro-batch-size", "2",
         "--lr-warmup-iters", "2", "--eval-iters", "0", "--eval-interval", "0", "--log-interval", "1",
         "--fl-sync-interval", "4", "--train-iters", str(STEPS)]


def _peer_collectives(tmp_path: Path, extra: tuple) -> dict:
    """{(group, rank): {step: [(op, payload bytes)] of its collectives over the peer group}}."""
    out = tmp_path / "collectives"
    out.mkdir()
    commands = elastic_launch.elastic_commands(GROUPS, RANKS, GROUPS, [*FLAGS, "--run-dir", str(tmp_path / "run"),
                                                                       *extra],
                                               lighthouse=f"127.0.0.1:{free_port()}", max_restarts=0,
                                               heartbeat_timeout_ms=1000)
    for command in commands[1:]:  # the recording worker in place of -m fl_megatron.pretrain
        at = command.argv.index("fl_megatron.pretrain")
        command.argv[at - 1:at + 1] = [str(ROOT / "tests" / "elastic_collectives_worker.py")]
        command.env.update(FL_TEST_COLLECTIVES=str(out), FL_MEGATRON_DEVICE="cpu")
    codes = elastic_launch.run_elastic(commands, tmp_path / "logs", 300, {})
    logs = "".join(p.read_text()[-2000:] for p in sorted((tmp_path / "logs").glob("*.log")))
    assert codes == {f"group_{g}": 0 for g in range(GROUPS)}, logs
    peers = {}
    for g in range(GROUPS):
        for r in range(RANKS):
            by_step = defaultdict(list)
            for phase, step, op, ranks, nbytes in json.loads((out / f"group_{g}_rank_{r}.json").read_text()):
                if phase == "sync" and not set(ranks or ()) <= set(range(RANKS)):  # not the job's own group
                    by_step[step].append((op, nbytes))
            peers[g, r] = dict(by_step)
    return peers


@pytest.mark.parametrize("extra, meets", [
    pytest.param((), [4, 8], id="fedavg", marks=pytest.mark.heavy),
    pytest.param(("--fl-outer-optimizer", "nesterov", "--fl-sync-dtype", "int8", "--fl-error-feedback",
                  "--fl-fragments", "2", "--fl-overlap-steps", "1", "--fl-inner-state", "average"),
                 [2, 3, 4, 5, 6, 7, 8], id="every-slow-link-option")])
def test_an_elastic_sync_makes_one_latency_bound_collective_across_the_groups(tmp_path, extra, meets):
    vote = ("allreduce_", (GROUP_SLOTS * GROUPS + 2) * 8)  # the vote's table, float64
    for (g, r), by_step in _peer_collectives(tmp_path, extra).items():
        assert sorted(by_step) == meets, (g, r, sorted(by_step))
        for step, collectives in by_step.items():
            small = [c for c in collectives if c[1] <= SMALL]
            landing = extra and step % 2 == 1  # an overlapped landing: the averaged moments only
            assert small == ([] if landing else [vote]), (g, r, step, collectives)
            assert landing or collectives.count(vote) == 1
