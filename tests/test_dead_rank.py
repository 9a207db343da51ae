"""A rank SIGKILLed in any phase never hangs the job: the others exit within the collective
timeout with the phase named (and the dead rank, found by process id on this node), and a
restart from the last published checkpoint reproduces the uninterrupted run's losses.

The ranks run without a launcher (as under srun), so only the ranks themselves can notice the
death; torchrun would stop the rest on its own.
"""

import re
from pathlib import Path

import pytest

from cli_utils import SGD, run_pretrain, spawn_ranks, step_records
from fl_megatron.checkpoint import published_iterations
from fl_megatron.training.failures import PEER_LOST_EXIT_CODE

pytestmark = pytest.mark.timeout(900)

TIMEOUT_MIN = 0.25  # --distributed-timeout-minutes for these runs: 15 s
MARGIN_S = 20.0  # process exit after the failure is noticed (flush, close files)
# 2 groups of 2, a sync, a checkpoint and an evaluation every 2 steps; clipping makes the
# optimizer step a collective. The kills come in step 4, after the step-2 checkpoint.
FLAGS = [*SGD[:-2], "--clip-grad", "1.0", "--train-iters", "6", "--fl-group-size", "2", "--fl-sync-interval", "2",
         "--eval-interval", "2", "--eval-iters", "1", "--distributed-timeout-minutes", str(TIMEOUT_MIN)]
# phase -> rank killed in it (rank 0 hosts the rendezvous store: its death is a case of its own)
KILLS = {"forward-backward": 1, "optimizer-step": 2, "sync": 3, "checkpoint-write": 0, "evaluation": 1}
PEER_PHASE = re.compile(r"rank (\d): a collective failed during ([a-z-]+) of step (\d+): rank (\d) \(this node\) is gone")


def _faulty_run(tmp: Path, fault: str, phase: str, rank: int) -> list[dict]:
    """4 ranks saving every 2 steps; `rank` gets `fault` (kill or hang) in `phase` of step 4.
    Returns the ranks' results after checking the faulty rank's and the checkpoint's."""
    ckpt = tmp / f"ckpt-{fault}-{phase}"
    results = spawn_ranks(4, tmp / f"run-{fault}-{phase}", tmp / "cache", *FLAGS, "--save", str(ckpt),
                          "--save-interval", "2", env_extra={"FL_MEGATRON_FAULT": f"{fault}:{phase}:4:{rank}"},
                          timeout=240)
    faulty = results[rank]
    assert faulty["returncode"] == -9, faulty["stderr"][-2000:]  # a hung one is killed by spawn_ranks
    assert f"{'SIGKILL' if fault == 'kill' else 'SIGSTOP'} to rank {rank} during {phase} of step 4" in faulty["stderr"]
    # step 4's checkpoint is published only when the fault came after it (evaluation follows it)
    assert published_iterations(ckpt) == ([2, 4] if phase == "evaluation" else [2])
    return results


def _survivors(results: list[dict], rank: int) -> list[dict]:
    """The other ranks: each left with PEER_LOST_EXIT_CODE and one clear line, no traceback."""
    others = [r for r in results if r["rank"] != rank]
    for r in others:
        assert r["returncode"] == PEER_LOST_EXIT_CODE, f"rank {r['rank']}:\n{r['stderr'][-3000:]}"
        assert "Traceback" not in r["stderr"] and f"error: rank {r['rank']}: a collective failed during" in r["stderr"]
    return others


def test_a_rank_killed_in_any_phase_never_hangs_the_job_and_the_restart_is_exact(tmp_path):
    for phase, rank in KILLS.items():
        results = _faulty_run(tmp_path, "kill", phase, rank)
        for r in _survivors(results, rank):
            waited = r["exited"] - results[rank]["exited"]
            assert waited < TIMEOUT_MIN * 60 + MARGIN_S, f"rank {r['rank']} took {waited:.1f} s to leave"
            found = PEER_PHASE.search(r["stderr"])
            assert found, r["stderr"][-3000:]
            assert int(found[1]) == r["rank"] and int(found[4]) == rank and int(found[3]) in (4, 5)
        group_peer = results[rank ^ 1]  # same federation group: it meets the dead rank in the same phase
        assert f"during {phase} of step 4: rank {rank} (this node) is gone" in group_peer["stderr"]
    cache = tmp_path / "cache"
    reference = run_pretrain(4, tmp_path / "ref", cache, *FLAGS)
    ckpt = tmp_path / "ckpt-kill-sync"
    run_pretrain(4, tmp_path / "run-kill-sync", cache, *FLAGS, "--save", str(ckpt), "--load", str(ckpt))
    resumed = step_records(tmp_path / "run-kill-sync")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in reference]
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in reference]


