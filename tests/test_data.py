"""Tests for the demo data layer (corpus, tokenizer, cached preparation into an indexed
dataset, sampling contract)."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import torch

from fl_megatron.data import (
    BatchSource,
    SampleOrder,
    TokenSamples,
    Tokenizer,
    demo_corpus_path,
    eval_batches,
    global_sample_ids,
    load_documents,
    prepare_demo_data,
)
from fl_megatron.data import demo as demo_module

REPO = Path(__file__).resolve().parents[1]
VOCAB = 512


def _raw_corpus_docs():
    """Independent reader of the shipped corpus."""
    with gzip.open(demo_corpus_path(), "rb") as fh:
        raw = fh.read()
    return raw, [json.loads(line)["text"] for line in raw.decode("utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    cache = tmp_path_factory.mktemp("demo-cache")
    return cache, prepare_demo_data(cache, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def tokenizer(demo):
    return Tokenizer.from_file(demo[1].tokenizer_path)


# ---------------------------------------------------------------- corpus

def test_corpus_loads_and_has_expected_size():
    path = demo_corpus_path()
    assert path.is_file() and path.name.endswith(".jsonl.gz")
    assert path.stat().st_size < 1_500_000
    raw, ref_docs = _raw_corpus_docs()
    assert 2_000_000 <= len(raw) <= 4_000_000
    docs = load_documents(path)
    assert docs == ref_docs
    assert len(docs) > 100 and all(isinstance(d, str) and d for d in docs)
    assert len(set(docs)) == len(docs)


def test_corpus_gzip_is_reproducible_header():
    head = demo_corpus_path().read_bytes()[:10]
    assert head[:2] == b"\x1f\x8b" and head[4:8] == b"\0\0\0\0"  # mtime=0


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
@pytest.mark.parametrize("bad", ['{"text": "unterminated', '["not", "an", "object"]', '{"txt": "x"}'])
def test_malformed_jsonl_names_file_and_line(tmp_path, suffix, bad):
    body = '{"text": "first"}\n\n' + bad + "\n" + '{"text": "last"}\n'
    path = tmp_path / f"bad{suffix}"
    if suffix.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            fh.write(body)
    else:
        path.write_text(body, encoding="utf-8")
    with pytest.raises(ValueError, match=rf"bad{suffix.replace('.', r'[.]')}:3\b"):
        load_documents(path)


def test_plain_jsonl_loads(tmp_path):
    path = tmp_path / "ok.jsonl"
    path.write_text('{"text": "a\\nb"}\n{"text": "ü"}\n', encoding="utf-8")
    assert load_documents(path) == ["a\nb", "ü"]


# ---------------------------------------------------------------- tokenizer

def test_tokenizer_round_trips_ascii_and_unicode(demo, tokenizer):
    _, docs = _raw_corpus_docs()
    samples = [d for d in docs if d.isascii()][:20]
    assert len(samples) == 20
    samples += ["  leading spaces,\n\n\ttabs\tand  double  spaces  \n", "x = [1, 22, 333]  # comment"]
    for text in samples:
        ids = tokenizer.encode(text)
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
        assert tokenizer.decode(ids) == text
    unicode_text = "Grüße — 日本語のテキスト 🙂 ∑ ✓"
    ids = tokenizer.encode(unicode_text)
    assert tokenizer.decode(ids) == unicode_text
    sp = spm.SentencePieceProcessor(model_file=str(demo[1].tokenizer_path))
    assert any(sp.id_to_piece(i).startswith("<0x") for i in ids), "expected byte-fallback pieces"
    assert sp.unk_id() not in ids


def test_tokenizer_properties(demo, tokenizer):
    assert tokenizer.vocab_size == VOCAB
    sp = spm.SentencePieceProcessor(model_file=str(demo[1].tokenizer_path))
    assert tokenizer.eod_id == sp.eos_id() >= 0
    assert tokenizer.eod_id not in tokenizer.encode("some text\nwith </s> inside")


# ---------------------------------------------------------------- prepare_demo_data

def test_prepare_demo_data_is_the_corpus_preprocessed_with_eod(demo, tokenizer):
    _, data = demo
    _, docs = _raw_corpus_docs()
    dataset = data.dataset()
    assert len(dataset) == len(docs) and dataset.dtype == np.uint16
    for k in (0, 1, len(docs) // 2, len(docs) - 1):
        tokens = dataset[k]
        assert tokens[-1] == tokenizer.eod_id
        assert list(tokens[:-1]) == tokenizer.encode(docs[k])
        assert tokenizer.decode(tokens[:-1]) == docs[k]
    assert int((np.asarray(dataset.get(len(docs) // 2)) == tokenizer.eod_id).sum()) == 1


def test_prepare_demo_data_is_cached(demo, monkeypatch, capsys):
    cache, first = demo
    folder = first.tokenizer_path.parent
    mtimes = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}

    def no_training(*args, **kwargs):
        raise AssertionError("tokenizer retrained despite cache")

    monkeypatch.setattr(demo_module, "train_sentencepiece", no_training)
    second = prepare_demo_data(cache, vocab_size=VOCAB)
    assert second.tokenizer_path == first.tokenizer_path
    assert second.prefix == first.prefix
    np.testing.assert_array_equal(second.dataset().sequence_lengths, first.dataset().sequence_lengths)
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == mtimes
    assert not [p for p in folder.iterdir() if ".tmp" in p.name]
    assert "training tokenizer" not in capsys.readouterr().err
    # A different vocab size is a different cache entry, so it must train.
    with pytest.raises(AssertionError, match="retrained"):
        prepare_demo_data(cache, vocab_size=VOCAB + 64)


def test_prepare_demo_data_prints_progress_and_keys_on_corpus(tmp_path, capsys):
    corpus = tmp_path / "small.jsonl"
    _, docs = _raw_corpus_docs()
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:60]), encoding="utf-8")
    data = prepare_demo_data(tmp_path / "cache", vocab_size=400, corpus_path=corpus)
    err = capsys.readouterr().err
    assert "training tokenizer (vocab 400) on 60 docs" in err
    assert len(data.dataset()) == 60
    other = corpus.with_name("other.jsonl")
    other.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[1:61]), encoding="utf-8")
    data2 = prepare_demo_data(tmp_path / "cache", vocab_size=400, corpus_path=other)
    assert data2.tokenizer_path.parent != data.tokenizer_path.parent


def test_concurrent_builders_agree(tmp_path):
    corpus = tmp_path / "c.jsonl"
    _, docs = _raw_corpus_docs()
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:40]), encoding="utf-8")
    script = (
        "import sys, hashlib, numpy as np\n"
        "from fl_megatron.data.demo import prepare_demo_data\n"
        "d = prepare_demo_data(sys.argv[1], vocab_size=400, corpus_path=sys.argv[2])\n"
        "print(hashlib.sha256(open(str(d.prefix) + '.bin', 'rb').read()).hexdigest(),"
        " hashlib.sha256(d.tokenizer_path.read_bytes()).hexdigest())\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "cache"), str(corpus)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert outs[0][0] == outs[1][0] and outs[0][0].strip()
    leftovers = [p for p in (tmp_path / "cache").rglob("*") if ".tmp" in p.name]
    assert not leftovers


# ---------------------------------------------------------------- samples

def test_token_samples_windows():
    tokens = np.arange(23, dtype=np.int32)
    s = TokenSamples(tokens, seq_length=5)
    assert len(s) == 4  # (23 - 1) // 5
    for i in range(4):
        item = s[i]
        assert item.dtype == np.int64
        assert list(item) == list(range(5 * i, 5 * i + 6))
    with pytest.raises(IndexError):
        s[4]
    assert len(TokenSamples(np.arange(6), 5)) == 1
    with pytest.raises(ValueError, match=r"5 tokens.*seq_length 5"):
        TokenSamples(np.arange(5), 5)


def test_sample_order_permutations():
    n = 37
    a, b, other = SampleOrder(n, seed=7), SampleOrder(n, seed=7), SampleOrder(n, seed=8)
    epochs = [[a.index(e * n + p) for p in range(n)] for e in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(n))
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]
    assert epochs[0] != list(range(n))
    # Same seed, out-of-order queries: identical mapping.
    ks = list(range(3 * n))[::-1]
    assert [b.index(k) for k in ks] == [epochs[k // n][k % n] for k in ks]
    assert [other.index(k) for k in range(n)] != epochs[0]
    ref = np.random.default_rng([7, 2]).permutation(n)
    assert epochs[2] == [int(x) for x in ref]


def test_global_sample_ids_formula_and_disjoint_contiguous():
    assert list(global_sample_ids(1, 2, 1, world_size=4, micro_batch_size=2, accum_steps=3)) == [58, 59]
    ws, mbs, acc = 4, 2, 3
    per_step = ws * mbs * acc
    for step in range(3):
        seen = []
        for rank in range(ws):
            for micro in range(acc):
                seen.extend(global_sample_ids(rank, step, micro, ws, mbs, acc))
        assert len(seen) == len(set(seen))
        assert sorted(seen) == list(range(step * per_step, (step + 1) * per_step))


def test_no_sample_read_twice_within_epoch():
    ws, mbs, acc, steps = 3, 2, 2, 4
    n = ws * mbs * acc * steps
    order = SampleOrder(n, seed=1)
    read = [order.index(k)
            for step in range(steps) for rank in range(ws) for micro in range(acc)
            for k in global_sample_ids(rank, step, micro, ws, mbs, acc)]
    assert sorted(read) == list(range(n))


def test_batch_source_independent_of_call_order():
    tokens = np.arange(1000, dtype=np.int32) * 3
    samples = TokenSamples(tokens, seq_length=8)
    keys = [(r, s, m) for s in range(12) for r in range(2) for m in range(2)]  # crosses epochs
    src_a = BatchSource(samples, SampleOrder(len(samples), seed=3), 2, 3, 2)
    src_b = BatchSource(samples, SampleOrder(len(samples), seed=3), 2, 3, 2)
    forward = {k: src_a.micro_batch(*k) for k in keys}
    rng = np.random.default_rng(0)
    for i in rng.permutation(len(keys)):
        k = keys[i]
        assert torch.equal(src_b.micro_batch(*k), forward[k])
    batch = forward[(1, 5, 1)]
    assert batch.dtype == torch.int64 and batch.shape == (3, 9)
    for row in batch:
        start = int(row[0]) // 3
        assert start % 8 == 0
        assert row.tolist() == [3 * t for t in range(start, start + 9)]


def _eval_ids(batches):
    return sorted(int(row[0]) for b in batches for row in b)


def test_eval_batches_same_across_groups_and_sizes():
    tokens = np.arange(401, dtype=np.int32)
    samples = TokenSamples(tokens, seq_length=4)  # 100 samples; first token identifies a sample
    mbs, nb = 3, 4
    group_a = [eval_batches(samples, r, 2, mbs, nb) for r in range(2)]
    group_b = [eval_batches(samples, r, 2, mbs, nb) for r in range(2)]
    for ra, rb in zip(group_a, group_b):
        assert all(torch.equal(x, y) for x, y in zip(ra, rb))
    ids_a = [_eval_ids(r) for r in group_a]
    assert not set(ids_a[0]) & set(ids_a[1])
    union = sorted(ids_a[0] + ids_a[1])
    assert union == [4 * i for i in range(2 * mbs * nb)]
    single = eval_batches(samples, 0, 1, mbs, 2 * nb)
    assert _eval_ids(single) == union
    assert all(b.shape == (mbs, 5) and b.dtype == torch.int64 for b in single)


def test_eval_batches_cycle_when_few_samples():
    samples = TokenSamples(np.arange(21, dtype=np.int32), seq_length=4)  # 5 samples
    batches = eval_batches(samples, 1, 2, micro_batch_size=2, num_batches=2)
    # rank 1 reads blocks 1 and 3: counters (2, 3) and (6, 7) -> samples (2, 3) and (1, 2)
    assert [b[:, 0].tolist() for b in batches] == [[8, 12], [4, 8]]
