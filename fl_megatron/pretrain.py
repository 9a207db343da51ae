"""Command line: `torchrun --nproc-per-node N -m fl_megatron.pretrain [flags]`.

`--dry-run` validates and plans in one process, for any --world-size, without starting anything
(it opens the data files and the checkpoint to load, as the run would).
Everything a user can get wrong (flags, data files, checkpoints, Hugging Face directories) is
checked here, on every rank, before any process group exists.
"""

import dataclasses
import os
import sys
import time
from typing import Optional, Sequence

# A rank that is not the reporter waits this long before exiting with a configuration error, so
# that the reporter's message reaches the launcher before it kills the job's other processes.
REPORTER_HEAD_START_S = 3.0


def main(argv: Optional[Sequence[str]] = None) -> int:
    import torch

    from .config.flags import parse_args
    from .torch_version import torch_version_problem
    from .training.launch import read_launch_env

    problem = torch_version_problem(torch.__version__)
    if problem:
        return _fail(problem)
    try:
        cfg, ns = parse_args(argv)
        env = read_launch_env()
    except ValueError as e:
        return _fail(str(e))
    dry_run = getattr(ns, "dry_run", False)
    if cfg.parallel.world_size is not None:
        if dry_run:  # a dry run plans for --world-size ranks, as if the launcher had started them
            env = dataclasses.replace(env, rank=0, world_size=cfg.parallel.world_size)
        elif cfg.parallel.world_size != env.world_size:
            return _fail(f"--world-size {cfg.parallel.world_size} does not match the launcher's "
                         f"WORLD_SIZE={env.world_size}")
    if cfg.federation.elastic:  # the launcher's world is one group's job; `world` becomes the federation's
        try:
            env = _elastic_env(cfg, env)
        except ValueError as e:
            return _fail(str(e))
        if not dry_run:
            from .elastic.refusal import restart_refusal

            refused = restart_refusal(cfg.training.run_dir)
            if refused:  # torchrun restarted a group the federation refused: a restart cannot help
                return _fail(f"not restarting: this job's previous attempt was refused: {refused}")
    world = env.world_size
    # a dry run plans for --world-size, not for the processes that happen to run it
    planning = dry_run and (cfg.parallel.world_size or "LOCAL_WORLD_SIZE" not in os.environ)
    local_world = None if planning else env.local_world_size
    from .config.resolved import resolve
    try:
        run = resolve(cfg, world, local_world)
    except ValueError as e:
        return _fail(str(e))
    rpn = cfg.parallel.ranks_per_node
    if not planning and rpn is not None and env.local_world_from_launcher and rpn != env.local_world_size:
        return _fail(f"--ranks-per-node {rpn} does not match the {env.local_world_size} processes per node the "
                     "launcher started; drop the flag or launch that many per node")
    from .backends import check_backend_package
    from .training.dashboards import check_dashboard_packages
    try:
        if not dry_run:
            check_backend_package(cfg.parallel.backend)
            check_dashboard_packages(cfg.training)
            env.collectives  # noqa: B018  (a GPU per rank or FL_MEGATRON_DEVICE=cpu, and the library: said first)
        _check_sources(run)
        samples = _open_data(run)
    except (ValueError, OSError) as e:
        return _fail(str(e))
    try:  # what this rank will unpickle (the dry run: every group's): ranks may differ, all report
        _check_checkpoint_files(run, None if dry_run else env.rank)
    except (ValueError, OSError) as e:
        return _fail(str(e), every_rank=True)
    if dry_run:
        from .training.dry_run import dry_run_report
        print(dry_run_report(run))
        return 0
    return _train(run, env, samples)


