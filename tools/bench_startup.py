#!/usr/bin/env python3
"""Start-up cost of the singleton process groups DeepSpeed and megatron-core ask for, per rank,
measured side by side on N CPU ranks (gloo): every rank creating every rank's singleton (what
the backends did: world-size group creations per rank) against each rank creating its own with
local synchronisation (what they do now).

  python tools/bench_startup.py --ranks 16 32 64
"""

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist  # noqa: E402

from fl_megatron.backends.common import own_singleton_group  # noqa: E402
from fl_megatron.local_ranks import run_ranks  # noqa: E402


def _slowest(seconds: float) -> float:
    import torch

    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def job(rank: int, world: int) -> dict:
    dist.barrier()
    start = time.perf_counter()
    dist.new_subgroups(group_size=1)
    every = _slowest(time.perf_counter() - start)
    dist.barrier()
    start = time.perf_counter()
    own_singleton_group()
    own = _slowest(time.perf_counter() - start)
    return {"every_rank_each": every, "own_only": own}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 32, 64])
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"{'ranks':>6} {'every singleton on every rank':>30} {'own singleton only':>19} {'ratio':>7}", flush=True)
    for n in args.ranks:
        r = run_ranks(n, job, timeout=1200)[0]
        print(f"{n:>6} {r['every_rank_each'] * 1e3:>27.1f} ms {r['own_only'] * 1e3:>16.1f} ms "
              f"{r['every_rank_each'] / max(r['own_only'], 1e-9):>6.1f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
