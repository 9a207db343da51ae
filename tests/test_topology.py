"""Tests of fl_megatron.topology against brute-force enumeration of the rank formula."""

import itertools

import pytest

from fl_megatron.topology import (Layout, coords, federation_groups, make_layout, mesh_shape,
                                  node_of, peer_groups, rank_at, replica_groups, shard_groups,
                                  spans_nodes)


def brute_groups(layout, key):
    """Group ranks by key(f, r, s, node) using only the defining formulas."""
    g, s_n = layout.group_size, layout.shard_size
    buckets = {}
    for rank in range(layout.world_size):
        f, local = rank // g, rank % g
        r, s = local // s_n, local % s_n
        buckets.setdefault(key(f, r, s), []).append(rank)
    return sorted(sorted(v) for v in buckets.values())


def check_against_brute_force(layout):
    """Every group function equals the brute-force grouping and partitions range(N)."""
    expected = {
        federation_groups: brute_groups(layout, lambda f, r, s: f),
        shard_groups: brute_groups(layout, lambda f, r, s: (f, r)),
        replica_groups: brute_groups(layout, lambda f, r, s: (f, s)),
        peer_groups: brute_groups(layout, lambda f, r, s: (r, s)),
    }
    for fn, want in expected.items():
        got = fn(layout)
        assert got == want, fn.__name__
        assert all(ranks == sorted(ranks) for ranks in got)
        assert sorted(itertools.chain.from_iterable(got)) == list(range(layout.world_size))


def check_mesh(layout):
    """Row-major (F, P, S) enumeration of range(N) matches coords and the group lists."""
    f_n, p_n, s_n = mesh_shape(layout)
    assert f_n * p_n * s_n == layout.world_size
    mesh = list(itertools.product(range(f_n), range(p_n), range(s_n)))  # row-major order
    for rank, (f, r, s) in enumerate(mesh):
        assert coords(layout, rank) == (f, r, s)
        assert rank_at(layout, f, r, s) == rank
    dim0 = sorted([rank for rank, c in enumerate(mesh) if c[1:] == (r, s)]
                  for r in range(p_n) for s in range(s_n))
    dim1 = sorted([rank for rank, c in enumerate(mesh) if (c[0], c[2]) == (f, s)]
                  for f in range(f_n) for s in range(s_n))
    dim2 = sorted([rank for rank, c in enumerate(mesh) if c[:2] == (f, r)]
                  for f in range(f_n) for r in range(p_n))
    assert peer_groups(layout) == dim0
    assert replica_groups(layout) == dim1
    assert shard_groups(layout) == dim2


