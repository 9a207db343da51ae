"""AtomAverager on 7 CPU ranks (gloo): groups of unequal size (4 + 2, 4 + 2 + 1, HSDP 4 + 2)
average their shards to the closed-form mean of the groups' full tensors, bit for bit in fp32
where two groups meet, whatever the bucket size, and report the bytes the plan's costs say."""

import math

import torch
import torch.distributed as dist

from fl_megatron.atom_plan import groups_from_sizes, plan_for_shapes
from fl_megatron.local_ranks import run_ranks

SHAPES = [(10, 3), (7,), (1, 5), (3, 4), (64, 2), (16,), (0, 4), (13, 1), (40,)]
CASES = {  # name: (group sizes, shard sizes): the plans cover ranks 0..5 or all 7
    "4+2": ((4, 2), ()),
    "4+2+1": ((4, 2, 1), ()),
    "hsdp 2x2 + 2x1": ((4, 2), (2, 1)),
    "fsdp 4 + hsdp 2x1": ((4, 2), (4, 1)),
}
BUCKETS = (64, 1 << 20)


def _full(case: str, group: int, tensor: int) -> torch.Tensor:
    """Group `group`'s full tensor before the sync (each group trained its own values)."""
    seed = 1000 * list(CASES).index(case) + 10 * group + tensor
    return torch.randn(SHAPES[tensor], generator=torch.Generator().manual_seed(seed)).reshape(-1)


def _job(rank, world):
    from fl_megatron.federation.atom_average import AtomAverager, build_atom_groups
    from fl_megatron.federation.ledger import CommLedger

    out = {}
    for case, (sizes, shards) in CASES.items():
        plan = plan_for_shapes(groups_from_sizes(sizes, shards), SHAPES)
        replica_group = None
        for g in plan.groups:  # every rank makes every replica group, in the same order
            for s in range(g.shard_size):
                members = [g.rank(r, s) for r in range(g.replicas)]
                if g.replicas > 1:
                    made = dist.new_group(members)
                    replica_group = made if rank in members else replica_group
        communicators = build_atom_groups(plan, rank)
        if rank >= plan.world_size:
            assert communicators == {}
            continue
        f = plan.group_of(rank)
        for bucket in BUCKETS:
            local = [_full(case, f, t)[slice(*plan.shard_range(rank, t))].clone() for t in range(len(SHAPES))]
            ledger = CommLedger()
            averager = AtomAverager(plan, rank, communicators, replica_group=replica_group, bucket_bytes=bucket,
                                    ledger=ledger)
            stats = averager.average(local)
            out[(case, bucket)] = ([x.tolist() for x in local], stats.inter_group_bytes, stats.intra_group_bytes,
                                   ledger.snapshot()["inter_group_bytes"])
        if case == "4+2":  # token weights 3 : 1 (1.5 and 0.5): each element (1.5 a + 0.5 b) / 2
            local = [_full(case, f, t)[slice(*plan.shard_range(rank, t))].clone() for t in range(len(SHAPES))]
            AtomAverager(plan, rank, communicators, bucket_bytes=64).average(local, weight=(1.5, 0.5)[f])
            out["weighted"] = [x.tolist() for x in local]
    dist.barrier()
    return out


def test_unequal_groups_average_to_the_mean_of_their_full_tensors():
    results = run_ranks(7, _job, timeout=300)
    for case, (sizes, shards) in CASES.items():
        plan = plan_for_shapes(groups_from_sizes(sizes, shards), SHAPES)
        costs = plan.costs()
        for bucket in BUCKETS:
            # each group's full tensors, reassembled from its ranks' shards
            assembled = []
            for f, g in enumerate(plan.groups):
                tensors = [torch.full((math.prod(s),), float("nan")) for s in SHAPES]
                for rank in range(g.first_rank, g.first_rank + g.size):
                    got, inter, intra, ledger_inter = results[rank][(case, bucket)]
                    for t, values in enumerate(got):
                        lo, hi = plan.shard_range(rank, t)
                        piece = torch.tensor(values, dtype=torch.float32)
                        seen = tensors[t][lo:hi]
                        if not seen.isnan().all():  # another replica of this shard: must agree exactly
                            assert torch.equal(seen, piece), (case, bucket, rank, t)
                        tensors[t][lo:hi] = piece
                    assert inter == ledger_inter == 4 * sum(a.length for a in plan.rank_atoms(rank))
                    assert inter <= 4 * costs[f].max_elements
                    own_shard = sum(hi - lo for lo, hi in (plan.shard_range(rank, t) for t in range(len(SHAPES))))
                    assert intra == (inter if g.replicas > 1 else 0) and inter * g.replicas >= 4 * own_shard - 64
                assembled.append(tensors)
            for t in range(len(SHAPES)):
                before = [_full(case, f, t) for f in range(len(plan.groups))]
                for f in range(len(plan.groups)):
                    assert not assembled[f][t].isnan().any()
                    assert torch.equal(assembled[f][t], assembled[0][t]), (case, bucket, t, f)
                if len(before) == 2:  # two groups: (a + b) / 2, bit for bit
                    assert torch.equal(assembled[0][t], (before[0] + before[1]) / 2), (case, bucket, t)
                else:
                    torch.testing.assert_close(assembled[0][t], sum(before) / len(before), rtol=1e-6, atol=1e-6)
    plan = plan_for_shapes(groups_from_sizes((4, 2)), SHAPES)
    for rank in range(6):
        for t, values in enumerate(results[rank]["weighted"]):
            lo, hi = plan.shard_range(rank, t)
            expected = (0.75 * _full("4+2", 0, t) + 0.25 * _full("4+2", 1, t))[lo:hi]
            torch.testing.assert_close(torch.tensor(values, dtype=torch.float32), expected, rtol=1e-6, atol=1e-6)

