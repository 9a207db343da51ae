"""The Megatron-LM integration (fl_megatron.integrations.megatron_lm) against megatron-core's real
DDP and DistributedOptimizer, set up as Megatron-LM does it (parallel_state with N distributed-
optimizer instances), on 4 CPU ranks: the outer sync, the gated gradient reduction (FL+FSDP
and FL+HSDP, with and without overlap, averaging in the collective), the checkpoint rule, the
outer optimizer and the sparse sync against their references, and flag validation. The patch
series itself: test_megatron_lm_patch.py.
"""

import pytest
import torch

pytest.importorskip("megatron.core")

from fl_megatron.backends.megatron_state import main_shard_entries  # noqa: E402
from fl_megatron.local_ranks import run_ranks  # noqa: E402
from fl_megatron.federation.vote import GROUP_SLOTS  # noqa: E402
from megatron_lm_helpers import megatron_args  # noqa: E402

pytestmark = pytest.mark.timeout(900)


def _grad_check(h, ddp, rank, fed_ranks, tokens, out, key):
    """Step 1 of a gated model: collectives stay in the federation group; the reduced gradient
    shard equals the average of the local gradients over the federation group."""
    h.forward_backward(ddp, tokens)
    local = h.grad_buffers(ddp).clone()
    recorder = h.GroupRecorder()
    with recorder:
        h.finish(ddp)
    reduced, mask = h.grad_buffers(ddp), h.own_grad_mask(ddp)
    everyone = torch.stack(h.gather(local))
    reference = everyone[list(fed_ranks)].mean(0)
    out[f"{key}_grad_err"] = (reduced - reference)[mask].abs().max().item()
    out[f"{key}_grad_vs_world"] = (reduced - everyone.mean(0))[mask].abs().max().item()
    with recorder:
        h.step(ddp_optimizer[0])
    out[f"{key}_ops"] = recorder.ops
    out[f"{key}_outside"] = [op for op in recorder.ops if not set(op[1]) <= set(fed_ranks)]


ddp_optimizer = [None]  # the optimizer _grad_check steps (kept out of its signature for brevity)


def _synced(h, loop, ddp, pre_mains):
    """(main shards identical across peers, max deviation from the pre-sync average, model
    parameters identical on all ranks, model parameters == main shards)."""
    mains = torch.cat([m.reshape(-1) for m in loop.main_shards()])
    peers = [x for r, x in enumerate(h.gather(mains)) if r in loop.groups.peer_ranks]
    before = [x for r, x in enumerate(h.gather(pre_mains)) if r in loop.groups.peer_ranks]
    params = h.gather(h.params_flat(ddp))
    copied = all(torch.equal(p.detach().reshape(-1)[a:b], m.to(p.dtype))
                 for _, p, m, a, b in main_shard_entries(loop.dist_opts))
    return (all(torch.equal(x, peers[0]) for x in peers), (mains - torch.stack(before).mean(0)).abs().max().item(),
            all(torch.equal(x, params[0]) for x in params), copied)


def _mains(loop):
    return torch.cat([m.detach().reshape(-1) for m in loop.main_shards()]).clone()


