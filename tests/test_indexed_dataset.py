"""Megatron indexed dataset (.bin/.idx): round trips with megatron-core, validation errors."""

import os
import struct

import numpy as np
import pytest

from fl_megatron.data.indexed import (
    DTYPE_CODES,
    IndexedDataset,
    IndexedDatasetError,
    IndexedDatasetWriter,
    dataset_exists,
    optimal_dtype,
)


def _mc():
    return pytest.importorskip("megatron.core.datasets.indexed_dataset")


def _random_docs(rng, high, n=40):
    lengths = [1, 0, 7, 1] + list(rng.integers(0, 300, size=n)) + [0]  # ends with an empty one
    return [rng.integers(0, high, size=k) for k in lengths]


def _write(prefix, docs, dtype=np.int32):
    with IndexedDatasetWriter(prefix, dtype=dtype) as w:
        w.add_documents(docs)
    return prefix


@pytest.mark.parametrize("dtype,high", [(np.uint16, 65535), (np.int32, 128256)])
def test_ours_read_by_megatron(tmp_path, dtype, high):
    mc = _mc()
    docs = _random_docs(np.random.default_rng(0), high)
    prefix = str(tmp_path / "sub" / "dir" / "data")  # parents are created
    w = IndexedDatasetWriter(prefix, dtype=dtype)
    w.add_documents(docs)
    assert w.finalize() == (len(docs), sum(len(d) for d in docs))
    assert dataset_exists(prefix)
    assert sorted(os.listdir(tmp_path / "sub" / "dir")) == ["data.bin", "data.idx"]

    theirs = mc.IndexedDataset(prefix, multimodal=False, mmap=True)
    assert len(theirs) == len(docs)
    assert theirs.index.dtype == dtype
    np.testing.assert_array_equal(theirs.sequence_lengths, [len(d) for d in docs])
    np.testing.assert_array_equal(theirs.document_indices, np.arange(len(docs) + 1))
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(theirs[i], doc)
        assert theirs[i].dtype == dtype

    ours = IndexedDataset(prefix)
    assert ours.dtype == np.dtype(dtype) and ours.num_tokens == sum(len(d) for d in docs)
    np.testing.assert_array_equal(ours.sequence_pointers, theirs.index.sequence_pointers)
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ours[i], doc)
    np.testing.assert_array_equal(ours.get(2, 3, 2), docs[2][3:5])
    np.testing.assert_array_equal(ours.get(2, 4), docs[2][4:])
    np.testing.assert_array_equal(ours[-1], docs[-1])
    with pytest.raises(IndexError):
        ours.get(len(docs))
    with pytest.raises(IndexError):
        ours.get(2, 5, 3)


def test_megatron_builder_read_by_ours(tmp_path):
    mc = _mc()
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    # documents of 1..4 sequences each; some sequences have length 1 or 0
    docs = [[rng.integers(0, 32000, size=int(rng.choice([0, 1, 5, 50])))
             for _ in range(int(rng.integers(1, 5)))] for _ in range(30)]
    docs[0][0] = np.arange(1, 9)  # the first sequence is not empty
    prefix = str(tmp_path / "theirs")
    builder = mc.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for doc in docs:
        for seq in doc:
            builder.add_item(torch.from_numpy(seq.astype(np.int64)))
        builder.end_document()
    builder.finalize(prefix + ".idx")

    seqs = [s for doc in docs for s in doc]
    ours = IndexedDataset(prefix)
    assert ours.dtype == np.uint16 and len(ours) == len(seqs)
    np.testing.assert_array_equal(ours.document_indices,
                                  np.cumsum([0] + [len(doc) for doc in docs]))
    np.testing.assert_array_equal(ours.sequence_lengths, [len(s) for s in seqs])
    for i, seq in enumerate(seqs):
        np.testing.assert_array_equal(ours[i], seq)


def test_megatron_multimodal_rejected(tmp_path):
    mc = _mc()
    torch = pytest.importorskip("torch")
    prefix = str(tmp_path / "mm")
    builder = mc.IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32, multimodal=True)
    builder.add_item(torch.arange(5), mode=1)
    builder.end_document()
    builder.finalize(prefix + ".idx")
    with pytest.raises(IndexedDatasetError, match="sequence_modes.*multimodal"):
        IndexedDataset(prefix)


@pytest.fixture
def good(tmp_path):
    docs = [np.arange(1, 11), np.arange(5), np.array([7])]
    return _write(str(tmp_path / "good"), docs, np.uint16)


def _patch_idx(prefix, pos, fmt, value):
    with open(prefix + ".idx", "r+b") as f:
        f.seek(pos)
        f.write(struct.pack(fmt, value))


def test_missing_files(good):
    os.remove(good + ".bin")
    with pytest.raises(FileNotFoundError, match=r"good\.bin"):
        IndexedDataset(good)
    os.remove(good + ".idx")
    assert not dataset_exists(good)
    with pytest.raises(FileNotFoundError, match=r"good\.idx"):
        IndexedDataset(good)


def test_bad_magic(good):
    _patch_idx(good, 0, "<9s", b"NOTMMIDX\x00")
    with pytest.raises(IndexedDatasetError, match=r"good\.idx.*bad magic header"):
        IndexedDataset(good)


def test_bad_version(good):
    _patch_idx(good, 9, "<Q", 2)
    with pytest.raises(IndexedDatasetError, match="unsupported version 2"):
        IndexedDataset(good)


def test_bad_dtype_code(good):
    _patch_idx(good, 17, "<B", 42)
    with pytest.raises(IndexedDatasetError, match="unknown dtype code 42"):
        IndexedDataset(good)


