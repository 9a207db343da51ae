"""ShardAverager across 2 groups (2 processes) against the closed-form mean, its argument checks on
a 1-rank gloo group, and sync_due."""

import math
import random

import pytest
import torch

from fl_megatron.federation.averaging import ShardAverager
from fl_megatron.federation.ledger import CommLedger
from fl_megatron.federation.schedule import sync_due


SHAPES = [(7,), (3, 5), (), (0,), (128,), (2, 3, 4), (1,), (33,), (0, 4), (65, 3)]


def _shards(dtype, seed=0, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]


DTYPES = [torch.float32, torch.float64, torch.bfloat16]
BUCKETS = [1, 4, 16, 40, 100, 256, 1 << 20]


def _plain(t: torch.Tensor) -> tuple:
    """A tensor as picklable plain values (exact: every dtype here fits in float64)."""
    return t.double().reshape(-1).tolist(), tuple(t.shape), str(t.dtype)


def _tensor(plain: tuple) -> torch.Tensor:
    values, shape, dtype = plain
    return torch.tensor(values, dtype=torch.float64).reshape(shape).to(getattr(torch, dtype.split(".")[1]))


def _two_groups_job(rank, world):
    """Rank r holds group r's shards (seed r); every bucketing, dtype and view layout averages
    them. Returns what the parent compares with the closed-form mean."""
    out = {}
    group = torch.distributed.group.WORLD
    for dtype in DTYPES:
        for bucket_bytes in BUCKETS:
            shards = _shards(dtype, seed=100 * bucket_bytes + rank)
            ledger = CommLedger()
            stats = ShardAverager(group, 2, bucket_bytes=bucket_bytes, ledger=ledger).average(shards)
            out[(str(dtype), bucket_bytes)] = ([_plain(s) for s in shards], stats.inter_group_bytes,
                                               stats.intra_group_bytes, stats.collectives, ledger.snapshot())
    for bucket_bytes in (8, 64, 1 << 20):  # the metric sums, every element sampled
        stats = ShardAverager(group, 2, bucket_bytes=bucket_bytes, max_samples=1 << 20).average(
            _shards(torch.float32, seed=3 + rank))
        out[("metrics", bucket_bytes)] = (stats.samples, stats.sq_dev_sum, stats.sq_mean_sum)
    # shards narrowed out of one flat buffer: the gaps between them must not move
    buf = torch.randn(200, dtype=torch.float32, generator=torch.Generator().manual_seed(5 + rank))
    rng = random.Random(1)  # the same layout on both ranks
    views, pos = [], 0
    while pos < 180:
        n = rng.randint(0, 25)
        views.append((pos, n))
        pos += n + rng.randint(0, 3)
    ShardAverager(group, 2, bucket_bytes=24).average([buf.narrow(0, a, n) for a, n in views])
    out["views"] = (_plain(buf), views)
    # token weights 3 : 1 (vote.token_weight: 1.5 and 0.5), exact and int8; a sender alone (weight 1)
    for dtype in ("fp32", "int8"):
        shards = _shards(torch.float32, seed=7 + rank)
        ShardAverager(group, 2, bucket_bytes=64, sync_dtype=dtype).average(shards, weight=(1.5, 0.5)[rank])
        out[("weighted", dtype)] = [_plain(s) for s in shards]
    shards = _shards(torch.float32, seed=7 + rank)
    ShardAverager(group, 2, bucket_bytes=64).average(shards, include=rank == 0, contributors=1, weight=1.0)
    out["weighted alone"] = [_plain(s) for s in shards]
    return out


