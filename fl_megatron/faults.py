"""Fault-injection points for tests: a process dies at a named point when the environment asks.

`FL_MEGATRON_FAULT=NAME:VALUE` (e.g. `checkpoint-write:5`) makes `fault_point(NAME, VALUE)` end
the process at once (exit code 86), on every rank.
`FL_MEGATRON_FAULT=kill:PHASE:STEP:RANK` (e.g. `kill:sync:4:1`) makes `kill_point(PHASE, STEP,
RANK)` SIGKILL that one rank in that phase of that step, as a lost node would; the others must
notice (see training.failures). `hang:PHASE:STEP:RANK` SIGSTOPs it instead: a rank that hangs
with its connections open, which the others can only notice by the collective timeout.
`FL_MEGATRON_FAULT=nan-shard:GROUP@STEP` (GROUP a number or `all`) makes `nan_requested(GROUP,
STEP)` true: the trainer then writes a NaN into that group's shards after that step (a sick
group for the sync to find).
"""

import os
import signal
import sys

FAULT_EXIT_CODE = 86


def fault_point(name: str, value: int) -> None:
    if os.environ.get("FL_MEGATRON_FAULT") == f"{name}:{value}":
        print(f"fl-megatron: injected fault {name}:{value}", file=sys.stderr, flush=True)
        os._exit(FAULT_EXIT_CODE)


def kill_point(phase: str, step: int, rank: int) -> None:
    fault = os.environ.get("FL_MEGATRON_FAULT")
    for name, sig in (("kill", signal.SIGKILL), ("hang", signal.SIGSTOP)):
        if fault == f"{name}:{phase}:{step}:{rank}":
            print(f"fl-megatron: injected fault: {sig.name} to rank {rank} during {phase} of step {step}",
                  file=sys.stderr, flush=True)
            os.kill(os.getpid(), sig)


def nan_requested(group: int, step: int) -> bool:
    return os.environ.get("FL_MEGATRON_FAULT") in (f"nan-shard:{group}@{step}", f"nan-shard:all@{step}")