def test_truncated_idx(good):
    size = os.path.getsize(good + ".idx")
    os.truncate(good + ".idx", size - 5)
    with pytest.raises(IndexedDatasetError, match=f"truncated.*needing {size} bytes.*has {size - 5}"):
        IndexedDataset(good)
    os.truncate(good + ".idx", 20)
    with pytest.raises(IndexedDatasetError, match="shorter than the 34-byte header"):
        IndexedDataset(good)


def test_bin_size_mismatch(good):
    os.truncate(good + ".bin", 30 - 4)  # 16 tokens * 2 bytes = 32 expected
    with pytest.raises(IndexedDatasetError,
                       match=r"good\.bin.*expected 32 bytes.*actual 26 bytes.*truncated"):
        IndexedDataset(good)
    with open(good + ".bin", "ab") as f:
        f.write(b"\0" * 10)
    with pytest.raises(IndexedDatasetError, match="expected 32 bytes.*actual 36 bytes.*too long"):
        IndexedDataset(good)


def test_empty_dataset(tmp_path):
    prefix = str(tmp_path / "empty")
    assert IndexedDatasetWriter(prefix).finalize() == (0, 0)
    with pytest.raises(IndexedDatasetError, match="empty dataset: 0 sequences"):
        IndexedDataset(prefix)


def test_bad_pointers(good):
    _patch_idx(good, 34 + 3 * 4 + 8, "<q", 4)  # second pointer: 20 -> 4
    with pytest.raises(IndexedDatasetError, match="pointers not consistent.*pointer 1 is 4"):
        IndexedDataset(good)


def test_bad_document_indices(good):
    _patch_idx(good, 34 + 3 * 12 + 3 * 8, "<q", 2)  # last document index 3 -> 2
    with pytest.raises(IndexedDatasetError, match="document_indices"):
        IndexedDataset(good)


def test_failure_leaves_nothing(tmp_path):
    prefix = str(tmp_path / "d")
    with pytest.raises(RuntimeError, match="boom"):
        with IndexedDatasetWriter(prefix) as w:
            w.add_document([1, 2, 3])
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


def test_failure_keeps_previous_dataset(tmp_path):
    prefix = _write(str(tmp_path / "d"), [[1, 2, 3]])
    with pytest.raises(ValueError, match="token 70000 out of range for uint16"):
        with IndexedDatasetWriter(prefix, np.uint16) as w:
            w.add_document([4, 5])
            w.add_document([70000])
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]
    np.testing.assert_array_equal(IndexedDataset(prefix)[0], [1, 2, 3])
    _write(prefix, [[9], [8, 7]], np.uint16)  # replaced on success
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.uint16 and len(ds) == 2


def test_dtypes_and_ranges(tmp_path):
    assert optimal_dtype(32000) == np.uint16
    assert optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32
    assert optimal_dtype(128256) == np.int32
    assert DTYPE_CODES[4] == np.int32 and DTYPE_CODES[8] == np.uint16
    w = IndexedDatasetWriter(str(tmp_path / "r"), np.uint16)
    w.add_document([0, 65535])
    for bad, says in (([65536], r"token 65536 out of range for uint16 \[0, 65535\]"),
                      ([-1], r"token -1 out of range for uint16 \[0, 65535\]"),
                      (np.array([1.5]), "tokens must be integers, got dtype float64"),
                      ([[1, 2]], r"a document must be 1-D, got shape \(1, 2\)")):
        with pytest.raises(ValueError, match=says):
            w.add_document(bad)
    w.abort()
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="unsupported token dtype"):
        IndexedDatasetWriter(str(tmp_path / "f"), np.float32)


def test_token_ids_beyond_the_vocabulary_are_found_before_training(tmp_path):
    """The largest id against --vocab-size: exact on a small dataset, by evenly spaced blocks on
    a large one; and the dry run refuses such data, naming the file and the id."""
    import subprocess
    import sys

    from fl_megatron.data.token_range import largest_token_id, token_id_problem

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 4000, size=int(n)) for n in rng.integers(50, 400, size=60)]
    docs[37][5] = 4711  # one id past a 4096 vocabulary, deep inside
    prefix = _write(str(tmp_path / "wide"), docs, np.uint16)
    ds = IndexedDataset(prefix)
    assert largest_token_id(ds) == (max(int(d.max()) for d in docs), ds.num_tokens)
    assert token_id_problem(ds, 4712) is None
    problem = token_id_problem(ds, 4096)
    assert f"{prefix} has token id 4711 among all its tokens, but --vocab-size is 4096" in problem
    # a budget below the size reads SCAN_BLOCKS blocks spread over the file, the last one ending it
    at_end = [*docs[:-1], np.concatenate([docs[-1], [9999]])]
    big = IndexedDataset(_write(str(tmp_path / "big"), at_end, np.uint16))
    largest, read = largest_token_id(big, budget=640)
    assert largest == 9999 and read == 640 < big.num_tokens
    assert "among 640 sampled of its" in token_id_problem(big, 4096, budget=640)
    assert token_id_problem(big, 70000) is None  # uint16 cannot hold an id past the vocabulary

    dry = subprocess.run([sys.executable, "-m", "fl_megatron.pretrain", "--model", "llama-tiny", "--vocab-size", "4096",
                          "--data-path", prefix, "--world-size", "4", "--fl-group-size", "2", "--dry-run"],
                         capture_output=True, text=True, timeout=120)
    assert dry.returncode == 2 and "has token id 4711 among all its tokens, but --vocab-size is 4096" in dry.stderr, \
        dry.stderr[-2000:]
