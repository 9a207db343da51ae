"""The torchft peer's settings: fl_megatron.pretrain's flags plus the torchft ones, and the
replica group this process belongs to (from the environment torchft_launch sets).

The peer trains the run that `fl_megatron.pretrain --fl-group-size G` trains on G * F ranks:
one torchrun job of G ranks per replica group, F = NUM_REPLICA_GROUPS groups, global rank
r = REPLICA_GROUP_ID * G + local rank, H = --fl-sync-interval.
"""

import argparse
import copy
import os
from dataclasses import dataclass
from typing import Optional, Sequence

from fl_megatron.config.flags import parse_args
from fl_megatron.config.resolved import ResolvedRun, resolve
from fl_megatron.training.launch import LaunchEnv

ALGORITHMS = ("localsgd", "diloco")


@dataclass(frozen=True)
class PeerRun:
    """What one peer process needs to know."""

    run: ResolvedRun          # the whole federated run (G * F ranks): batches, tokens, schedule
    local_run: ResolvedRun    # this replica group alone (G ranks, one group): the FSDP2 backend's view
    algorithm: str
    outer_lr: float
    outer_momentum: float
    advertise_host: str
    lighthouse: str
    min_replicas: int         # replica groups a sync needs (torchft's min_replica_size)
    replica_group: int
    num_groups: int
    group_size: int
    group_rank: int

    @property
    def global_rank(self) -> int:
        return self.replica_group * self.group_size + self.group_rank

    @property
    def world_size(self) -> int:
        return self.group_size * self.num_groups

    @property
    def system(self) -> str:
        return f"torchft-{self.algorithm}"


def _peer_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="localsgd")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo outer SGD learning rate")
    parser.add_argument("--outer-momentum", type=float, default=0.9,
                        help="DiLoCo outer SGD momentum (Nesterov when > 0)")
    parser.add_argument("--advertise-host", default="127.0.0.1",
                        help="this node's address: the Manager's hostname= and the store address")
    parser.add_argument("--min-replicas", type=int,
                        help="replica groups a sync needs (default: all); fewer let the others go on "
                             "while a group is lost, and a restarted group heals from them")
    return parser


def read_replica_env() -> tuple[int, int, str]:
    """(REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, TORCHFT_LIGHTHOUSE); ValueError naming what is wrong."""
    errors, values = [], {}
    for name in ("REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS"):
        raw = os.environ.get(name, "")
        if not raw.isdigit():
            errors.append(f"{name}={raw!r} must be a non-negative integer")
        else:
            values[name] = int(raw)
    lighthouse = os.environ.get("TORCHFT_LIGHTHOUSE", "")
    if not lighthouse:
        errors.append("TORCHFT_LIGHTHOUSE is not set (e.g. http://127.0.0.1:29510)")
    if not errors and not 0 <= values["REPLICA_GROUP_ID"] < values["NUM_REPLICA_GROUPS"]:
        errors.append(f"REPLICA_GROUP_ID={values['REPLICA_GROUP_ID']} is outside "
                      f"NUM_REPLICA_GROUPS={values['NUM_REPLICA_GROUPS']}")
    if errors:
        raise ValueError("; ".join(errors))
    return values["REPLICA_GROUP_ID"], values["NUM_REPLICA_GROUPS"], lighthouse


def _unsupported(cfg, group_size: int, num_groups: int) -> list[str]:
    """Settings of fl_megatron.pretrain that this harness does not reproduce."""
    fed, ck = cfg.federation, cfg.checkpoint
    problems = []
    if fed.group_size is not None and fed.group_size != group_size:
        problems.append(f"--fl-group-size {fed.group_size} differs from the {group_size} ranks of this torchrun job")
    if fed.num_groups is not None and fed.num_groups != num_groups:
        problems.append(f"--fl-num-groups {fed.num_groups} differs from NUM_REPLICA_GROUPS={num_groups}")
    if fed.hsdp_shard_size not in (None, group_size):
        problems.append("HSDP inside a group (--fl-hsdp-shard-size) is not offered by torchft")
    if fed.sync_interval < 1 or fed.disable_sync:
        problems.append("torchft needs a sync interval H >= 1 (--fl-sync-interval)")
    if cfg.parallel.backend != "fsdp2":
        problems.append(f"backend {cfg.parallel.backend!r}: the torchft peer runs FSDP2 only")
    if cfg.training.eval_interval:
        problems.append("--eval-interval: the peer evaluates only at the end (use --eval-interval 0)")
    if ck.save or ck.load or ck.exit_interval or ck.exit_duration_in_mins or ck.exit_signal_handler:
        problems.append("checkpointing and early exit (--save, --load, --exit-*) are not supported by the peer")
    return problems


def parse_peer_args(argv: Optional[Sequence[str]], env: LaunchEnv, replica_group: int, num_groups: int,
                    lighthouse: str) -> PeerRun:
    """Resolve the flags for this replica group; ValueError lists every problem."""
    ns, rest = _peer_parser().parse_known_args(argv)
    if ns.outer_lr <= 0 or not 0 <= ns.outer_momentum < 1:
        raise ValueError(f"--outer-lr {ns.outer_lr} must be > 0 and --outer-momentum {ns.outer_momentum} "
                         "must lie in [0, 1)")
    if ns.min_replicas is not None and not 1 <= ns.min_replicas <= num_groups:
        raise ValueError(f"--min-replicas {ns.min_replicas} must lie in [1, {num_groups}]")
    cfg, _ = parse_args(rest)
    group_size = env.world_size
    problems = _unsupported(cfg, group_size, num_groups)
    if problems:
        raise ValueError("; ".join(problems))
    cfg.federation.group_size, cfg.federation.num_groups = group_size, None
    cfg.parallel.world_size = None
    world = group_size * num_groups
    run = resolve(cfg, world, group_size)
    local_cfg = copy.deepcopy(cfg)
    # one group of G ranks, with the accumulation steps the whole run resolved to
    local_cfg.training.global_batch_size = None
    local_cfg.training.gradient_accumulation_steps = run.accumulation
    local_cfg.federation.group_size = group_size
    local_run = resolve(local_cfg, group_size, group_size)
    return PeerRun(run=run, local_run=local_run, algorithm=ns.algorithm, outer_lr=ns.outer_lr,
                   outer_momentum=ns.outer_momentum, advertise_host=ns.advertise_host, lighthouse=lighthouse,
                   min_replicas=num_groups if ns.min_replicas is None else ns.min_replicas,
                   replica_group=replica_group, num_groups=num_groups, group_size=group_size,
                   group_rank=env.rank)
