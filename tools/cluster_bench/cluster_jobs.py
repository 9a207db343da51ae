"""Running one multi-node torchrun job on an EmulatedCluster: one torchrun per node."""

import dataclasses
import os
import subprocess
import sys
import tempfile
import time


@dataclasses.dataclass
class JobResult:
    """Outcome of run_job. counters: per-node LinkCounters delta (after - before), None in
    loopback mode. elapsed_seconds: from the first start until all exited (or the job was
    stopped)."""

    returncodes: list[int]
    stdout_tails: list[str]
    stderr_tails: list[str]
    elapsed_seconds: float
    counters: list | None
    timed_out: bool

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(rc == 0 for rc in self.returncodes)


def torchrun_command(cluster, node: int, nnodes: int, nproc_per_node: int, master_port: int,
                     module_and_args: list[str], *, python: str = sys.executable) -> list[str]:
    """argv of torchrun (`python -m torch.distributed.run`, static rendezvous at node 0) for
    one node; module_and_args is e.g. ["-m", "fl_megatron.pretrain", "--flag", ...] or
    ["script.py", ...]. python defaults to the running interpreter (the venv's)."""
    return [python, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
            "--node-rank", str(node), "--nproc-per-node", str(nproc_per_node),
            "--master-addr", cluster.node_ip(0), "--master-port", str(master_port),
            *module_and_args]


def _tail(path: str, chars: int) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 4 * chars))
        return f.read().decode("utf-8", "replace")[-chars:]


def run_job(cluster, ranks_per_node: int, args: list[str], timeout: float, *,
            master_port: int | None = None, env: dict | None = None, log_dir: str | None = None,
            tail_chars: int = 4000, python: str = sys.executable) -> JobResult:
    """Start one torchrun per node of `cluster` (args as in torchrun_command), wait for all;
    stop all of them as soon as one fails or `timeout` seconds pass. Full logs go to
    `log_dir` (node<k>.out/.err) when given, else to a temporary folder."""
    with tempfile.TemporaryDirectory(prefix="flm-job-") as tmp:
        logs = log_dir or tmp
        os.makedirs(logs, exist_ok=True)
        port = master_port or cluster.pick_port()
        before = cluster.counters()
        procs, timed_out = [], False
        start = time.perf_counter()
        try:
            for k in range(cluster.nodes):
                argv = torchrun_command(cluster, k, cluster.nodes, ranks_per_node, port, args,
                                        python=python)
                with open(f"{logs}/node{k}.out", "wb") as out, \
                        open(f"{logs}/node{k}.err", "wb") as err:
                    procs.append(cluster.popen(k, argv, env=env, stdout=out, stderr=err,
                                               stdin=subprocess.DEVNULL))
            while True:
                codes = [p.poll() for p in procs]
                if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                    break
                if time.perf_counter() - start > timeout:
                    timed_out = True
                    break
                time.sleep(0.05)
            elapsed = time.perf_counter() - start
        finally:
            if any(p.poll() is None for p in procs):
                cluster.stop(procs)
        after = cluster.counters()
        delta = None if before is None else [a - b for a, b in zip(after, before)]
        return JobResult(
            returncodes=[p.returncode for p in procs],
            stdout_tails=[_tail(f"{logs}/node{k}.out", tail_chars) for k in range(cluster.nodes)],
            stderr_tails=[_tail(f"{logs}/node{k}.err", tail_chars) for k in range(cluster.nodes)],
            elapsed_seconds=elapsed, counters=delta, timed_out=timed_out)
