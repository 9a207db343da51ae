"""GPT samples over indexed datasets: Megatron's semantics (samples of seq_length + 1 tokens
running across document boundaries), seeded epochs, resumption, blends, caches, errors.

Documents hold unique token ids (document d, position j -> d * 1000 + j), so every sample can
be traced back to where its tokens came from.
"""

import numpy as np
import pytest

from fl_megatron.config.data import parse_data_path, parse_split
from fl_megatron.data import BatchSource
from fl_megatron.data.gpt_dataset import BlendedSamples, DocumentSamples, MockSamples, build_split_samples
from fl_megatron.data.indexed import IndexedDataset, IndexedDatasetWriter

SEQ = 8


def _write(prefix, lengths, base=0):
    with IndexedDatasetWriter(prefix, np.int32) as w:
        for d, n in enumerate(lengths):
            w.add_document(base + d * 1000 + np.arange(n))
    return str(prefix)


@pytest.fixture
def corpus(tmp_path):
    rng = np.random.default_rng(0)
    return _write(tmp_path / "corpus", rng.integers(1, 40, size=60))


def _samples(prefix, seed=1, cache=None, split="100,0,0", which="train"):
    return build_split_samples([prefix], split, which, SEQ, seed, cache)


def _is_stream_piece(sample) -> bool:
    """Consecutive tokens either follow each other inside a document or jump to a document start."""
    for a, b in zip(sample[:-1], sample[1:]):
        if not (b == a + 1 and b // 1000 == a // 1000) and b % 1000 != 0:
            return False
    return True


def test_an_epoch_covers_every_token_once_in_samples_across_document_boundaries(corpus):
    samples = _samples(corpus)
    dataset = IndexedDataset(corpus)
    total = int(dataset.sequence_lengths.sum())
    assert len(samples) == (total - 1) // SEQ
    epoch = [samples[k] for k in range(len(samples))]
    assert all(s.shape == (SEQ + 1,) and s.dtype == np.int64 for s in epoch)
    assert all(_is_stream_piece(s) for s in epoch)
    crossing = sum(len({t // 1000 for t in s}) > 1 for s in epoch)
    assert crossing > 0  # samples do run across document boundaries
    body = np.concatenate([s[:-1] for s in epoch])
    assert len(np.unique(body)) == len(body) == len(samples) * SEQ  # no token twice in an epoch
    assert total - len(body) <= SEQ  # only the stream's tail (less than one sample) is left out
    # the label token of a sample is the first token of the sample after it in the stream
    firsts = {int(s[0]) for s in epoch}
    assert sum(int(s[-1]) in firsts for s in epoch) >= len(epoch) - 1


def test_seeded_order_new_epochs_and_resumption(corpus, tmp_path):
    a, b, other = _samples(corpus, seed=1), _samples(corpus, seed=1), _samples(corpus, seed=2)
    n = len(a)
    assert all(np.array_equal(a[k], b[k]) for k in range(0, 3 * n, 7))
    assert not all(np.array_equal(a[k], other[k]) for k in range(10))
    # epoch 1 reads the same tokens in another order (each epoch leaves out a different tail
    # of less than one sample)
    e0 = [tuple(a[k][:-1]) for k in range(n)]
    e1 = [tuple(a[k][:-1]) for k in range(n, 2 * n)]
    assert e1 != e0
    tokens0, tokens1 = {t for s in e0 for t in s}, {t for s in e1 for t in s}
    assert len(tokens1) == n * SEQ and len(tokens0 ^ tokens1) <= 2 * SEQ
    # resuming at a consumed-samples count in a new process (new object, cache on disk) reads
    # exactly what the uninterrupted run reads from there on
    world, mbs, accum = 4, 2, 1
    cache = tmp_path / "cache"
    first = _samples(corpus, seed=3, cache=cache)
    first.prepare_for(5 * n)
    uninterrupted = BatchSource(first, None, world, mbs, accum)
    resumed = BatchSource(_samples(corpus, seed=3, cache=cache), None, world, mbs, accum)
    consumed_steps = 5
    for step in range(consumed_steps, consumed_steps + 6):
        for rank in range(world):
            assert np.array_equal(uninterrupted.micro_batch(rank, step, 0), resumed.micro_batch(rank, step, 0))


def test_no_sample_is_read_twice_by_two_ranks_within_an_epoch(corpus):
    samples = _samples(corpus, seed=5)
    world, mbs, accum = 4, 2, 2
    source = BatchSource(samples, None, world, mbs, accum)
    per_step = world * mbs * accum
    seen = []
    for step in range(len(samples) // per_step):
        for rank in range(world):
            for micro in range(accum):
                seen += [tuple(row) for row in source.micro_batch(rank, step, micro).tolist()]
    assert len(seen) == len(set(seen)) > 0


def test_index_cache_is_built_once_and_memory_mapped(corpus, tmp_path):
    cache = tmp_path / "cache"
    built = _samples(corpus, cache=cache)
    built.prepare_for(2 * len(built) + 1)  # three epochs
    files = sorted(p.name for p in next((cache).iterdir()).iterdir())
    assert files == [f"epoch{e}-{n}.npy" for e in range(3) for n in ("docs", "order", "starts")]
    loaded = _samples(corpus, cache=cache)
    assert all(np.array_equal(built[k], loaded[k]) for k in range(0, 3 * len(built), 5))
    assert isinstance(loaded._epoch_index(1)["order"], np.memmap)


def test_splits_are_contiguous_document_ranges(tmp_path):
    prefix = _write(tmp_path / "d", [20] * 100)
    train = _samples(prefix, split="90,10,0")
    valid = _samples(prefix, split="90,10,0", which="valid")
    train_docs = {int(t) // 1000 for k in range(len(train)) for t in train[k]}
    valid_docs = {int(t) // 1000 for k in range(len(valid)) for t in valid[k]}
    assert train_docs == set(range(90)) and valid_docs == set(range(90, 100))


def test_blend_follows_the_weights_and_reads_each_source_in_order(tmp_path):
    a = _write(tmp_path / "a", [30] * 50, base=0)
    b = _write(tmp_path / "b", [30] * 50, base=500_000)
    c = _write(tmp_path / "c", [30] * 50, base=900_000)
    blend = build_split_samples(["0.2", a, "0.5", b, "0.3", c], "100,0,0", "train", SEQ, 1, None)
    assert isinstance(blend, BlendedSamples)
    n = 10_000
    which = np.array([blend.source_of(k)[0] for k in range(n)])
    for source, weight in enumerate((0.2, 0.5, 0.3)):
        share = float((which == source).mean())
        assert abs(share - weight) <= 0.01 * weight, (source, share)
        locals_ = [blend.source_of(k)[1] for k in np.flatnonzero(which == source)[:200]]
        assert locals_ == list(range(len(locals_)))
    # blended datasets of the same size are not shuffled in lockstep
    assert not np.array_equal(blend.sources[0]._epoch_index(0)["docs"], blend.sources[1]._epoch_index(0)["docs"])
    # with a cache, the blend index is written once and memory-mapped by later processes
    cache = tmp_path / "cache"
    cached = build_split_samples(["0.2", a, "0.5", b, "0.3", c], "100,0,0", "train", SEQ, 1, cache)
    cached.prepare_for(n)
    again = build_split_samples(["0.2", a, "0.5", b, "0.3", c], "100,0,0", "train", SEQ, 1, cache)
    assert isinstance(again._which, np.memmap) and len(again._which) == n
    assert [again.source_of(k) for k in range(0, n, 97)] == [blend.source_of(k) for k in range(0, n, 97)]
    assert np.array_equal(again[n + 5], blend[n + 5])  # beyond the prepared counters: computed
    # the token ranges tell the sources apart
    origin = [0 if blend[k][0] < 500_000 else 1 if blend[k][0] < 900_000 else 2 for k in range(300)]
    assert origin == which[:300].tolist()


def test_mock_data_is_a_pure_function_of_seed_and_counter():
    a, b = MockSamples(1000, SEQ, 7), MockSamples(1000, SEQ, 7)
    assert np.array_equal(a[123], b[123]) and not np.array_equal(a[123], a[124])
    assert a[5].shape == (SEQ + 1,) and int(a[5].max()) < 1000


@pytest.mark.parametrize("values,needle", [
    (["x", "/a", "0.7", "/b"], "weight 'x' (before /a) is not a number"),
    (["0.3", "/a", "0.7"], "a blend needs WEIGHT PREFIX pairs, got 3 values"),
    (["-1", "/a", "2", "/b"], "weight '-1' of /a must be a positive number"),
    ([], "data_path is empty"),
])
def test_bad_blends_are_named(values, needle):
    with pytest.raises(ValueError, match=None) as e:
        parse_data_path(values)
    assert needle in str(e.value)


def test_split_parsing_and_empty_splits_are_named(tmp_path):
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_split("90/10") == pytest.approx([0.9, 0.1, 0.0])
    for bad in ("a,b,c", "1,2,3,4", "0,0,0", "-1,2,0"):
        with pytest.raises(ValueError, match="split"):
            parse_split(bad)
    prefix = _write(tmp_path / "few", [50, 50, 50])
    with pytest.raises(ValueError, match=r"leaves the valid split of .*few empty \(3 documents: train 3"):
        _samples(prefix, split="99,1,0", which="valid")
    tiny = _write(tmp_path / "tiny", [3, 2])
    with pytest.raises(ValueError, match=r"train split of .*tiny .* too small for one sample of 9 tokens"):
        _samples(tiny)
    with pytest.raises(FileNotFoundError, match="missing"):
        _samples(str(tmp_path / "missing"))


def test_document_samples_reject_negative_counters(corpus):
    samples = _samples(corpus)
    assert isinstance(samples, DocumentSamples)
    with pytest.raises(IndexError):
        samples[-1]


def test_blend_index_computed_in_chunks_equals_one_pass(tmp_path, monkeypatch):
    import fl_megatron.data.gpt_dataset as gd

    a = _write(tmp_path / "a", [30] * 20)
    b = _write(tmp_path / "b", [30] * 20, base=500_000)
    blend = build_split_samples(["1", a, "2", b], "100,0,0", "train", SEQ, 1, None)
    whole_which, whole_local = blend._compute(1000)
    monkeypatch.setattr(gd, "_BLEND_CHUNK", 7)
    which, local = blend._compute(1000)
    assert np.array_equal(which, whole_which) and np.array_equal(local, whole_local)
    # the local counters are the running count per source (an independent recount)
    for source in (0, 1):
        assert np.array_equal(local[which == source], np.arange(int((which == source).sum())))