def test_a_hung_rank_fails_the_job_after_the_collective_timeout(tmp_path):
    """SIGSTOP keeps the rank's sockets open: only the timeout can end the others' wait."""
    results = _faulty_run(tmp_path, "hang", "sync", 3)
    survivors = _survivors(results, 3)
    first = min(r["exited"] for r in survivors)
    assert all(r["exited"] - first < MARGIN_S for r in survivors)
    assert all("the failed rank is on another node or did not exit" in r["stderr"] for r in survivors)
    assert any("timed out" in r["stderr"].lower() or "timeout" in r["stderr"].lower() for r in survivors)


@pytest.mark.parametrize("backend", ["deepspeed", "megatron"])
def test_a_dead_rank_on_the_other_backends(tmp_path, backend):
    """DeepSpeed's and megatron-core's own collectives fail the same way: the phase is named."""
    pytest.importorskip({"deepspeed": "deepspeed", "megatron": "megatron.core"}[backend])
    results = spawn_ranks(4, tmp_path / "run", tmp_path / "cache", *FLAGS, "--backend", backend,
                          env_extra={"FL_MEGATRON_FAULT": "kill:forward-backward:4:1"}, timeout=300)
    assert results[1]["returncode"] == -9
    for r in _survivors(results, 1):
        assert r["exited"] - results[1]["exited"] < TIMEOUT_MIN * 60 + MARGIN_S
    assert "during forward-backward of step 4: rank 1 (this node) is gone" in results[0]["stderr"]


def test_a_peer_still_exiting_when_its_connection_drops_is_named(tmp_path):
    """A killed process closes its sockets before it is a zombie: the rank that saw the
    connection drop waits a moment for it instead of saying it cannot tell (a race seen in CI)."""
    import os
    import socket
    import subprocess
    import sys
    import time

    from fl_megatron.training.failures import PhaseTracker

    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])  # exits 0.5 s from now
    try:
        tracker = object.__new__(PhaseTracker)  # without the all-gather of pids: this process is rank 0
        tracker.rank, tracker.phase, tracker.step = 0, "sync", 4
        tracker.notes = tmp_path / "peer-lost"
        tracker.peers = [(socket.gethostname(), os.getpid()), (socket.gethostname(), peer.pid)]
        start = time.monotonic()
        lost = tracker.explain(RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"))
        assert "during sync of step 4: rank 1 (this node) is gone" in str(lost), lost
        assert time.monotonic() - start < 2.0
        assert (tmp_path / "peer-lost" / "rank0.txt").read_text().startswith(f"pid {os.getpid()}\n")
        # with every peer alive, an error that is no failed collective is not explained nor waited on
        tracker.peers = tracker.peers[:1]
        start = time.monotonic()
        assert tracker.explain(RuntimeError("shape mismatch")) is None and time.monotonic() - start < 0.5
    finally:
        peer.wait()


def test_which_errors_count_as_a_lost_peer():
    """A closed connection, a timeout, NCCL's remote and system errors or an aborted
    communicator are a lost peer; an NCCL error of this rank's own (invalid usage, out of
    memory) is not, nor is anything else."""
    import torch.distributed as dist

    from fl_megatron.federation.failed_collective import is_failed_collective

    lost = ["[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234",
            "Timed out waiting 900000ms for send operation to complete",
            "NCCL error in: ProcessGroupNCCL.cpp:2031, remote process exited or there was a network error, "
            "NCCL version 2.27.3\nncclRemoteError: A call failed possibly due to a network error or a remote "
            "process exiting prematurely.",
            "NCCL communicator was aborted on rank 3.",
            "[Rank 2] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE)"]
    own = ["NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage (run with NCCL_DEBUG=WARN for details), "
           "NCCL version 2.27.3\nncclInvalidUsage: This usually reflects invalid usage of NCCL library.",
           "CUDA out of memory. Tried to allocate 2.00 GiB (NCCL buffer)",
           "shape mismatch in add_"]
    assert all(is_failed_collective(RuntimeError(text)) for text in lost)
    assert not any(is_failed_collective(RuntimeError(text)) for text in own)
    assert is_failed_collective(dist.DistBackendError("anything"))
    assert not is_failed_collective(ValueError("Connection closed"))
