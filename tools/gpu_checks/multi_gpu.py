"""The checks that need several GPUs (NCCL takes one GPU per rank of a communicator): every sync
mode across groups on NCCL, FL+HSDP with overlap, a dead rank, elastic groups' jobs."""

import dataclasses
import math
import os
import sys
import time

from . import common
from .common import ROOT, SMALL, Outcome, failed, finite, losses


def sync_mode(*flags: str, nproc: int = 2):
    """A federated run with these sync flags on NCCL: finite losses, identical groups after the last sync."""
    def run(ctx) -> Outcome:
        name = "sync-" + "-".join(f.strip("-") for f in flags) if flags else "sync-fp32"
        proc = common.pretrain(ctx, name, nproc, "--train-iters", "6", "--fl-sync-interval", "2", "--bf16",
                               "--fl-group-size", str(nproc // 2), *flags, "--save", str(ctx.work / name / "ckpt"))
        if proc.returncode:
            return Outcome(failed(proc))
        same = common.groups_identical(ctx.work / name / "ckpt")
        ok = finite(losses(ctx.work / name))
        return Outcome("" if same and ok else f"groups identical after the last sync: {same}, finite losses: {ok}")
    return run


def dead_rank(ctx) -> Outcome:
    """A rank killed during a sync on NCCL: the job ends (no hang) within the timeout."""
    start = time.monotonic()
    proc = common.pretrain(ctx, "dead", 2, "--train-iters", "8", "--fl-group-size", "1", "--fl-sync-interval", "2",
                           "--distributed-timeout-minutes", "1", env={"FL_MEGATRON_FAULT": "kill:sync:4:1"})
    took = time.monotonic() - start
    return Outcome("" if proc.returncode != 0 and took < 240 else f"exit {proc.returncode} after {took:.0f} s",
                   {"seconds_to_end": round(took, 1)})


def elastic_commands(work, name: str, groups: int, *flags: str, min_groups: int = 0, fault: str = "") -> list:
    """tools/elastic_launch.py's commands: a lighthouse, then one torchrun job of 1 rank per group
    (`min_groups` needed for a sync, default every group), group g on the g-th visible GPU, on
    CUDA; `fault`: FL_MEGATRON_FAULT for every group."""
    sys.path.insert(0, str(ROOT / "tools"))
    import elastic_launch

    commands = elastic_launch.elastic_commands(groups, 1, min_groups or groups, [*SMALL, "--run-dir", str(work / name), *flags],
                                               lighthouse=f"127.0.0.1:{elastic_launch.free_port()}", max_restarts=0,
                                               python=sys.executable)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    gpu = [visible[g] if len(visible) > g and visible[g] else str(g) for g in range(groups)]
    env = {"FL_MEGATRON_DEVICE": "cuda", "FL_MEGATRON_CACHE": str(work / "cache"),
           **({"FL_MEGATRON_FAULT": fault} if fault else {})}
    return commands[:1] + [dataclasses.replace(c, env={**c.env, **env, "CUDA_VISIBLE_DEVICES": gpu[g]})
                           for g, c in enumerate(commands[1:])]


def elastic(ctx, name: str, groups: int, *flags: str, min_groups: int = 0, fault: str = "") -> dict:
    """Run elastic_commands(...) with tools/elastic_launch.py; {group name: exit code}, logs in
    work/name/launch/."""
    import elastic_launch  # on the path since elastic_commands

    commands = elastic_commands(ctx.work, name, groups, *flags, min_groups=min_groups, fault=fault)
    return elastic_launch.run_elastic(commands, ctx.work / name / "launch", ctx.left(), {})


def elastic_sync(ctx) -> Outcome:
    """Elastic mode on NCCL: 2 groups, each its own torchrun job on its own GPU, meeting at syncs
    through the lighthouse: both finish, every sync has both, and their shards agree bit for bit
    after each (fp32 FedAvg, --fl-sync-digest)."""
    work = ctx.work
    codes = elastic(ctx, "elastic", 2, "--train-iters", "6", "--fl-sync-interval", "2", "--bf16", "--fl-sync-digest")
    if not codes or any(code != 0 for code in codes.values()):
        logs = sorted((work / "elastic" / "launch").glob("group_*.log"))
        last = [log.read_text().strip().splitlines()[-1:] for log in logs]
        return Outcome(f"exit codes {codes}: {[line[0][:160] for line in last if line]}")
    records = [common.read_records(work / "elastic" / f"group_{g:05d}" / "metrics.jsonl") for g in range(2)]
    syncs = [{r["step"]: r for r in rs if "groups" in r} for rs in records]
    if not sorted(syncs[0]) == sorted(syncs[1]) == [2, 4, 6]:
        return Outcome(f"sync steps {[sorted(s) for s in syncs]}, expected [2, 4, 6] in both groups")
    for step in (2, 4, 6):
        if [s[step]["groups"] for s in syncs] != [[0, 1], [0, 1]]:
            return Outcome(f"step {step}: the groups met as {[s[step]['groups'] for s in syncs]}")
        if syncs[0][step]["shard_digests"] != syncs[1][step]["shard_digests"]:
            return Outcome(f"the groups' shards differ after the sync of step {step}")
    ok = all(math.isfinite(r["loss"]) for rs in records for r in rs if "loss" in r)
    return Outcome("" if ok else "a loss is not finite")



def elastic_peer_lost_mid_sync(ctx) -> Outcome:
    """Elastic mode on NCCL, a peer killed inside a sync (after the vote, before data moves): NCCL
    raises nothing, so group 0 must abort the sync by --fl-peer-timeout-seconds (torchft's timers
    abort the quorum's communicator), vote it down and train on alone, without restarting."""
    work, bound = ctx.work, 20
    codes = elastic(ctx, "elastic-lost", 2, "--train-iters", "8", "--fl-sync-interval", "2", "--bf16",
                    "--fl-peer-timeout-seconds", str(bound), min_groups=1, fault="kill:exchange:4:1")
    if codes.get("group_0") != 0 or codes.get("group_1") == 0:
        logs = sorted((work / "elastic-lost" / "launch").glob("group_*.log"))
        last = [log.read_text().strip().splitlines()[-1:] for log in logs]
        return Outcome(f"exit codes {codes} (group 0 must end 0, group 1 not): "
                       f"{[line[0][:160] for line in last if line]}")
    records = common.read_records(work / "elastic-lost" / "group_00000" / "metrics.jsonl")
    syncs = {r["step"]: r for r in records if "groups" in r}
    lost = syncs.get(4, {})
    if lost.get("sync_committed") is not False:
        return Outcome(f"the sync of step 4 was not voted down: {lost}")
    if lost["sync_seconds"] > bound + 30:
        return Outcome(f"the sync of step 4 took {lost['sync_seconds']:.0f} s, past the {bound} s bound")
    if syncs.get(8, {}).get("groups") != [0]:
        return Outcome(f"group 0 did not sync alone at step 8: {syncs.get(8)}")
    return Outcome("", {"lost_sync_seconds": round(lost["sync_seconds"], 1)})