def _integration_job(rank, world):
    import megatron_lm_helpers as h
    from megatron.core import parallel_state as ps

    from fl_megatron.config.parallel import FederationConfig
    from fl_megatron.integrations.megatron_lm import FederatedOuterLoop

    def fed_config(**kw):
        return FederationConfig(num_groups=2, **kw)

    out = {}
    # --- FL+FSDP: N = F = 2 instances of 2 ranks, bf16, H = 2 -------------------------------
    fed = (0, 1) if rank < 2 else (2, 3)
    base, base_opt = h.build(2, bf16=True, overlap=False)  # megatron's own partial DistOpt (HSDP)
    h.forward_backward(base, h.batch(rank, 1))
    recorder = h.GroupRecorder()
    with recorder:
        h.finish(base)
    out["ungated_outside"] = [op for op in recorder.ops if not set(op[1]) <= set(fed)]
    ddp, opt = h.build(2, bf16=True, overlap=False)
    loop = FederatedOuterLoop([ddp], opt, fed_config(sync_interval=2), train_iters=10, log=lambda s: None)
    ddp_optimizer[0] = opt
    _grad_check(h, ddp, rank, fed, h.batch(rank, 1), out, "fsdp")
    after_step1 = h.params_flat(ddp).clone()
    out["sync_at_1"] = loop.after_iteration(1)
    params = h.gather(h.params_flat(ddp))
    out["differ_before_sync"] = not torch.equal(params[0], params[2])
    h.train_step(ddp, opt, h.batch(rank, 2))
    pre = _mains(loop)
    recorder = h.GroupRecorder()
    with recorder:
        out["sync_at_2"] = loop.after_iteration(2)
    out["sync_ops"] = recorder.ops
    out["shard_bytes"] = pre.numel() * 4
    out["synced_2"] = _synced(h, loop, ddp, pre)
    # checkpoint rule: a save at iteration 3 (not a multiple of H) syncs first, once
    h.train_step(ddp, opt, h.batch(rank, 3))
    out["sync_at_3"] = loop.after_iteration(3)
    out["hash_ok_3_before"] = loop.hash_check_allowed(3)
    pre = _mains(loop)
    out["save_3"] = loop.before_save(3)
    out["synced_3"] = _synced(h, loop, ddp, pre)
    out["save_3_again"] = loop.before_save(3)
    out["hash_ok_3_after"] = loop.hash_check_allowed(3)

    # --- the same with --overlap-grad-reduce and --overlap-param-gather ----------------------
    ddp2, opt2 = h.build(2, bf16=True, overlap=True)
    loop2 = FederatedOuterLoop([ddp2], opt2, fed_config(sync_interval=2), overlap_param_gather=True,
                               log=lambda s: None)
    recorder = h.GroupRecorder()
    with recorder:
        h.train_step(ddp2, opt2, h.batch(rank, 1))
        h.forward_backward(ddp2, h.batch(rank, 2))  # the pre-hooks gather step 1's parameters
    out["overlap_outside"] = [op for op in recorder.ops if not set(op[1]) <= set(fed)]
    out["overlap_vs_plain_step1"] = (h.params_flat(ddp2) - after_step1).abs().max().item()
    h.finish(ddp2)
    h.step(opt2)
    pre = _mains(loop2)
    loop2.after_iteration(2)  # copy only: the next forward gathers
    h.forward_backward(ddp2, h.batch(rank, 3))
    out["overlap_synced"] = _synced(h, loop2, ddp2, pre)

    # --- FL+HSDP: N = 4 instances of 1 rank, F = 2 groups of P = 2 replicas, fp32 -------------
    ps.destroy_model_parallel()
    ddp3, opt3 = h.build(4, bf16=False, overlap=False)
    loop3 = FederatedOuterLoop([ddp3], opt3, fed_config(sync_interval=1), log=lambda s: None)
    out["hsdp_groups"] = (loop3.groups.peer_ranks, loop3.groups.replica_ranks, loop3.groups.replica_index)
    ddp_optimizer[0] = opt3
    _grad_check(h, ddp3, rank, fed, h.batch(rank, 1), out, "hsdp")
    pre = _mains(loop3)
    recorder = h.GroupRecorder()
    with recorder:
        loop3.after_iteration(1)
    out["hsdp_sync_ops"] = recorder.ops
    out["hsdp_shard_bytes"] = pre.numel() * 4
    out["hsdp_synced"] = _synced(h, loop3, ddp3, pre)
    # --ddp-average-in-collective: ReduceOp.AVG over the instance, then over the P replicas
    ddp4, opt4 = h.build(4, bf16=False, overlap=False, average_in_collective=True)
    args = megatron_args(world_size=4, tensor_model_parallel_size=1, num_distributed_optimizer_instances=4,
                         fl_num_groups=2, ddp_average_in_collective=True, iteration=0)
    loop4 = FederatedOuterLoop.from_megatron_args(args, [ddp4], opt4)
    out["from_args"] = (loop4.groups.replicas, loop4.config.sync_interval, loop4.train_iters, args.fl_enabled)
    ddp_optimizer[0] = opt4
    _grad_check(h, ddp4, rank, fed, h.batch(rank, 1), out, "hsdp_avg")
    return out