def _elastic_env(cfg, env):
    """Elastic mode: the group slot and the lighthouse from flags or the environment, this job's
    run directory made the group's own; returns where this process sits in the federation."""
    from pathlib import Path

    fed = cfg.federation
    if fed.group_id is None and os.environ.get("FL_GROUP_ID", "") != "":
        value = os.environ["FL_GROUP_ID"]
        if not value.isdigit():
            raise ValueError(f"FL_GROUP_ID={value!r} is not a group slot number")
        fed.group_id = int(value)
    if fed.lighthouse is None and os.environ.get("TORCHFT_LIGHTHOUSE"):
        fed.lighthouse = os.environ["TORCHFT_LIGHTHOUSE"]
    missing = [what for what, value in (("--fl-group-id (or FL_GROUP_ID)", fed.group_id),
                                        ("--fl-lighthouse (or TORCHFT_LIGHTHOUSE)", fed.lighthouse),
                                        ("--fl-num-groups (or --fl-group-sizes)", fed.group_slots))
               if value is None]
    if missing:
        raise ValueError("elastic mode (--fl-elastic) needs " + ", ".join(missing))
    problem = _shared_rendezvous_store_problem(os.environ)
    if problem:
        raise ValueError(problem)
    if fed.group_size not in (None, env.world_size):
        raise ValueError(f"elastic mode: each job is one federation group, but --fl-group-size {fed.group_size} "
                         f"differs from the job's {env.world_size} ranks")
    fed.validate()
    sizes = fed.unequal_sizes[0] if fed.group_sizes else None
    if sizes is not None and sizes[fed.group_id] != env.world_size:
        raise ValueError(f"elastic mode: --fl-group-sizes {fed.group_sizes} gives group {fed.group_id} "
                         f"{sizes[fed.group_id]} ranks, but this job has {env.world_size}")
    own = f"group_{fed.group_id:05d}"  # each group's records and checkpoints in a directory of its own
    cfg.training.run_dir = str(Path(cfg.training.run_dir) / own)
    for key in ("save", "load"):
        if getattr(cfg.checkpoint, key) is not None:
            setattr(cfg.checkpoint, key, str(Path(getattr(cfg.checkpoint, key)) / own))
    return env.in_federation(fed.group_id, fed.group_slots, sizes)


