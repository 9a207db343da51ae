"""Groups of unequal size on the real FSDP2 backend (6 CPU ranks, gloo): groups of 4 and 2 ranks
(FSDP, and HSDP 2 x 2 beside 2 x 1) each take an SGD step from their own initialisation, then
average atom by atom; both groups' full state dicts must equal the mean of the pre-sync full
state dicts bit for bit, which also checks the plan's FSDP2 cut against FSDP2's own."""

import tempfile

import torch

from fl_megatron.local_ranks import run_ranks

CASES = {"fsdp 4 + 2": (None,), "hsdp 2x2 + 2x1": ((2, 1),)}


def _job(rank, world):
    import torch.distributed as dist

    from fl_megatron.backends.common import SeededValues
    from fl_megatron.backends.fsdp2 import FSDP2Backend
    from fl_megatron.config.resolved import ResolvedRun
    from fl_megatron.federation.atom_average import AtomAverager
    from fl_megatron.federation.unequal_groups import build_unequal_groups, plan_shards
    from fl_megatron.group_layout import make_group_layout
    from fl_megatron.models import build_model
    from fl_megatron.topology import make_layout
    from fl_test_utils import tiny_config

    out = {}
    tmp = tempfile.mkdtemp()
    for case, (shard_sizes,) in CASES.items():
        layout = make_group_layout((4, 2), ranks_per_node=6, shard_sizes=shard_sizes)
        groups = build_unequal_groups(layout, "cpu")
        f = layout.group_of(rank)
        g = layout.groups[f]
        cfg = tiny_config(tmp, tmp, group_size=g.size, shard_size=g.shard_size)
        run = ResolvedRun(cfg, make_layout(g.size, g.size, g.size, shard_size=g.shard_size), 1)
        backend = FSDP2Backend(run, groups, torch.device("cpu"), SeededValues(cfg.model, seed=10 + f))
        ids = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(f))
        loss = backend.forward(ids).float().pow(2).mean()  # the same batch on a group's ranks
        backend.backward(loss, 1, last=True)
        backend.optimizer_step(0.5)
        before = backend.full_state_dict()
        shapes = [tuple(p.shape) for p in build_model(cfg.model, device="meta").parameters()]
        plan = plan_shards(groups, shapes)
        stats = AtomAverager(plan, rank, groups.atoms, replica_group=groups.replica).average(
            [t for _, t in backend.named_shards()])
        backend.refresh_after_sync()
        after = backend.full_state_dict()
        flag = torch.ones(1)
        groups.all_reduce_job(flag)  # the job-wide reduction over groups of unequal size
        out[case] = {"group": f, "before": {k: v.tolist() for k, v in before.items()},
                     "after": {k: v.tolist() for k, v in after.items()}, "bytes": stats.inter_group_bytes,
                     "planned": 4 * sum(a.length for a in plan.rank_atoms(rank)), "ranks": float(flag)}
    dist.barrier()
    return out


def test_groups_of_4_and_2_fsdp2_ranks_average_to_the_mean_of_their_full_states():
    results = run_ranks(6, _job, timeout=600)
    for case in CASES:
        befores = {}
        for r in results:
            befores.setdefault(r[case]["group"], r[case]["before"])
        assert sorted(befores) == [0, 1]
        a, b = ({k: torch.tensor(v) for k, v in befores[f].items()} for f in (0, 1))
        assert any(not torch.equal(a[k], b[k]) for k in a)  # the groups had moved apart
        for rank, r in enumerate(results):
            after = {k: torch.tensor(v) for k, v in r[case]["after"].items()}
            for k in a:
                assert torch.equal(after[k], (a[k] + b[k]) / 2), (case, rank, k)
            assert r[case]["bytes"] == r[case]["planned"] > 0
            assert r[case]["ranks"] == 6.0
