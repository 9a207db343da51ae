"""Brute-force checks of fl_megatron.federation.chunks.plan_chunks on many random shapes."""

import random

import pytest

from fl_megatron.federation.chunks import Chunk, Segment, plan_chunks


def _random_case(rng: random.Random):
    replicas = rng.choice([1, 1, 2, 3, 4, 8])
    bucket = rng.randint(replicas, 64)
    n = rng.randint(0, 12)
    numels = [rng.choice([0, rng.randint(1, 8), rng.randint(1, 3 * bucket + 5)]) for _ in range(n)]
    # inplace_min: either default, or a value inside [replicas, bucket] so it is not clamped
    inplace_min = rng.choice([None, rng.randint(max(replicas, 1), bucket)])
    return numels, bucket, replicas, inplace_min


CASES = [_random_case(random.Random(seed)) for seed in range(200)]
# hand-picked corners
CASES += [
    ([], 4, 1, None),
    ([0, 0, 0], 4, 2, None),
    ([1], 1, 1, None),
    ([100], 7, 3, 3),           # bucket not a multiple of replicas
    ([9, 9, 9], 8, 8, 8),       # tail of 1 each
    ([5, 1, 5, 1, 5], 5, 1, 5),
    ([64 * 1024 + 3, 17, 2], 1024, 4, None),
]


def _effective_inplace_min(bucket, replicas, inplace_min):
    """Documented threshold: a shard of at least this many elements is in place (default bucket // 8)."""
    threshold = bucket // 8 if inplace_min is None else inplace_min
    # a piece must hold at least one multiple of `replicas` and never exceed one bucket
    return max(threshold, replicas, 1)


@pytest.mark.parametrize("numels,bucket,replicas,inplace_min", CASES)
def test_plan_covers_every_element_once_and_respects_limits(numels, bucket, replicas, inplace_min):
    chunks = plan_chunks(numels, bucket, replicas=replicas, inplace_min=inplace_min)
    coverage = [[0] * n for n in numels]
    next_start = [0] * len(numels)   # segments of one shard must come in increasing order
    inplace_of = [[] for _ in numels]
    packed_of = [[] for _ in numels]
    threshold = _effective_inplace_min(bucket, replicas, inplace_min)

    for chunk in chunks:
        assert isinstance(chunk, Chunk)
        assert chunk.segments, "empty chunk"
        total = 0
        for seg in chunk.segments:
            assert isinstance(seg, Segment)
            assert 0 <= seg.index < len(numels)
            assert seg.length > 0, f"empty segment {seg}"
            assert 0 <= seg.start and seg.start + seg.length <= numels[seg.index]
            assert seg.start == next_start[seg.index], "segments of a shard out of order or with a gap"
            next_start[seg.index] = seg.start + seg.length
            for k in range(seg.start, seg.start + seg.length):
                coverage[seg.index][k] += 1
            total += seg.length
            (inplace_of if chunk.inplace else packed_of)[seg.index].append(seg)
        assert chunk.length == total
        padded = chunk.padded_length(replicas)
        assert padded % replicas == 0 and total <= padded < total + replicas
        if chunk.inplace:
            assert len(chunk.segments) == 1
            assert total % replicas == 0
            assert total <= max(8 * bucket, replicas)   # in-place pieces: at most 8 buckets
            assert padded == total
        else:
            assert total <= bucket, f"packed chunk of {total} > bucket {bucket}"
            idx = [s.index for s in chunk.segments]
            assert idx == sorted(idx) and len(set(idx)) == len(idx)

    for i, n in enumerate(numels):
        assert coverage[i] == [1] * n, f"shard {i} not covered exactly once"
        tail = n % replicas
        if n >= threshold:
            # only the tail of n % replicas elements may be packed
            assert sum(s.length for s in packed_of[i]) == tail
            if tail:
                assert packed_of[i][0].start == n - tail
            body = n - tail
            piece = max(8 * bucket, replicas) // replicas * replicas
            assert len(inplace_of[i]) == -(-body // piece)   # pieces as large as allowed
        else:
            assert not inplace_of[i], f"shard {i} of {n} < {threshold} elements was done in place"


@pytest.mark.parametrize("numels,bucket,replicas,inplace_min", CASES[:60])
def test_packed_buckets_are_filled_greedily(numels, bucket, replicas, inplace_min):
    """A packed bucket is closed only when the next packed segment would not fit."""
    chunks = plan_chunks(numels, bucket, replicas=replicas, inplace_min=inplace_min)
    packed = [c for c in chunks if not c.inplace]
    for a, b in zip(packed, packed[1:]):
        assert a.length + b.segments[0].length > bucket


def test_zero_size_shards_are_skipped():
    chunks = plan_chunks([0, 3, 0, 0, 5, 0], 16)
    segs = [s for c in chunks for s in c.segments]
    assert all(s.length > 0 for s in segs)
    assert {s.index for s in segs} == {1, 4}
    assert plan_chunks([0, 0], 16, replicas=2) == []


def test_inplace_min_boundary():
    # exactly inplace_min -> in place; one less -> packed
    chunks = plan_chunks([6, 5], 8, replicas=2, inplace_min=6)
    assert chunks[0] == Chunk((Segment(0, 0, 6),), inplace=True)
    assert chunks[1] == Chunk((Segment(1, 0, 5),), inplace=False)
    # odd shard >= threshold: body in place, tail of numel % replicas packed
    chunks = plan_chunks([7], 8, replicas=2, inplace_min=6)
    assert chunks == [Chunk((Segment(0, 0, 6),), inplace=True), Chunk((Segment(0, 6, 1),), inplace=False)]


@pytest.mark.parametrize("bucket,replicas", [(3, 4), (0, 1), (1, 2), (5, 0), (5, -1), (0, 0)])
def test_invalid_bucket_or_replicas_raise(bucket, replicas):
    with pytest.raises(ValueError, match=f"bucket of {bucket} elements is smaller than replicas={replicas}|"
                                         f"replicas={replicas} must be at least 1"):
        plan_chunks([10, 3], bucket, replicas=replicas)


def test_inplace_max_limits_the_pieces():
    chunks = plan_chunks([100], 10, replicas=4, inplace_max=30)
    assert [c.segments[0].length for c in chunks] == [28, 28, 28, 16]
    assert all(c.inplace for c in chunks)