def _shared_rendezvous_store_problem(environ) -> Optional[str]:
    """Elastic mode under torchrun with restarts: a restarted rank must not read its dead
    predecessor's address from a rendezvous store shared across restarts. torchrun's c10d
    rendezvous shares it unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; its static rendezvous
    (--master-addr/--master-port, no --rdzv-backend) shares it whatever that variable says."""
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or environ.get("TORCHELASTIC_MAX_RESTARTS", "0") == "0":
        return None
    lead = ("elastic mode: torchrun restarts this group (--max-restarts), but its workers share the rendezvous "
            "store across restarts, where a restarted rank can read its dead predecessor's address")
    if environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1":
        return (f"{lead}: this is torchrun's static rendezvous (--master-addr/--master-port without "
                "--rdzv-backend), which shares its store whatever TORCH_DISABLE_SHARE_RDZV_TCP_STORE says; launch "
                "with --rdzv-backend c10d --rdzv-endpoint HOST:PORT (or --standalone on one node), keeping "
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
    return (f"{lead}; launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment and the c10d "
            "rendezvous (--rdzv-backend c10d, or --standalone on one node), as tools/elastic_launch.py and the "
            "SLURM recipes do")


def _train(run, env, samples) -> int:
    """Train to the end; every failure that can be explained ends in one line and an exit code:
    2 (bad data met in training, a checkpoint that cannot be written), 3 (every group sick),
    PEER_LOST_EXIT_CODE (a peer died or hung: see training.failures), TOO_FEW_GROUPS_EXIT_CODE
    (elastic mode: fewer live groups than --fl-min-groups met within the quorum timeout)."""
    import torch.distributed as dist

    from .checkpoint import CheckpointReadError, CheckpointWriteError
    from .error_text import one_line
    from .federation.failed_collective import is_failed_collective
    from .federation.vote import AllGroupsSick
    from .federation.membership import TooFewGroups
    from .training.failures import PEER_LOST_EXIT_CODE, TOO_FEW_GROUPS_EXIT_CODE, PeerLost
    from .training.run_data import DataError
    from .training.trainer import Trainer

    try:
        trainer, abandoned = Trainer(run, env, samples), False
    except CheckpointReadError as e:  # found by the ranks reading that group: the others see them go
        print(f"fl_megatron.pretrain: error: rank {env.rank}: {e}", file=sys.stderr, flush=True)
        return 2
    except TooFewGroups as e:  # at start-up: nothing trained, nothing to save
        if env.job_rank == 0:
            print(f"fl_megatron.pretrain: error: group {run.cfg.federation.group_id}: {e} (at start-up); stopping",
                  file=sys.stderr, flush=True)
        return TOO_FEW_GROUPS_EXIT_CODE
    except RuntimeError as e:  # a peer died or hung while the job was starting
        if not is_failed_collective(e):
            raise
        print(f"fl_megatron.pretrain: error: rank {env.rank}: a collective failed during start-up "
              f"({one_line(e)[:240]}); restart the job", file=sys.stderr, flush=True)
        return PEER_LOST_EXIT_CODE
    try:
        trainer.train()  # ends with a barrier: every rank leaves together
    except AllGroupsSick as e:  # every rank decided it together: no rank is left waiting
        if env.rank == 0:
            print(f"fl_megatron.pretrain: error: {e}", file=sys.stderr, flush=True)
        return 3
    except TooFewGroups as e:  # every rank of the group waited out the quorum, saved (--save) and summed up
        if env.job_rank == 0:
            print(f"fl_megatron.pretrain: error: group {run.cfg.federation.group_id}: {e}; stopped"
                  + (" after saving" if run.cfg.checkpoint.save else " (no --save: nothing saved)"),
                  file=sys.stderr, flush=True)
        return TOO_FEW_GROUPS_EXIT_CODE
    except (DataError, CheckpointWriteError) as e:  # if only this rank finds it, the others see it go (PeerLost)
        print(f"fl_megatron.pretrain: error: rank {env.rank}: {e}", file=sys.stderr, flush=True)
        abandoned = True
        return 2
    except PeerLost as e:  # leave now: the process group cannot be closed cleanly any more
        print(f"fl_megatron.pretrain: error: {e}", file=sys.stderr, flush=True)
        abandoned = True
        return PEER_LOST_EXIT_CODE
    finally:
        if abandoned:
            trainer.abandon()
        else:
            trainer.close()
            if dist.is_initialized():
                dist.destroy_process_group()
    return 0


def _check_sources(run) -> None:
    """The checkpoint --load would resume from, or the --init-from-hf directory, fits the run."""
    from .checkpoint import find_checkpoint, resume_source, source_groups

    options = run.cfg.checkpoint
    source = resume_source(options)
    if source is not None:
        _, meta = find_checkpoint(*source)
        source_groups(meta, run)
    elif options.init_from_hf:
        from .convert.hf_init import check_hf_source

        check_hf_source(options.init_from_hf, run.cfg.model)


def _check_checkpoint_files(run, rank: Optional[int]) -> None:
    """The pickles `rank` (None: every rank) would read from the checkpoint --load resumes from
    open under the allowlisting unpickler (see backends.pickle_guard)."""
    from .backends.pickle_guard import check_group_pickles
    from .checkpoint import find_checkpoint, resume_source, source_groups
    from .checkpoint.paths import group_dir
    from .topology import coords

    source = resume_source(run.cfg.checkpoint)
    if source is None:
        return
    path, meta = find_checkpoint(*source)
    sources, _ = source_groups(meta, run)
    lay = run.layout
    groups = range(lay.num_groups) if rank is None else [lay.coords(rank)[0] if hasattr(lay, "group_sizes")
                                                         else coords(lay, rank)[0]]
    for group in sorted({sources[g] for g in groups}):
        check_group_pickles(meta["backend"], group_dir(path, group))


def _open_data(run):
    """Open every data file and check the splits (indexed data only; None otherwise)."""
    if run.cfg.data.source != "indexed":
        return None
    from .data.sources import run_samples

    t = run.cfg.training
    return run_samples(run.cfg.data, t.seq_length, t.seed, run.cfg.model.vocab_size, bool(t.eval_iters))


def _local_rank() -> int:
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def _fail(message: str, every_rank: bool = False) -> int:
    """Report a configuration error and exit 2. Every rank finds the same error; local rank 0
    of each node prints it (once per node) and exits at once. The other ranks give it a head
    start before exiting, since a launcher (torchrun, the deepspeed launcher) kills the rest
    of the job as soon as one process fails: the reporter must not be the one killed.
    `every_rank`: an error only some ranks find; each of them prints it."""
    if every_rank or _local_rank() == 0:
        print(f"fl_megatron.pretrain: error: {message}", file=sys.stderr, flush=True)
    else:
        time.sleep(REPORTER_HEAD_START_S)
    return 2


def run_and_exit() -> None:
    """Entry point for launched processes.

    After a clean finish (files written, process group destroyed) the process leaves with
    os._exit: gloo's threads occasionally abort ("terminate called without an active
    exception") during interpreter finalisation, which would turn a finished run into a
    failed rank under torchrun.
    """
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run_and_exit()
