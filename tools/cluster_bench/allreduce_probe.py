#!/usr/bin/env python3
"""Time gloo all_reduce of one fp32 tensor; prints one JSON line per rank.

Under torchrun (RANK/WORLD_SIZE set):  torchrun ... allreduce_probe.py --size-mib 4
Standalone:  allreduce_probe.py --init-method tcp://IP:PORT --rank R --world-size W

Each timed all_reduce starts after a barrier; the result is checked (sum of rank+1).
"""

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=float, default=4.0)
    parser.add_argument("--iters", type=int, default=1)
    parser.add_argument("--init-method", default="env://")
    parser.add_argument("--rank", type=int, default=int(os.environ.get("RANK", -1)))
    parser.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", -1)))
    parser.add_argument("--timeout-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    if args.rank < 0 or args.world_size < 1:
        parser.error("give --rank and --world-size (or run under torchrun)")
    dist.init_process_group("gloo", init_method=args.init_method, rank=args.rank,
                            world_size=args.world_size,
                            timeout=datetime.timedelta(seconds=args.timeout_s))
    numel = int(args.size_mib * (1 << 20)) // 4
    expected = args.world_size * (args.world_size + 1) / 2
    seconds, ok = [], True
    for _ in range(args.iters):
        tensor = torch.full((numel,), float(args.rank + 1))
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        seconds.append(time.perf_counter() - start)
        ok = ok and bool(torch.all(tensor == expected))
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps({"rank": args.rank, "world_size": args.world_size, "bytes": numel * 4,
                      "seconds": seconds, "ok": ok}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