def test_two_groups_average_to_the_closed_form_mean_whatever_the_bucketing():
    """2 groups (2 processes): every dtype and bucket size gives (a + b) / 2 (fp32/fp64 bit for
    bit; bf16 within its rounding), reports the bytes each rank sent, and leaves no element behind."""
    from fl_megatron.local_ranks import run_ranks

    r0, r1 = run_ranks(2, _two_groups_job, timeout=300)
    for dtype in DTYPES:
        for bucket_bytes in BUCKETS:
            key = (str(dtype), bucket_bytes)
            a, b = _shards(dtype, seed=100 * bucket_bytes), _shards(dtype, seed=100 * bucket_bytes + 1)
            for got, inter, intra, collectives, ledger in (r0[key], r1[key]):
                for x, y, g in zip(a, b, map(_tensor, got)):
                    mean = ((x.double() + y.double()) / 2).to(dtype)
                    assert g.shape == x.shape and g.dtype == dtype
                    if dtype == torch.bfloat16:
                        torch.testing.assert_close(g, mean, rtol=1e-2, atol=1e-2)
                    else:
                        assert torch.equal(g, (x + y) / 2), (key, (g - mean).abs().max())
                naive = sum(x.numel() * x.element_size() for x in a)
                assert (inter, intra) == (naive, 0), key
                assert ledger == {"intra_group_bytes": 0, "inter_group_bytes": naive, "intra_node_bytes": 0,
                                  "inter_node_bytes": naive}
                bucket_elems = max(bucket_bytes // a[0].element_size(), 1)
                assert collectives >= math.ceil(sum(x.numel() for x in a) / (8 * bucket_elems))
            assert r0[key][0] == r1[key][0]
    for bucket_bytes in (8, 64, 1 << 20):
        a, b = _shards(torch.float32, seed=3), _shards(torch.float32, seed=4)
        half_gap = sum(float(((x.double() - y.double()) / 2).pow(2).sum()) for x, y in zip(a, b))
        mean_sq = sum(float(((x.double() + y.double()) / 2).pow(2).sum()) for x, y in zip(a, b))
        for samples, sq_dev, sq_mean in (r0[("metrics", bucket_bytes)], r1[("metrics", bucket_bytes)]):
            assert samples == sum(x.numel() for x in a)
            assert sq_dev == pytest.approx(half_gap, rel=1e-5) and sq_mean == pytest.approx(mean_sq, rel=1e-5)
    (buf0, views), (buf1, _) = r0["views"], r1["views"]
    buf0, buf1 = _tensor(buf0), _tensor(buf1)
    raw = [torch.randn(200, dtype=torch.float32, generator=torch.Generator().manual_seed(5 + r)) for r in (0, 1)]
    inside = torch.zeros(200, dtype=torch.bool)
    for start, n in views:
        inside[start:start + n] = True
    assert torch.equal(buf0[inside], (raw[0][inside] + raw[1][inside]) / 2) and torch.equal(buf0[inside], buf1[inside])
    assert torch.equal(buf0[~inside], raw[0][~inside]) and torch.equal(buf1[~inside], raw[1][~inside])
    a, b = _shards(torch.float32, seed=7), _shards(torch.float32, seed=8)
    for dtype, tol in (("fp32", 1e-6), ("int8", 0.05)):
        for got in (r0[("weighted", dtype)], r1[("weighted", dtype)]):
            for x, y, g in zip(a, b, map(_tensor, got)):
                torch.testing.assert_close(g, 0.75 * x + 0.25 * y, rtol=tol, atol=tol)
                if x.numel() > 1 and dtype == "fp32":  # not the plain mean
                    assert not torch.allclose(g, (x + y) / 2)
    for got in (r0["weighted alone"], r1["weighted alone"]):  # group 1 left out: group 0's values
        assert all(torch.equal(_tensor(g), x) for g, x in zip(got, a))


def test_empty_list(world):
    stats = ShardAverager(world, 1).average([])
    assert (stats.inter_group_bytes, stats.collectives, stats.samples) == (0, 0, 0)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(4, 6).t(),
    lambda: torch.randn(20)[::2],
    lambda: torch.randn(5, 6)[:, 1:4],
])
def test_non_contiguous_shard_raises(world, make):
    bad = make()
    assert not bad.is_contiguous()
    good = torch.randn(8)
    before = good.clone()
    with pytest.raises(ValueError, match="shard 1 is not contiguous"):
        ShardAverager(world, 1).average([good, bad])
    assert torch.equal(good, before)


def test_mixed_dtypes_raise(world):
    with pytest.raises(ValueError, match=r"mixed dtypes \['torch.float32', 'torch.float64'\]"):
        ShardAverager(world, 1).average([torch.zeros(3), torch.zeros(3, dtype=torch.float64)])


@pytest.mark.parametrize("kwargs", [
    dict(num_groups=0), dict(num_groups=1, replicas=0), dict(num_groups=1, replicas=2, replica_index=2),
    dict(num_groups=1, replicas=2, replica_index=-1), dict(num_groups=1, replicas=2),  # split needs a group
])
def test_inconsistent_constructor_arguments_raise(kwargs):
    with pytest.raises(ValueError, match="are inconsistent|replica split needs the replica process group"):
        ShardAverager(None, **kwargs)


# ---------------------------------------------------------------------------- sync_due


def _due_brute_force(step, interval, last, federated):
    if not federated or interval == 0:
        return False
    multiples = set(range(interval, 51, interval))
    return step in multiples or last


@pytest.mark.parametrize("federated", [True, False])
@pytest.mark.parametrize("last", [True, False])
def test_sync_due_brute_force(federated, last):
    for interval in range(0, 8):
        for step in range(1, 51):
            assert sync_due(step, interval, last, federated) == _due_brute_force(step, interval, last, federated), \
                (step, interval, last, federated)


def test_sync_due_default_is_federated():
    assert sync_due(6, 3, False) is True
    assert sync_due(7, 3, False) is False


@pytest.mark.parametrize("step", [0, -1, -10])
def test_sync_due_rejects_step_below_one(step):
    with pytest.raises(ValueError, match=f"step={step} must count completed optimizer steps from 1"):
        sync_due(step, 1, False)


def test_gather_slices_on_nccl_gathers_in_place_into_the_owners_slices(monkeypatch):
    """The non-gloo branch of gather_slices (NCCL's in-place all-gather into one tensor), in one
    process against a fake group of 2: this rank owns slice 1, passes it as the input aliasing
    its place in the output, and ends with every owner's slice in order."""
    from fl_megatron.federation import averaging

    buffer = torch.full((12,), -1.0)
    buffer[6:] = torch.arange(6.0, 12.0)  # slice 1: averaged by this rank
    peer_slice = torch.arange(0.0, 6.0)   # slice 0: averaged by the other replica
    seen = []

    def all_gather_flat(output, inp, group=None):
        seen.append((output.data_ptr() == buffer.data_ptr(), inp.data_ptr() == buffer[6:].data_ptr(),
                     group))
        output.copy_(torch.cat([peer_slice, inp.clone()]))

    group = object()
    monkeypatch.setattr(averaging.dist, "get_backend", lambda g: "nccl")
    monkeypatch.setattr(averaging.dist, "get_world_size", lambda g: 2)
    monkeypatch.setattr(averaging, "all_gather_flat", all_gather_flat)
    averaging.gather_slices(buffer, 1, group)
    assert seen == [(True, True, group)]
    assert torch.equal(buffer, torch.arange(12.0))
