#!/usr/bin/env python3
"""torchft peer of `fl_megatron.pretrain`: the same model, data and schedule, synced by torchft.

Run one torchrun job per replica group (tools/peers/torchft_launch.py builds the commands):

    TORCHFT_LIGHTHOUSE=http://HOST:PORT REPLICA_GROUP_ID=g NUM_REPLICA_GROUPS=F \\
        torchrun --nproc-per-node G --master-addr HOST --master-port P tools/peers/torchft_train.py \\
        [fl_megatron.pretrain flags] [--algorithm localsgd|diloco --outer-lr 0.7 --outer-momentum 0.9
        --advertise-host HOST]

Each job trains FSDP2 (fully_shard per block and at the root, our FSDP2Backend itself) over its G
ranks, from the same seeded initial values, with the same inner optimizer, LR schedule and
clipping; global rank g * G + r reads the micro-batches rank g * G + r of the FL+FSDP run reads.
torchft's LocalSGD (parameter averaging) or DiLoCo (outer SGD step on the averaged
pseudo-gradient) syncs every H = --fl-sync-interval steps, plus once after the last step when
--train-iters is not a multiple of H, as fl_megatron does. Global rank 0 (group 0, rank 0)
writes config.json, metrics.jsonl and summary.json in --run-dir; rank 0 of each replica group
writes groups/torchft_group_GGGGG.json (the steps it trained, where it healed).

Failures (LocalSGD): with `--min-replicas` below the number of groups (torchft_launch's
min_replicas) the other groups sync without a lost one. Under torchrun --max-restarts a restarted
group (TORCHELASTIC_RESTART_COUNT > 0) first meets the live groups at their next sync, where
torchft heals it (its checkpoint transport sends rank k of a live group's fp32 shards and inner
optimizer state to rank k), takes part in that sync's average as a receiver and trains on from
that step. FL_MEGATRON_FAULT=kill:forward-backward:STEP:RANK kills global rank RANK (peer_loop).
"""

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from fl_megatron.backends import make_backend
from fl_megatron.training.initial_values import initial_values_for
from fl_megatron.federation import build_process_groups
from fl_megatron.training.launch import init_distributed, read_launch_env

from peer_config import PeerRun, parse_peer_args, read_replica_env
from peer_loop import load_data, local_eval_loss, train_steps
from peer_report import LOSS_SCOPE, write_report


def make_manager(peer: PeerRun, backend):
    """A torchft Manager over ProcessGroupGloo; init_sync=False since every group starts from the
    same seeded values (with the default, group 1 would load group 0's weights at the first sync).
    Collective over the replica group: rank 0's Manager publishes its server's address in the
    torchrun store first (a restarted job would otherwise find its previous attempt's there)."""
    from torchft import Manager, ProcessGroupGloo

    timeout = timedelta(minutes=peer.run.cfg.parallel.distributed_timeout_minutes)

    def state_dict():  # healing a restarted group: rank k's local fp32 shards and inner optimizer state
        with torch.no_grad():
            return {"shards": [s.detach().clone() for s in backend.local_shards()],
                    "optim": [t.detach().clone() for t in backend.optimizer_transfer_state()]}

    def load_state_dict(state):
        with torch.no_grad():
            shards = backend.local_shards()
            if [tuple(s.shape) for s in shards] != [tuple(s.shape) for s in state["shards"]]:
                raise ValueError("the shards received for healing do not match this rank's shard layout")
            for shard, value in zip(shards, state["shards"]):
                shard.copy_(value)
            backend.load_optimizer_transfer_state(state["optim"])
            backend.refresh_after_sync()

    def manager():
        return Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict, state_dict=state_dict,
                       min_replica_size=peer.min_replicas, use_async_quorum=peer.algorithm != "diloco",
                       timeout=timeout, quorum_timeout=timeout, rank=peer.group_rank, world_size=peer.group_size,
                       store_addr=peer.advertise_host, store_port=int(os.environ["MASTER_PORT"]),
                       lighthouse_addr=peer.lighthouse, replica_id=f"fl_megatron_peer_{peer.replica_group}",
                       hostname=peer.advertise_host, init_sync=False)

    made = manager() if peer.group_rank == 0 else None
    dist.barrier()
    return made or manager()


def _diloco_sync_now(diloco, manager) -> None:
    """An outer step now, as DiLoCo._step_post_hook does at its H-th step (one fragment, no delay).
    torchft 0.2.0 has no public call for this; its private names are checked here."""
    fragments = getattr(diloco, "_fragments", None)
    if not fragments or len(fragments) != 1 or not hasattr(diloco, "_local_step"):
        raise RuntimeError("this torchft's DiLoCo has no _fragments/_local_step: choose --train-iters "
                           "a multiple of --fl-sync-interval")
    manager.start_quorum()
    fragments[0].prepare_sync()
    fragments[0].perform_sync()
    diloco._local_step = 0


