"""Run a function on N local CPU ranks (gloo) in spawned processes, with timeouts at every level.

For tests and benchmarks on one machine. The child's traceback is re-raised in the parent;
a hang becomes a failure after `timeout` (the process group also times out on its own).
"""

import datetime
import os
import queue as queue_module
import tempfile
import time
import traceback

import torch.multiprocessing as mp

PG_TIMEOUT_S = 120


def _child(rank: int, world: int, store: str, fn, args, queue) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world))
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
        result = fn(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
        queue.put((rank, "ok", result))
    except BaseException:  # report everything, including assertion errors
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(world: int, fn, *args, timeout: float = 300.0) -> list:
    """Run fn(rank, world, *args) on `world` processes; return the results in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_child, args=(r, world, store, fn, args, queue), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        results, errors = {}, []
        deadline = time.monotonic() + timeout
        try:
            while len(results) + len(errors) < world:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{world}-rank job timed out after {timeout:.0f} s "
                                       f"({len(results)} ranks finished)")
                try:
                    rank, status, payload = queue.get(timeout=min(remaining, 5.0))
                except queue_module.Empty:
                    dead = [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
                    if dead and not errors:
                        raise RuntimeError(f"rank process died with exit code {dead[0].exitcode}") from None
                    continue
                if status == "ok":
                    results[rank] = payload
                else:
                    errors.append(f"rank {rank}:\n{payload}")
                    break
        finally:
            for p in procs:
                p.join(timeout=10 if not errors else 1)
                if p.is_alive():
                    p.kill()
        if errors:
            raise AssertionError("a rank failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world)]
