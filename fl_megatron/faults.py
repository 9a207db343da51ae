"""Fault-injection points for tests: a process dies at a named point when the environment asks.

`FL_MEGATRON_FAULT=NAME:VALUE` (e.g. `checkpoint-write:5`) makes `fault_point(NAME, VALUE)` end
the process at once (exit code 86), on every rank.
`FL_MEGATRON_FAULT=kill:PHASE:STEP:RANK` (e.g. `kill:sync:4:1`) makes `kill_point(PHASE, STEP,
RANK)` SIGKILL that one rank in that phase of that step, as a lost node would; the others must
notice (see training.failures); PHASE `exchange` is inside a sync, after the vote, before the
average moves data (a peer lost mid-sync). `hang:PHASE:STEP:RANK` SIGSTOPs it instead: a rank that hangs
with its connections open, which the others can only notice by the collective timeout.
`FL_MEGATRON_FAULT=nan-shard:GROUP@STEP` (GROUP a number or `all`) makes `nan_requested(GROUP,
STEP)` true: the trainer then writes a NaN into that group's shards after that step (a sick
group for the sync to find).
Stragglers: `delay:GROUP:STEP:SECONDS` makes every rank of that group sleep that long before
that step; `slow:GROUP:SECONDS` before every step (a group on slower hardware; several may be
given); `jitter:MEAN:SEED` makes every group sleep before every step for a random time
(exponential, mean MEAN seconds, drawn from SEED, the group and the step: the same on all ranks
of a group). `lockstep` ends every step with a world all-reduce, as the loop did before the
groups stopped meeting between syncs (the benchmark's "before" row). `slow-sync:SECONDS@STEP`
makes every sync's exchange from step STEP on sleep SECONDS (a link that slowed down).
`slow-restart:GROUP:SECONDS` makes a restarted attempt of that group (TORCHELASTIC_RESTART_COUNT
> 0) sleep that long after building its backend and reading its checkpoint, before it joins the
others: the slow start of a big model.
`refuse-commit:GROUP@STEP` makes that group (elastic mode) vote down the sync of that step while
the others commit it: a split commit.
Several faults may be given, separated by commas.
"""

import os
import random
import signal
import sys

FAULT_EXIT_CODE = 86


def _faults() -> list[str]:
    return [f for f in os.environ.get("FL_MEGATRON_FAULT", "").split(",") if f]


def fault_point(name: str, value: int) -> None:
    if f"{name}:{value}" in _faults():
        print(f"fl-megatron: injected fault {name}:{value}", file=sys.stderr, flush=True)
        os._exit(FAULT_EXIT_CODE)


def kill_point(phase: str, step: int, rank: int) -> None:
    faults = _faults()
    for name, sig in (("kill", signal.SIGKILL), ("hang", signal.SIGSTOP)):
        if f"{name}:{phase}:{step}:{rank}" in faults:
            print(f"fl-megatron: injected fault: {sig.name} to rank {rank} during {phase} of step {step}",
                  file=sys.stderr, flush=True)
            os.kill(os.getpid(), sig)


def nan_requested(group: int, step: int) -> bool:
    faults = _faults()
    return f"nan-shard:{group}@{step}" in faults or f"nan-shard:all@{step}" in faults


def restart_delay_seconds(group: int) -> float:
    """How long a restarted attempt of `group` sleeps before joining (`slow-restart`)."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0"):
        return 0.0
    total = 0.0
    for fault in _faults():
        name, _, rest = fault.partition(":")
        if name == "slow-restart":
            g, seconds = rest.split(":")
            total += float(seconds) if int(g) == group else 0.0
    return total


def commit_refused(group: int, step: int) -> bool:
    """Whether this group votes down the sync of `step` whatever happened (a split commit, for tests)."""
    return f"refuse-commit:{group}@{step}" in _faults()


def delay_seconds(group: int, step: int) -> float:
    """How long this group sleeps before optimizer step `step` (1-based): delay, slow and jitter faults."""
    total = 0.0
    for fault in _faults():
        name, _, rest = fault.partition(":")
        if name == "delay":
            g, s, seconds = rest.split(":")
            total += float(seconds) if (int(g), int(s)) == (group, step) else 0.0
        elif name == "slow":
            g, seconds = rest.split(":")
            total += float(seconds) if int(g) == group else 0.0
        elif name == "jitter":
            mean, seed = rest.split(":")
            total += random.Random(f"{seed}:{group}:{step}").expovariate(1 / float(mean)) if float(mean) > 0 else 0.0
    return total


def lockstep() -> bool:
    """Whether every step ends with a world all-reduce (the coupled loop, for comparison)."""
    return "lockstep" in _faults()


def sync_delay_seconds(step: int) -> float:
    """How long the exchange of a sync launched after step `step` sleeps: `slow-sync:SECONDS@STEP`
    slows every sync from step STEP on, on every rank, as a link that slowed down would."""
    total = 0.0
    for fault in _faults():
        name, _, rest = fault.partition(":")
        if name == "slow-sync":
            seconds, start = rest.split("@")
            total += float(seconds) if step >= int(start) else 0.0
    return total
