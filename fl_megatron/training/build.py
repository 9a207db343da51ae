"""Everything one rank's run is made of, built from the config in the order every rank follows
(each step that makes process groups or meets other ranks is collective): the process group,
the run's files and banner, the data, the groups (and in elastic mode the tier to the other
groups), the link probe and tuner, the backend, the engine, the checkpointer and its resume, the
meeting with the live groups, and the records."""

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional

import torch

from ..backends import make_backend
from ..checkpoint import Checkpointer
from ..config import ResolvedRun
from ..config.flags import config_to_json
from ..federation import CommLedger, FederationEngine, ProcessGroups
from ..faults import restart_delay_seconds
from ..federation.contract import TrainingBackend
from .checkpoint_policy import CheckpointPolicy
from .console import batch_line, federation_line, say
from .dashboards import Dashboards, RunRecords
from .determinism import make_deterministic
from .failures import PhaseTracker
from .group_rounds import GroupRounds, group_rounds
from .initial_values import initial_values_for
from .launch import LaunchEnv, init_distributed
from .reporter import Reporter
from .run_data import open_run_data
from .run_files import RunFiles
from .session import OneWorldSession
from .traffic import TrafficMeter
from .tuning_hook import TuningHook, start_tuning


@dataclass
class RunParts:
    """One rank's run, built."""

    run: ResolvedRun
    env: LaunchEnv
    phases: PhaseTracker
    files: RunFiles
    train_source: object      # the training batches (run_data)
    valid_samples: object     # the held-out samples
    session: object           # OneWorldSession or elastic.session.ElasticSession
    groups: ProcessGroups
    tuning: TuningHook
    backend: TrainingBackend
    ledger: CommLedger
    engine: FederationEngine
    checkpointer: Checkpointer
    start_step: int           # this group's own step count (per-group step counts: its own; else the run's)
    reporter: Reporter
    checkpoints: CheckpointPolicy
    traffic: TrafficMeter
    rounds: Optional[GroupRounds] = None  # per-group step counts: this group's rounds


def build_run(run: ResolvedRun, env: LaunchEnv, samples=None) -> RunParts:
    """Build a rank's run (collective: every rank of the job calls it). `samples`: (train, valid)
    samples already opened by the caller, or None to open them."""
    cfg, t = run.cfg, run.cfg.training
    is_writer = env.job_rank == 0  # elastic mode: each group's job writes its own run directory
    speak: Callable[[str], None] = lambda text: say(text, is_writer)  # noqa: E731
    if t.deterministic_mode:
        make_deterministic()  # before NCCL or any matrix product touches the GPU
    init_distributed(env, cfg.parallel.distributed_timeout_minutes)
    phases = PhaseTracker(env.job_rank, env.job_world_size, t.run_dir, fault_rank=env.rank)
    files = RunFiles(t.run_dir, is_writer)
    files.write_config(config_to_json(cfg))
    if is_writer:
        say(banner(run, env.device))
    torch.manual_seed(t.seed)
    train_source, valid_samples = open_run_data(run, env.world_size, is_writer, samples)
    session = _session(run, env, speak)
    groups = session.process_groups(env.device.type, timedelta(minutes=cfg.parallel.distributed_timeout_minutes))
    group = groups.coords[0]
    tuning, tune_state, mode = start_tuning(run, session.link_probe_scope(), groups, files, env.device, speak)
    backend = make_backend(run, groups, env.device, initial_values_for(run, say if is_writer else None))
    ledger = CommLedger()
    engine = FederationEngine(backend, groups, cfg.federation, ledger, mode)
    checkpointer = Checkpointer(run, env.rank, backend, engine)
    tuning.attach(checkpointer, tune_state)
    rounds = group_rounds(run, group) if engine.active else None
    if rounds is not None:
        checkpointer.rounds_state = rounds.clock.state
    start_step = checkpointer.resume(speak)
    if rounds is not None and checkpointer.loaded:  # go on where the rounds stood, at this group's own step
        rounds.resume(checkpointer.resumed_rounds, checkpointer.loaded)
        start_step = rounds.own_steps
    time.sleep(restart_delay_seconds(group))  # a test's slow start of a restarted group (FL_MEGATRON_FAULT)
    start_step = session.join(backend, engine, checkpointer.loaded, start_step, tuning.tuner, rounds)
    # the federation's records go by its steps; a group's own by its own (they differ with per-group counts)
    files.open_metrics(rounds.federation_step if rounds is not None else start_step)
    if rounds is not None:  # (a heal may have moved the rounds on)
        start_step = rounds.own_steps
    group_writer = run.layout.is_federated and groups.coords[1:] == (0, 0)  # each group's first rank
    if group_writer:
        files.open_group_metrics(group, start_step)
    records = RunRecords(files, Dashboards(t, cfg.to_dict(), is_writer))
    reporter = Reporter(run, files, records, ledger, engine, session, group, is_writer, group_writer, env.device,
                        env.job_world_size)
    checkpoints = CheckpointPolicy(checkpointer, engine, cfg.checkpoint, t.train_iters, phases, reporter, tuning, speak,
                                   session)
    return RunParts(run, env, phases, files, train_source, valid_samples, session, groups, tuning, backend, ledger,
                    engine, checkpointer, start_step, reporter, checkpoints, TrafficMeter(groups, ledger), rounds)


def _session(run: ResolvedRun, env: LaunchEnv, speak: Callable[[str], None]):
    """The session the run's mode asks for (elastic mode imports torchft)."""
    if not run.cfg.federation.elastic:
        return OneWorldSession(run, env)
    from ..elastic.session import ElasticSession

    return ElasticSession(run, env, speak)


def banner(run: ResolvedRun, device: torch.device) -> str:
    """The lines a run starts with: layout, model, batch, federation, schedule."""
    from ..models import count_parameters

    c, t, lay = run.cfg, run.cfg.training, run.layout
    ds_scheduler = (c.deepspeed or {}).get("scheduler")
    lr_schedule = (f"DeepSpeed scheduler {ds_scheduler.get('type')} from its config" if ds_scheduler
                   else f"{t.lr_decay_style}, warm-up {t.lr_warmup_iters}")
    lines = [
        "fl-megatron pretrain",
        *("  " + line for line in lay.describe().splitlines()),
        f"  model: {c.preset or c.model.arch} ({count_parameters(c.model):,} parameters), "
        f"backend {c.parallel.backend} on {device.type}, {'bf16' if t.bf16 else 'fp32'}",
        batch_line(t, run.accumulation, lay),
        federation_line(lay, c.federation),
        f"  {t.train_iters} steps of {t.optimizer}, lr {t.lr:g} ({lr_schedule}), run dir {t.run_dir}",
    ]
    return "\n".join(lines)
