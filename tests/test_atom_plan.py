"""The averaging plan over groups of unequal size (atom_plan) and their layout (group_layout),
checked element by element against torch.chunk's cut (what FSDP2 uses) and today's peer groups."""

import math
import time

import pytest
import torch

from fl_megatron.atom_plan import (GroupShape, fsdp2_cuts, flat_cuts, groups_from_sizes, plan_atoms,
                                   plan_for_shapes)
from fl_megatron.group_layout import make_group_layout
from fl_megatron.topology import make_layout, peer_groups

SHAPES = [(10, 3), (7,), (1, 5), (3, 4), (64, 2), (16,), (0, 4), (13, 1), (40,)]

MIXES = [  # (group sizes, shard sizes): FSDP mixes, then HSDP mixes
    ((8, 4), None), ((6, 4), None), ((4, 2, 1), None), ((16, 6), None), ((3, 5, 2), None),
    ((8, 4), (4, 2)), ((8, 6), (4, 6)), ((4, 2, 1), (2, 1, 1)), ((16, 6), (8, 3)), ((12, 4), (4, 4)),
]



def _chunk_owner(shape, group: GroupShape) -> list:
    """Element -> global owner rank in `group`, from torch.chunk's rows and each shard's P
    replica slices (ceil): the reference the plan must match."""
    rows = shape[0] if shape else 1
    row_elements = math.prod(shape[1:]) if shape else 1
    owner = [None] * math.prod(shape)
    chunks = list(torch.arange(rows).chunk(group.shard_size)) if rows else []
    for s, chunk in enumerate(chunks):
        if chunk.numel() == 0:
            continue
        lo, hi = int(chunk[0]) * row_elements, (int(chunk[-1]) + 1) * row_elements
        per = -(-(hi - lo) // group.replicas)
        for e in range(lo, hi):
            owner[e] = group.rank((e - lo) // per, s)
    return owner


@pytest.mark.parametrize("sizes,shards", MIXES)
def test_every_element_of_every_group_is_averaged_exactly_once_by_its_holder(sizes, shards):
    groups = groups_from_sizes(sizes, shards or ())
    plan = plan_for_shapes(groups, SHAPES)
    for t, shape in enumerate(SHAPES):
        atoms = [a for a in plan.atoms if a.tensor == t]
        covered = [0] * math.prod(shape)
        for a in atoms:
            assert a.start < a.stop
            for e in range(a.start, a.stop):
                covered[e] += 1
        assert covered == [1] * math.prod(shape), (t, shape)
        for f, g in enumerate(groups):
            owner = _chunk_owner(shape, g)
            for a in atoms:
                assert set(owner[a.start:a.stop]) == {a.owners[f]}, (t, f, a)
                assert g.first_rank <= a.owners[f] < g.first_rank + g.size
    # every rank's atoms lie inside its own shard, and a group's ranks together average the whole model
    total = sum(math.prod(s) for s in SHAPES)
    for g in groups:
        assert sum(a.length for r in range(g.first_rank, g.first_rank + g.size) for a in plan.rank_atoms(r)) == total
        for r in range(g.first_rank, g.first_rank + g.size):
            for a in plan.rank_atoms(r):
                lo, hi = plan.shard_range(r, a.tensor)
                assert lo <= a.start and a.stop <= hi


@pytest.mark.parametrize("world,group,shard", [(8, 4, 4), (12, 4, 2), (16, 8, 2), (6, 2, 1), (24, 8, 8)])
def test_equal_groups_give_todays_peer_groups_exactly(world, group, shard):
    layout = make_layout(world, ranks_per_node=world, group_size=group, shard_size=shard)
    shapes = [(64, 3), (128,), (32, 8)]  # every shard and replica slice non-empty
    plan = plan_for_shapes(groups_from_sizes((group,) * (world // group), (shard,) * (world // group)), shapes)
    assert plan.owner_tuples() == sorted(tuple(p) for p in peer_groups(layout))
    for rank in range(world):
        assert {a.owners for a in plan.rank_atoms(rank)} == {next(tuple(p) for p in peer_groups(layout) if rank in p)}
        assert all(c.max_communicators == 1 for c in plan.costs())


def test_smaller_groups_carry_more_and_the_costs_count_it():
    """8 + 4 FSDP ranks on shapes that divide evenly: each 4-group rank averages twice the
    elements of an 8-group rank, with 2 communicators (one per 8-group rank its range meets)."""
    plan = plan_for_shapes(groups_from_sizes((8, 4)), [(64, 4), (32,)])
    big, small = plan.costs()
    assert (big.max_elements, big.min_elements) == (36, 36)
    assert (small.max_elements, small.min_elements) == (72, 72)
    assert (big.max_communicators, small.max_communicators) == (1, 2)
    assert "2 communicators" in small.line(4) and "72 elements" in small.line(4)


def test_flat_rule_is_deepspeed_ceil_partitioning():
    assert flat_cuts(10, 4) == (0, 3, 6, 9, 10)
    assert flat_cuts(2, 4) == (0, 1, 2, 2, 2)
    assert fsdp2_cuts((10, 3), 4) == (0, 9, 18, 27, 30)
    plan = plan_for_shapes(groups_from_sizes((4, 3)), [(10,), (5, 2)], rule="flat")
    assert [(a.start, a.stop, a.owners) for a in plan.atoms if a.tensor == 0] == [
        (0, 3, (0, 4)), (3, 4, (1, 4)), (4, 6, (1, 5)), (6, 8, (2, 5)), (8, 9, (2, 6)), (9, 10, (3, 6))]


def test_bad_cuts_and_shapes_are_refused_with_the_reason():
    groups = groups_from_sizes((2, 1))
    with pytest.raises(ValueError, match="do not tile"):
        plan_atoms(groups, [[(0, 3, 5), (0, 6)]], [6])
    with pytest.raises(ValueError, match="need 3"):
        plan_atoms(groups, [[(0, 6), (0, 6)]], [6])
    with pytest.raises(ValueError, match="does not divide"):
        GroupShape(0, 6, 4)


def _llama_8b_shapes():
    h, ffn, vocab, kv = 4096, 14336, 128256, 1024
    shapes = [(vocab, h)]
    for _ in range(32):
        shapes += [(h, h), (kv, h), (kv, h), (h, h), (ffn, h), (ffn, h), (h, ffn), (h,), (h,)]
    return shapes + [(h,), (vocab, h)]


@pytest.mark.parametrize("sizes,shards", [((384, 128), None), ((256, 192, 64), None), ((320, 192), (64, 32))])
def test_512_ranks_of_an_8b_model_are_planned_in_under_a_second(sizes, shards):
    shapes = _llama_8b_shapes()
    began = time.perf_counter()
    plan = plan_for_shapes(groups_from_sizes(sizes, shards or ()), shapes)
    seconds = time.perf_counter() - began
    assert seconds < 1.0, seconds
    costs = plan.costs()
    total = sum(math.prod(s) for s in shapes)
    assert sum(len(plan.rank_atoms(r)) > 0 for r in range(512)) == 512
    for cost, size in zip(costs, sizes):  # a group's ranks share the whole model
        assert cost.min_elements <= total / size <= cost.max_elements


def test_group_layout_is_checked_node_by_node():
    layout = make_group_layout((8, 4, 4), ranks_per_node=4, shard_sizes=(4, 4, 2))
    assert layout.world_size == 16 and layout.groups[2].first_rank == 12 and layout.groups[2].replicas == 2
    assert layout.group_lines() == ["group 0: 8 ranks (0-7, nodes 0-1), FSDP over 4".replace("FSDP over 4",
                                                                                           "HSDP 2 replicas x 4 shards"),
                                 "group 1: 4 ranks (8-11, node 2), FSDP over 4",
                                 "group 2: 4 ranks (12-15, node 3), HSDP 2 replicas x 2 shards"]
    assert [layout.group_of(r) for r in (0, 7, 8, 15)] == [0, 0, 1, 2]
    assert layout.describe().splitlines()[0] == ("16 ranks on 4 nodes x 4, 3 federation groups of unequal size "
                                                 "(8+4+4)")
    seen = layout.seen_from(13)  # what a rank of group 2 reads, as from an equal Layout
    assert (seen.group, seen.group_size, seen.shard_size, seen.replicas, seen.is_hsdp) == (2, 4, 2, 2, True)
    assert (seen.world_size, seen.num_groups, seen.is_federated) == (16, 3, True)
    with pytest.raises(ValueError) as e:
        make_group_layout((6, 2), ranks_per_node=4)
    assert "group 0 (ranks 0-5) must cover whole nodes of 4 ranks" in str(e.value)
    assert "group 1 (ranks 6-7) straddles nodes" not in str(e.value)  # 6-7 lie in node 1
    with pytest.raises(ValueError, match="group 1: shard size 3 does not divide its size 4"):
        make_group_layout((4, 4), ranks_per_node=4, shard_sizes=(4, 3))
    with pytest.raises(ValueError, match="straddles nodes 0 and 1"):
        make_group_layout((2, 1, 2, 3), ranks_per_node=4)
    with pytest.raises(ValueError, match="not a multiple of ranks_per_node=8"):
        make_group_layout((8, 4), ranks_per_node=8)
    equal = make_group_layout((4, 4), ranks_per_node=4, shard_sizes=(2, 2))
    assert equal.is_equal and equal.as_equal_layout() == make_layout(8, 4, 4, shard_size=2)
    assert make_group_layout((4, 2, 1, 1), ranks_per_node=8).group_lines()[2] == "group 2: 1 rank (6-6, node 0), FSDP over 1"
