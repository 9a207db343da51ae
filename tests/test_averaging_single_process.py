"""ShardAverager on a 1-rank gloo group (averaging over one member is the identity), and sync_due."""

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("bucket_bytes", [1, 4, 16, 40, 100, 256, 1 << 20])
def test_one_member_average_is_identity(world, dtype, bucket_bytes):
    shards = _shards(dtype, seed=bucket_bytes)
    before = [s.clone() for s in shards]
    ledger = CommLedger()
    avg = ShardAverager(world, 1, bucket_bytes=bucket_bytes, ledger=ledger)
    stats = avg.average(shards)
    for b, s in zip(before, shards):
        assert s.shape == b.shape and s.dtype == b.dtype
        # bit for bit: compare the raw bytes
        assert torch.equal(s.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    naive = sum(s.numel() * s.element_size() for s in before)
    assert stats.inter_group_bytes == naive
    assert stats.intra_group_bytes == 0
    assert ledger.snapshot() == {"intra_group_bytes": 0, "inter_group_bytes": naive,
                                 "intra_node_bytes": 0, "inter_node_bytes": naive}
    # no element moves away from the (trivial) average
    assert stats.sq_dev_sum == 0.0
    # every collective carries at most 8 buckets (in-place pieces; packed ones hold one bucket)
    bucket_elems = max(bucket_bytes // before[0].element_size(), 1)
    total = sum(s.numel() for s in before)
    assert stats.collectives >= math.ceil(total / (8 * bucket_elems))


@pytest.mark.parametrize("bucket_bytes", [8, 64, 1 << 20])
def test_metric_sums_with_every_element_sampled(world, bucket_bytes):
    shards = _shards(torch.float32, seed=3)
    ref = sum(float(s.double().pow(2).sum()) for s in shards)
    stats = ShardAverager(world, 1, bucket_bytes=bucket_bytes, max_samples=1 << 20).average(shards)
    assert stats.samples == sum(s.numel() for s in shards)
    assert stats.sq_mean_sum == pytest.approx(ref, rel=1e-12)


def test_shards_that_are_views_of_one_buffer(world):
    """Shards narrowed out of one flat buffer: writing back must not touch the gaps between them."""
    buf = torch.randn(200, dtype=torch.float32, generator=torch.Generator().manual_seed(5))
    ref = buf.clone()
    rng = random.Random(1)
    shards, pos = [], 0
    while pos < 180:
        n = rng.randint(0, 25)
        shards.append(buf.narrow(0, pos, n))
        pos += n + rng.randint(0, 3)
    stats = ShardAverager(world, 1, bucket_bytes=24).average(shards)
    assert torch.equal(buf.view(torch.uint8), ref.view(torch.uint8))
    assert stats.inter_group_bytes == 4 * sum(s.numel() for s in shards)


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
    """The non-gloo branch of gather_slices (NCCL's in-place all_gather_into_tensor), in one
    process against a fake group of 2: this rank owns slice 1, passes it as the input aliasing
    its place in the output, and ends with every owner's slice in order."""
    from fl_megatron.federation import averaging

    buffer = torch.full((12,), -1.0)
    buffer[6:] = torch.arange(6.0, 12.0)  # slice 1: averaged by this rank
    peer_slice = torch.arange(0.0, 6.0)   # slice 0: averaged by the other replica
    seen = []

    def all_gather_into_tensor(output, inp, group=None):
        seen.append((output.data_ptr() == buffer.data_ptr(), inp.data_ptr() == buffer[6:].data_ptr(),
                     group))
        output.copy_(torch.cat([peer_slice, inp.clone()]))

    group = object()
    monkeypatch.setattr(averaging.dist, "get_backend", lambda g: "nccl")
    monkeypatch.setattr(averaging.dist, "get_world_size", lambda g: 2)
    monkeypatch.setattr(averaging.dist, "all_gather_into_tensor", all_gather_into_tensor)
    averaging.gather_slices(buffer, 1, group)
    assert seen == [(True, True, group)]
    assert torch.equal(buffer, torch.arange(12.0))
