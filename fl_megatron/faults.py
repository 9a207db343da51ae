"""Fault-injection points for tests: a process dies at a named point when the environment asks.

`FL_MEGATRON_FAULT=NAME:VALUE` (e.g. `checkpoint-write:5`) makes `fault_point(NAME, VALUE)` end
the process at once, as a kill would. Unset, a point costs one environment lookup.
`FL_MEGATRON_FAULT=nan-shard:GROUP@STEP` (GROUP a number or `all`) makes `nan_requested(GROUP,
STEP)` true: the trainer then writes a NaN into that group's shards after that step (a sick
group for the sync to find).
"""

import os
import sys

FAULT_EXIT_CODE = 86


def fault_point(name: str, value: int) -> None:
    if os.environ.get("FL_MEGATRON_FAULT") == f"{name}:{value}":
        print(f"fl-megatron: injected fault {name}:{value}", file=sys.stderr, flush=True)
        os._exit(FAULT_EXIT_CODE)


def nan_requested(group: int, step: int) -> bool:
    return os.environ.get("FL_MEGATRON_FAULT") in (f"nan-shard:{group}@{step}", f"nan-shard:all@{step}")