def test_outer_loop_gating_and_checkpoint_rule():
    results = run_ranks(4, _integration_job, timeout=600)
    for rank, r in enumerate(results):
        fed = {0, 1} if rank < 2 else {2, 3}
        peers = {rank % 2, rank % 2 + 2}
        # megatron's partial DistOpt alone all-reduces across the groups every step; gated, nothing leaves
        assert any(set(op[1]) == peers for op in r["ungated_outside"]), r["ungated_outside"]
        for key in ("fsdp", "hsdp", "hsdp_avg"):
            assert r[f"{key}_outside"] == [], r[f"{key}_outside"]
            assert r[f"{key}_grad_err"] < 1e-6, (key, r[f"{key}_grad_err"])
            assert r[f"{key}_grad_vs_world"] > 1e-4, key  # the reference tells the two apart
        assert r["overlap_outside"] == []
        assert r["from_args"] == (2, 8, 100, True)
        # FL+HSDP: the gradient all-reduce over the P = 2 replicas of the group still happens
        assert any(op[0].startswith("allreduce") and set(op[1]) == fed for op in r["hsdp_ops"]), r["hsdp_ops"]
        # (i) the outer sync
        assert r["sync_at_1"] is None and r["differ_before_sync"]
        assert r["sync_at_2"].startswith("fl-megatron: sync 1 at iteration 2")
        for key in ("synced_2", "synced_3", "overlap_synced", "hsdp_synced"):
            same_mains, err, same_params, copied = r[key]
            assert same_mains and same_params and copied and err < 1e-6, (key, r[key])
        assert r["overlap_vs_plain_step1"] == 0.0
        # the shards cross groups once, the vote riding on their first bucket (its table of 2 groups
        # as fp32 high and low parts); the rest on the peer group is the metrics' round (< 1 KB)
        inter = [op[2] for op in r["sync_ops"] if set(op[1]) == peers]
        rider_bytes = 4 * 2 * (GROUP_SLOTS * 2 + 2)
        assert sum(b for b in inter if b >= 1024) == r["shard_bytes"] + rider_bytes
        assert sum(b for b in inter if b < 1024) < 1024
        assert {frozenset(op[1]) for op in r["sync_ops"]} <= {frozenset(peers), frozenset(fed)}
        # FL+HSDP sync with replica split: half of the shards cross groups, then the replicas exchange
        assert r["hsdp_groups"] == (sorted(peers), sorted(fed), rank % 2)
        hsdp_inter = sum(op[2] for op in r["hsdp_sync_ops"] if set(op[1]) == peers and op[2] >= 1024)
        assert hsdp_inter == r["hsdp_shard_bytes"] // 2, (hsdp_inter, r["hsdp_shard_bytes"])
        # (iii) the checkpoint rule
        assert r["sync_at_3"] is None and r["hash_ok_3_before"] is False
        assert r["save_3"].startswith("fl-megatron: sync 2 at iteration 3")
        assert r["save_3_again"] is None and r["hash_ok_3_after"] is True


def _outer_job(rank, world, tmp):
    """Nesterov outer steps with int8 + error feedback through the Megatron-LM loop, against the
    plain-torch DiLoCo reference of test_outer_sync; then the state beside a checkpoint."""
    import megatron_lm_helpers as h

    from fl_megatron.config.parallel import FederationConfig
    from fl_megatron.integrations.megatron_lm import FederatedOuterLoop

    out = {}
    config = FederationConfig(num_groups=2, sync_interval=2, outer_optimizer="nesterov", outer_lr=0.7,
                              outer_momentum=0.9)
    ddp, opt = h.build(2, bf16=False, overlap=False)
    loop = FederatedOuterLoop([ddp], opt, config, train_iters=100, save_dir=tmp, log=lambda s: None)
    peers = loop.groups.peer_ranks
    anchor = _mains(loop)
    reference = torch.optim.SGD([anchor], lr=0.7, momentum=0.9, nesterov=True)
    gaps = []
    for step in range(1, 5):
        h.train_step(ddp, opt, h.batch(rank, step))
        if step % 2 == 0:
            everyone = h.gather(_mains(loop))
            anchor.grad = anchor.detach() - (everyone[peers[0]] + everyone[peers[1]]) / 2
            reference.step()
        loop.after_iteration(step)
        if step % 2 == 0:
            gaps.append(((_mains(loop) - anchor).abs().max() / anchor.abs().max()).item())
    out["nesterov_gaps"] = gaps
    # the federation's state beside a checkpoint, read back by a fresh loop (int8 + error feedback)
    config = FederationConfig(num_groups=2, sync_interval=2, outer_optimizer="nesterov", sync_dtype="int8",
                              error_feedback=True)
    loop = FederatedOuterLoop([ddp], opt, config, train_iters=100, save_dir=tmp, log=lambda s: None)
    for step in range(5, 7):
        h.train_step(ddp, opt, h.batch(rank, step))
        loop.after_iteration(step)
    h.train_step(ddp, opt, h.batch(rank, 7))
    loop.after_iteration(7)
    loop.before_save(7)  # off the grid: a full sync, then the state file
    saved = {k: v.clone() for k, v in loop.engine.state_tensors().items()}
    moments = [t.clone() for t in loop.shards.inner_state_shards()]
    out["residuals_saved"] = sum(k.startswith("residual.") for k in saved)
    fresh = FederatedOuterLoop([ddp], opt, config, train_iters=100, log=lambda s: None)
    for t in fresh.shards.inner_state_shards():
        t.zero_()
    fresh.resume(tmp, 7)
    loaded = fresh.engine.state_tensors()
    out["state_equal"] = saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    out["moments_equal"] = all(torch.equal(a, b) for a, b in zip(moments, fresh.shards.inner_state_shards()))
    out["last_synced"] = fresh.engine.last_synced_step
    try:
        fresh.resume(tmp, 9)
        out["missing"] = "no error"
    except FileNotFoundError as e:
        out["missing"] = str(e)
    out.update(_sparse_syncs(h, ddp, opt, rank))
    return out