def make_algorithm(peer: PeerRun, manager, backend):
    """(context manager hooking the inner optimizer, function syncing now)."""
    from torchft.local_sgd import DiLoCo, LocalSGD

    H = peer.run.cfg.federation.sync_interval
    if peer.algorithm == "localsgd":
        algo = LocalSGD(manager, backend.model, backend.optimizer, sync_every=H)
        return algo, algo.sync
    momentum = peer.outer_momentum
    outer = torch.optim.SGD(backend.model.parameters(), lr=peer.outer_lr, momentum=momentum,
                            nesterov=momentum > 0)
    algo = DiLoCo(manager, [backend.model], backend.optimizer, outer, sync_every=H)
    return algo, lambda: _diloco_sync_now(algo, manager)


def _say(peer: PeerRun, text: str) -> None:
    if peer.global_rank == 0:
        print(text, flush=True)


def restart_count() -> int:
    """How often torchrun has restarted this replica group (0: its first attempt)."""
    raw = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(raw) if raw.isdigit() else 0


def rejoin(peer: PeerRun, algo, manager) -> tuple[int, float]:
    """A restarted group meets the live groups at their next sync now: torchft heals it there
    (the live state arrives before the average is applied) and it takes part in that sync as a
    receiver. Returns (the live groups' step, seconds waited and healed): each committed LocalSGD
    sync is H steps, so the step is the Manager's commit count times H."""
    if peer.algorithm != "localsgd":
        raise RuntimeError(f"a restarted {peer.system} group cannot rejoin: only the LocalSGD peer heals "
                           "(DiLoCo's outer state and fragments are not handed over here)")
    start = time.perf_counter()
    algo.sync()
    error = manager.errored()
    if error is not None:
        raise RuntimeError(f"torchft: healing the restarted group {peer.replica_group} failed: {error}")
    H, steps = peer.run.cfg.federation.sync_interval, peer.run.cfg.training.train_iters
    step = min(manager.current_step() * H, steps)
    if peer.group_rank == 0:
        print(f"{peer.system}: group {peer.replica_group} restarted ({restart_count()}x), healed from the live "
              f"groups at step {step} in {time.perf_counter() - start:.2f} s", flush=True)
    return step, time.perf_counter() - start


def main(argv=None) -> int:
    env = read_launch_env()
    try:
        replica_group, num_groups, lighthouse = read_replica_env()
        peer = parse_peer_args(argv, env, replica_group, num_groups, lighthouse)
    except ValueError as e:
        if env.rank == 0:
            print(f"torchft_train: error: {e}", file=sys.stderr, flush=True)
        return 2
    t = peer.run.cfg.training
    init_distributed(env, peer.run.cfg.parallel.distributed_timeout_minutes)
    device = env.device
    _say(peer, f"{peer.system}: {peer.num_groups} replica groups x {peer.group_size} ranks, "
               f"H = {peer.run.cfg.federation.sync_interval}, {t.train_iters} steps of {t.optimizer}, "
               f"{peer.run.tokens_per_step} tokens per step, run dir {t.run_dir}")
    torch.manual_seed(t.seed)
    source, valid = load_data(peer)
    groups = build_process_groups(peer.local_run.layout, device.type,
                                  timedelta(minutes=peer.run.cfg.parallel.distributed_timeout_minutes))
    backend = make_backend(peer.local_run, groups, device, initial_values_for(peer.local_run))
    manager = make_manager(peer, backend)
    finished = False
    try:
        algo, sync_now = make_algorithm(peer, manager, backend)
        with algo:
            first_step, heal_s = rejoin(peer, algo, manager) if restart_count() else (0, None)
            log = train_steps(peer, backend, source, manager, sync_now, device, first_step)
            log.heal_s = heal_s
        eval_local = local_eval_loss(peer, backend, valid, device) if t.eval_iters else None
        log.eval_elapsed = time.perf_counter() - log.start
        summary = write_report(peer, manager, log, eval_local, device, restart_count())
        eval_text = f", eval loss {summary['eval_loss']:.4f}" if summary["eval_loss"] is not None else ""
        _say(peer, f"done: {t.train_iters - log.first_step} steps in {summary['wall_seconds']:.2f} s, "
                   f"{summary['tokens_per_s']:,.0f} tok/s, final train loss {summary['final_train_loss']:.4f} "
                   f"({LOSS_SCOPE}){eval_text}, {summary['syncs_committed']}/{summary['syncs_expected']} syncs "
                   f"committed; summary in {t.run_dir}/summary.json")
        if summary["syncs_committed"] != summary["syncs_expected"]:
            raise RuntimeError(f"only {summary['syncs_committed']} of {summary['syncs_expected']} torchft syncs "
                               "committed: the groups did not average as scheduled")
        # leave together: a rank tearing down gloo while a peer is in its last collective can abort it
        dist.barrier()
        finished = True
    finally:
        manager.shutdown(wait=finished)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    # os._exit after a clean finish: gloo and torchft threads can abort during interpreter
    # finalisation, turning a finished run into a failed rank under torchrun (as in fl_megatron.pretrain)
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