def nodes(layout, ranks):
    return {rank // layout.ranks_per_node for rank in ranks}


def test_512_ranks_groups_of_one_node():
    layout = make_layout(512, ranks_per_node=4, group_size=4)
    assert (layout.num_groups, layout.replicas, layout.shard_size) == (128, 1, 4)
    assert layout.is_federated and not layout.is_hsdp and layout.num_nodes == 128
    groups = federation_groups(layout)
    assert len(groups) == 128
    assert all(len(nodes(layout, g)) == 1 for g in groups)
    assert [nodes(layout, g) for g in groups] == [{i} for i in range(128)]
    peers = peer_groups(layout)
    assert len(peers) == 4 and all(len(p) == 128 for p in peers)
    for peer in peers:  # one rank per federation group
        assert sorted(rank // 4 for rank in peer) == list(range(128))
        assert spans_nodes(layout, peer)
    assert sorted(itertools.chain.from_iterable(groups)) == list(range(512))
    check_against_brute_force(layout)
    check_mesh(layout)


def test_512_ranks_hsdp_groups_of_32():
    layout = make_layout(512, ranks_per_node=4, group_size=32, shard_size=4)
    assert mesh_shape(layout) == (16, 8, 4)
    assert layout.is_hsdp and layout.is_federated
    groups = federation_groups(layout)
    assert len(groups) == 16
    for g in groups:  # 8 whole nodes each
        assert len(nodes(layout, g)) == 8
        assert all(set(range(n * 4, n * 4 + 4)) <= set(g) for n in nodes(layout, g))
    shards = shard_groups(layout)
    assert len(shards) == 128 and all(not spans_nodes(layout, s) for s in shards)
    replicas = replica_groups(layout)
    assert len(replicas) == 64
    assert all(len(r) == 8 and len(nodes(layout, r)) == 8 for r in replicas)
    peers = peer_groups(layout)
    assert len(peers) == 32 and all(len(p) == 16 for p in peers)
    check_against_brute_force(layout)
    check_mesh(layout)
    assert "16 federation groups of 32" in layout.describe()
    assert "8 replicas x 4 shards" in layout.describe()


def test_published_fsdp_layout():
    layout = make_layout(512, ranks_per_node=4)
    assert (layout.group_size, layout.shard_size, layout.replicas) == (512, 512, 1)
    assert not layout.is_federated and not layout.is_hsdp
    assert shard_groups(layout) == [list(range(512))]
    assert peer_groups(layout) == [[rank] for rank in range(512)]
    assert replica_groups(layout) == [[rank] for rank in range(512)]
    check_mesh(layout)


def test_published_hsdp_layout():
    layout = make_layout(512, ranks_per_node=4, shard_size=4)
    assert mesh_shape(layout) == (1, 128, 4)
    assert layout.is_hsdp and not layout.is_federated
    assert shard_groups(layout) == [list(range(n * 4, n * 4 + 4)) for n in range(128)]
    assert replica_groups(layout) == [list(range(s, 512, 4)) for s in range(4)]
    check_against_brute_force(layout)
    check_mesh(layout)


@pytest.mark.parametrize("kwargs, shape", [
    (dict(world_size=6, ranks_per_node=3, group_size=3), (2, 1, 3)),
    (dict(world_size=12, ranks_per_node=4, group_size=2), (6, 1, 2)),
    (dict(world_size=1), (1, 1, 1)),
    (dict(world_size=8, ranks_per_node=8, group_size=8, shard_size=2), (1, 4, 2)),
    (dict(world_size=6, ranks_per_node=8, group_size=3), (2, 1, 3)),  # one partial node
    (dict(world_size=16, num_groups=4, shard_size=2), (4, 2, 2)),
])
def test_odd_shapes(kwargs, shape):
    layout = make_layout(**kwargs)
    assert mesh_shape(layout) == shape
    check_against_brute_force(layout)
    check_mesh(layout)


def test_groups_tile_a_node():
    layout = make_layout(12, ranks_per_node=4, group_size=2)
    assert all(not spans_nodes(layout, g) for g in federation_groups(layout))
    assert [node_of(layout, g[0]) for g in federation_groups(layout)] == [0, 0, 1, 1, 2, 2]
    assert peer_groups(layout) == [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 11]]


def test_defaults():
    assert make_layout(4).ranks_per_node == 4
    assert make_layout(64).ranks_per_node == 8
    assert make_layout(64, num_groups=8).group_size == 8
    assert make_layout(64, num_groups=8, group_size=8).shard_size == 8
    assert make_layout(6, ranks_per_node=8).num_nodes == 1


def test_per_rank_helpers():
    layout = make_layout(16, ranks_per_node=4, group_size=8, shard_size=2)
    assert coords(layout, 13) == (1, 2, 1)  # 13 = 1*8 + 2*2 + 1
    assert node_of(layout, 13) == 3
    assert not spans_nodes(layout, [4, 5, 6, 7]) and spans_nodes(layout, [3, 4])
    assert not spans_nodes(layout, [])
    with pytest.raises(ValueError, match="rank=16"):
        coords(layout, 16)
    with pytest.raises(ValueError, match="rank=-1"):
        node_of(layout, -1)


def test_layout_is_validated_directly():
    with pytest.raises(ValueError, match="group_size=3 does not divide world_size=8"):
        Layout(8, 8, 3, 3)


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(world_size=512, ranks_per_node=4, group_size=6),
     r"group_size=6 does not divide world_size=512.*valid group sizes.*: 1, 2, 4, 8, 16"),
    (dict(world_size=24, ranks_per_node=4, group_size=6),
     r"group_size=6 is not a multiple of ranks_per_node=4.*valid group sizes.*"
     r": 1, 2, 4, 8, 12, 24"),
    (dict(world_size=32, ranks_per_node=4, group_size=8, shard_size=3),
     r"shard_size=3 does not divide group_size=8.*valid shard sizes.*: 1, 2, 4, 8"),
    (dict(world_size=48, ranks_per_node=4, group_size=12, shard_size=3),
     r"shard_size=3 is not a divisor of ranks_per_node=4.*valid shard sizes.*: 1, 2, 4, 12"),
    (dict(world_size=48, ranks_per_node=4, group_size=12, shard_size=6),
     r"shard_size=6 is not a multiple of ranks_per_node=4.*valid shard sizes.*: 1, 2, 4, 12"),
    (dict(world_size=24, ranks_per_node=4, group_size=4, num_groups=3),
     r"num_groups=3 and group_size=4 disagree.*needs group_size=8"),
    (dict(world_size=8, num_groups=3),
     r"num_groups=3 does not divide world_size=8.*valid numbers of groups: 1, 2, 4, 8"),
    (dict(world_size=10, ranks_per_node=4),
     r"world_size=10 is not a multiple of ranks_per_node=4.*valid ranks_per_node.*1, 2, 5, 10"),
    (dict(world_size=0), r"world_size=0 must be a positive integer"),
    (dict(world_size=8, ranks_per_node=-2), r"ranks_per_node=-2 must be a positive integer"),
    (dict(world_size=8, group_size=0), r"group_size=0 must be a positive integer"),
    (dict(world_size=8, shard_size=-4), r"shard_size=-4 must be a positive integer"),
    (dict(world_size=8, num_groups=0), r"num_groups=0 must be a positive integer"),
])
def test_invalid_layouts(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        make_layout(**kwargs)


def test_all_problems_reported_together():
    with pytest.raises(ValueError) as info:
        make_layout(24, ranks_per_node=4, group_size=6, shard_size=5)
    message = str(info.value)
    assert "group_size=6 is not a multiple of ranks_per_node=4" in message
    assert "shard_size=5 does not divide group_size=6" in message
    with pytest.raises(ValueError) as info:
        make_layout(0, ranks_per_node=0, group_size=-1)
    assert all(part in str(info.value)
               for part in ("world_size=0", "ranks_per_node=0", "group_size=-1"))


def test_suggested_sizes_are_valid():
    """Every size a message suggests really builds a layout."""
    for g in (1, 2, 4, 8, 12, 24):
        make_layout(24, ranks_per_node=4, group_size=g)
    for s in (1, 2, 4, 12):
        make_layout(48, ranks_per_node=4, group_size=12, shard_size=s)
