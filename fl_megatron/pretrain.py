"""Command line: `torchrun --nproc-per-node N -m fl_megatron.pretrain [flags]`.

`--dry-run` validates and plans in one process, for any --world-size, without starting anything.
"""

import os
import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .config.flags import parse_args
    from .training.launch import read_launch_env

    cfg, ns = parse_args(argv)
    env = read_launch_env()
    dry_run = getattr(ns, "dry_run", False)
    world = env.world_size
    if cfg.parallel.world_size is not None:
        if not dry_run and cfg.parallel.world_size != env.world_size:
            return _fail(f"--world-size {cfg.parallel.world_size} does not match the launcher's "
                         f"WORLD_SIZE={env.world_size}")
        world = cfg.parallel.world_size
    # a dry run plans for --world-size, not for the processes that happen to run it
    planning = dry_run and (cfg.parallel.world_size or "LOCAL_WORLD_SIZE" not in os.environ)
    local_world = None if planning else env.local_world_size
    try:
        layout = cfg.validate(world, local_world)
        accum = cfg.accumulation_steps(world)
    except ValueError as e:
        return _fail(str(e))
    rpn = cfg.parallel.ranks_per_node
    if not planning and rpn is not None and env.local_world_from_launcher and rpn != env.local_world_size:
        return _fail(f"--ranks-per-node {rpn} does not match the {env.local_world_size} processes per node the "
                     "launcher started; drop the flag or launch that many per node")
    if dry_run:
        from .training.dry_run import dry_run_report
        print(dry_run_report(cfg, layout, accum))
        return 0
    samples = None
    if cfg.data.source == "indexed":
        from .data.sources import run_samples

        t = cfg.training
        try:  # open every data file and check the splits before any process group exists
            samples = run_samples(cfg.data, t.seq_length, t.seed, cfg.model.vocab_size, bool(t.eval_iters))
        except (ValueError, OSError) as e:
            return _fail(str(e))
    from .training.trainer import Trainer
    import torch.distributed as dist

    trainer = Trainer(cfg, env, layout, samples)
    try:
        trainer.train()
        # Leave together: a rank tearing down gloo while a peer is still in its last
        # collectives can abort the peer at exit.
        dist.barrier()
    finally:
        trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _fail(message: str) -> int:
    """Report a configuration error (once per job: every rank finds the same one) and exit 2."""
    if os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        print(f"fl_megatron.pretrain: error: {message}", file=sys.stderr)
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