def _sparse_syncs(h, ddp, opt, rank):
    """The sparse sync (int2 values, the top 64 of each 4,096, error feedback decayed by 0.95) through
    the Megatron-LM loop, against its reference bucket by bucket: after each sync the main shards are
    the anchor minus the mean of what each group sent of 0.95 x its residual + its pseudo-gradient
    (the codec's own choice, fl_test_utils.sparse_sent), and each rank's residual keeps the rest."""
    from fl_megatron.config.parallel import FederationConfig
    from fl_megatron.costs import SPARSE_CHUNK
    from fl_megatron.federation.sparse import SparseCodec
    from fl_megatron.integrations.megatron_lm import FederatedOuterLoop
    from fl_test_utils import sparse_sent

    density = 64 / SPARSE_CHUNK
    config = FederationConfig(num_groups=2, sync_interval=2, sync_dtype="int2", topk_density=density,
                              error_feedback=True)
    loop = FederatedOuterLoop([ddp], opt, config, train_iters=100, log=lambda s: None)
    peers, codec = loop.groups.peer_ranks, SparseCodec(density, "int2")
    averager = loop.engine.state.averagers[0]
    sizes = [m.numel() for m in loop.main_shards()]
    chunks = averager.plan(loop.main_shards())

    def buckets(flat):  # flat main shards cut as the averager cuts them
        parts = flat.split(sizes)
        return [torch.cat([parts[s.index][s.start:s.start + s.length] for s in c.segments]) for c in chunks]

    anchor = buckets(_mains(loop))
    residuals = {p: [torch.zeros_like(b) for b in anchor] for p in peers}
    out = {"sparse_err": [], "sparse_residual_err": [], "sparse_moved": [], "sparse_same": []}
    for step in range(8, 12):
        h.train_step(ddp, opt, h.batch(rank, step))
        if step % 2:
            loop.after_iteration(step)
            continue
        everyone = {p: buckets(x) for p, x in enumerate(h.gather(_mains(loop))) if p in peers}
        sent = {}
        for p in peers:
            carried = [0.95 * r + (a - b) for r, a, b in zip(residuals[p], anchor, everyone[p])]
            sent[p] = [sparse_sent(codec, c) for c in carried]
            residuals[p] = [c - x for c, x in zip(carried, sent[p])]
        expected = [a - sum(sent[p][i] for p in peers) / len(peers) for i, a in enumerate(anchor)]
        loop.after_iteration(step)
        after = buckets(_mains(loop))
        out["sparse_err"].append(max((x - e).abs().max().item() for x, e in zip(after, expected)))
        kept = [averager.residuals[i][:len(b)] for i, b in enumerate(anchor)]
        out["sparse_residual_err"].append(max((k - r).abs().max().item() for k, r in zip(kept, residuals[rank])))
        moved = sum(int((x != a).sum()) for x, a in zip(after, anchor))
        most = len(peers) * 64 * sum(-(-len(a) // SPARSE_CHUNK) for a in anchor)  # k per chunk per group
        out["sparse_moved"].append((moved, most, sum(sizes)))
        same = [x for p, x in enumerate(h.gather(_mains(loop))) if p in peers]
        out["sparse_same"].append(all(torch.equal(x, same[0]) for x in same))
        anchor = after
    return out


def test_outer_step_matches_plain_torch_diloco_and_the_state_resumes(tmp_path):
    results = run_ranks(4, _outer_job, str(tmp_path), timeout=600)
    for r in results:
        assert len(r["nesterov_gaps"]) == 2 and max(r["nesterov_gaps"]) <= 1e-6, r["nesterov_gaps"]
        assert r["residuals_saved"] > 0 and r["state_equal"] and r["moments_equal"], r
        assert r["last_synced"] == 7
        assert "iteration 9 is not in" in r["missing"] and "needs it to resume" in r["missing"], r["missing"]
        # the sparse sync: both syncs as the reference computes them, residuals included; it moves at
        # most the top 64 of each chunk of each group, and the groups end bit-identical
        assert len(r["sparse_err"]) == 2 and max(r["sparse_err"]) <= 1e-6, r["sparse_err"]
        assert max(r["sparse_residual_err"]) <= 1e-6, r["sparse_residual_err"]
        assert all(0 < moved <= most < size / 10 for moved, most, size in r["sparse_moved"]), r["sparse_moved"]
        assert r["sparse_same"] == [True, True]


# --- flags and validation (pure) ---------------------------------------------------------------
def test_flags_compose_and_take_our_help_texts():
    import argparse

    from fl_megatron.config.parallel import FederationConfig
    from fl_megatron.integrations.megatron_lm import add_federation_args, compose_args_providers

    seen = []

    def modelopt(parser):
        seen.append("modelopt")
        parser.add_argument("--export-te-mcore-model", action="store_true")
        return parser

    parser = compose_args_providers(None, modelopt, add_federation_args)(argparse.ArgumentParser())
    assert seen == ["modelopt"]
    args = parser.parse_args(["--fl-sync-interval", "4", "--no-fl-replica-split", "--export-te-mcore-model"])
    given = (args.fl_sync_interval, args.fl_replica_split, args.fl_num_groups, args.fl_disable_sync)
    assert given == (4, False, None, None)
    help_text = " ".join(parser.format_help().split())
    for name in ("sync_interval", "disable_sync", "bucket_mb"):
        meta = next(f for f in FederationConfig.__dataclass_fields__.values() if f.name == name).metadata["help"]
        assert " ".join(meta.split()) in help_text, name


def _validated(**kw):
    from fl_megatron.integrations.megatron_lm import validate_federation_args

    args = megatron_args(**kw)
    warnings = validate_federation_args(args)
    return args, warnings


def test_defaults_resolve_from_the_instances():
    # no --fl-* flag: Megatron-LM unchanged even with a partial distributed optimizer (HSDP)
    args, _ = _validated()
    assert (args.fl_enabled, args.fl_num_groups, args.fl_sync_interval, args.fl_replica_split) == (False, 1, 8, True)
    # any --fl-* flag: F defaults to N (FL+FSDP); F = 2 of N = 4 is FL+HSDP with P = 2
    args, _ = _validated(fl_sync_interval=4)
    assert (args.fl_enabled, args.fl_num_groups, args.fl_replicas) == (True, 4, 1)
    args, _ = _validated(fl_num_groups=2)
    assert (args.fl_num_groups, args.fl_replicas, args.fl_sync_interval) == (2, 2, 8)
    again = megatron_args(**vars(args))
    from fl_megatron.integrations.megatron_lm import validate_federation_args
    validate_federation_args(again)  # idempotent
    assert (again.fl_num_groups, again.fl_replicas) == (2, 2)
    # --overlap-param-gather, --ddp-average-in-collective and data-parallel random init are fine
    _validated(fl_num_groups=2, overlap_param_gather=True, ddp_average_in_collective=True)
    # saves off the sync grid only warn: they sync first
    _, warnings = _validated(fl_sync_interval=4, save="/ckpt", save_interval=6)
    assert len(warnings) == 1 and "--save-interval 6" in warnings[0] and "syncs the groups first" in warnings[0]


@pytest.mark.parametrize("overrides, expected", [
    (dict(world_size=12, tensor_model_parallel_size=8, fl_num_groups=2),
     "world size 12 is not divisible by TP*PP*CP = 8*1*1 = 8"),
    (dict(world_size=12, tensor_model_parallel_size=1, fl_num_groups=2, num_distributed_optimizer_instances=8),
     "DP = world/(TP*PP*CP) = 12/(1*1*1) = 12 is not divisible by --num-distributed-optimizer-instances N=8"),
    (dict(fl_num_groups=3), "F=3 does not divide --num-distributed-optimizer-instances N=4"),
    (dict(fl_num_groups=2, num_distributed_optimizer_instances=1), "it is 1"),
    (dict(fl_sync_interval=8, num_distributed_optimizer_instances=1), "single federation group"),
    (dict(fl_num_groups=2, pipeline_model_parallel_size=2),
     "federation group 0 of 2 the ranks 0-3, 8-11 of 16"),
    (dict(fl_num_groups=2, use_distributed_optimizer=False), "--use-distributed-optimizer is required"),
    (dict(fl_num_groups=2, use_precision_aware_optimizer=True), "--use-precision-aware-optimizer"),
    (dict(fl_num_groups=2, calculate_per_token_loss=True), "--calculate-per-token-loss"),
    (dict(fl_num_groups=2, overlap_param_gather_with_optimizer_step=True), "in flight"),
    (dict(fl_num_groups=2, num_experts=8), "--num-experts 8"),
    (dict(fl_num_groups=2, check_weight_hash_across_dp_replicas_interval=12),
     "interval 12 must be a multiple of --fl-sync-interval H=8"),
    (dict(fl_num_groups=2, fl_disable_sync=True, save="/ckpt"), "a checkpoint would mix their weights"),
    (dict(fl_num_groups=2, fl_sync_interval=-1), "sync_interval=-1 must be >= 0"),
    # the engine's own checks, as in fl_megatron.pretrain
    (dict(fl_num_groups=2, fl_sync_dtype="fp8"), "sync_dtype='fp8' is not one of"),
    (dict(fl_num_groups=2, fl_error_feedback=True), "error_feedback needs a compressed sync"),
    (dict(fl_num_groups=2, fl_topology="torus"), "a torus needs the number of federation groups"),
    # what a patched Megatron-LM refuses, with the reason
    (dict(fl_num_groups=2, fl_elastic=True), "--fl-elastic: elastic federation groups"),
    (dict(fl_num_groups=2, fl_sick_loss_ratio=3.0), "--fl-sick-loss-ratio: Megatron-LM's train_step averages"),
    (dict(fl_num_groups=2, fl_group_size=8), "--fl-group-size: Megatron-LM's federation groups are made of"),
    (dict(fl_num_groups=2, fl_group_sizes="8,4"), "--fl-group-sizes: groups of unequal size or speed are built"),
    (dict(fl_num_groups=2, fl_balance_steps=True), "--fl-balance-steps: groups of unequal size or speed"),
    (dict(fl_num_groups=2, fl_group_intervals="8,4"), "--fl-group-intervals: groups of unequal size or speed"),
    (dict(fl_num_groups=2, fl_outer_optimizer="nesterov", save="/ckpt", non_persistent_save_interval=4),
     "--non-persistent-save-interval: the outer optimizer's state"),
])
def test_validation_names_the_problem(overrides, expected):
    with pytest.raises(ValueError, match="fl-megatron: invalid federated settings") as err:
        _validated(**overrides)
    assert expected in str(err.value)


def test_every_pretrain_federation_flag_exists_in_megatron_lm():
    import argparse
    import dataclasses

    from fl_megatron.config.flags import build_parser, flag_name
    from fl_megatron.config.parallel import FederationConfig
    from fl_megatron.integrations.megatron_lm import add_federation_args

    ours = add_federation_args(argparse.ArgumentParser())
    known = {s for a in ours._actions for s in a.option_strings}
    pretrain = {s for a in build_parser()._actions for s in a.option_strings if s.startswith("--fl-")}
    assert pretrain <= known, sorted(pretrain - known)
    for f in dataclasses.fields(FederationConfig):
        assert flag_name("federation", f.name) in known, f.name
    # given values reach the engine's config; the old spelling of the replica split still parses
    args = ours.parse_args(["--fl-outer-optimizer", "adam", "--fl-fragments", "2", "--no-fl-replica-split"])
    assert (args.fl_outer_optimizer, args.fl_fragments, args.fl_replica_split) == ("adam", 2, False)


def test_pipeline_parallel_fits_with_dp_outermost():
    from fl_megatron.integrations.megatron_lm_args import federation_group_ranks

    args, _ = _validated(fl_num_groups=2, pipeline_model_parallel_size=2, use_tp_pp_dp_mapping=True)
    assert federation_group_ranks(args, 1) == list(range(8, 16))
