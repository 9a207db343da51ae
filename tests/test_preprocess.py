"""Tests for Megatron-compatible preprocessing (tools/preprocess_data.py) and tokenizer training."""

import gzip
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fl_megatron.data import demo_corpus_path, load_documents
from fl_megatron.data.indexed import IndexedDataset
from fl_megatron.data.preprocess import PreprocessError, preprocess, summary
from fl_megatron.data.text_tokenizers import SUPPORTED_TYPES, build_tokenizer
from fl_megatron.data.tokenizer import Tokenizer, train_sentencepiece
from tool_loader import tool_module

REPO = Path(__file__).resolve().parents[1]
SAMPLE = "naïve café — 東京 🙂\n    def f(x):\n\treturn x ** 2  # 12345\n"


def _tool(name):
    return tool_module(name)


@pytest.fixture(scope="module")
def docs():
    return load_documents(demo_corpus_path())[:120]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory, docs):
    return str(train_sentencepiece(docs, 400, tmp_path_factory.mktemp("sp") / "sp.model"))


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory, docs):
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer)
    folder = tmp_path_factory.mktemp("hf")
    tok.save(str(folder / "tokenizer.json"))
    return str(folder)


@pytest.fixture(scope="module")
def records(docs):
    """JSONL records with two keys; one empty text (dropped from 'text' only)."""
    recs = [{"text": d, "title": d.split("\n")[0][:60] or "untitled", "n": i} for i, d in enumerate(docs[:40])]
    recs[5]["text"] = ""
    return recs


def _write_jsonl(path, recs, blank_line=True):
    lines = [json.dumps(r) for r in recs]
    if blank_line:
        lines.insert(3, "   ")
    data = "\n".join(lines) + "\n"
    if str(path).endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            fh.write(data)
    else:
        Path(path).write_text(data, encoding="utf-8")
    return path


def _expected(tokenizer, texts, append_eod):
    out = []
    for text in texts:
        ids = tokenizer.encode(text)
        if ids:
            out.append(ids + [tokenizer.eod_id] if append_eod else ids)
    return out


def _read(prefix):
    ds = IndexedDataset(prefix)
    return [ds.get(i).tolist() for i in range(len(ds))]


def _outputs(folder):
    return sorted(p.name for p in Path(folder).iterdir())


# ---------------------------------------------------------------- tokenizers

def test_build_tokenizer_types_and_errors(sp_model, hf_model, tmp_path):
    gpt = build_tokenizer("GPTSentencePieceTokenizer", sp_model)
    assert gpt.eod_id == 2 and gpt.vocab_size == 400
    assert gpt.encode(SAMPLE) == Tokenizer.from_file(sp_model).encode(SAMPLE)
    llama = build_tokenizer("Llama2Tokenizer", sp_model)  # prepends BOS, as Megatron-LM's does
    assert llama.encode(SAMPLE) == [1] + gpt.encode(SAMPLE)
    assert build_tokenizer("SentencePieceTokenizer", sp_model).encode_batch([SAMPLE]) == [gpt.encode(SAMPLE)]
    hf = build_tokenizer("HuggingFaceTokenizer", hf_model)
    assert hf.eod_id == 1 and hf.decode(hf.encode(SAMPLE)) == SAMPLE
    assert hf.encode_batch([SAMPLE, "x"]) == [hf.encode(SAMPLE), hf.encode("x")]
    assert build_tokenizer("HuggingFaceTokenizer", hf_model, eod_token="<unk>").eod_id == 0
    for tok in (llama, hf, Tokenizer.from_file(sp_model)):  # picklable, for spawned workers
        clone = pickle.loads(pickle.dumps(tok))
        assert (clone.eod_id, clone.vocab_size, clone.encode(SAMPLE)) == (tok.eod_id, tok.vocab_size, tok.encode(SAMPLE))

    with pytest.raises(ValueError, match="unsupported tokenizer type 'GPT2BPETokenizer'.*HuggingFaceTokenizer"):
        build_tokenizer("GPT2BPETokenizer", sp_model)
    missing = tmp_path / "nope.model"
    with pytest.raises(FileNotFoundError, match=f"not found: {missing}"):
        build_tokenizer("GPTSentencePieceTokenizer", missing)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        build_tokenizer("HuggingFaceTokenizer", tmp_path)
    with pytest.raises(ValueError, match="none of .*eod_token"):
        build_tokenizer("HuggingFaceTokenizer", hf_model, eod_token="<|nope|>")
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="cannot load tokenizer model .*bad.model"):
        build_tokenizer("GPTSentencePieceTokenizer", tmp_path / "bad.model")


# ---------------------------------------------------------------- token-exact output

@pytest.mark.parametrize("kind", ["sp", "hf"])
def test_token_exact_jsonl_keys_and_gzip(kind, sp_model, hf_model, records, tmp_path):
    tok = (build_tokenizer("GPTSentencePieceTokenizer", sp_model) if kind == "sp"
           else build_tokenizer("HuggingFaceTokenizer", hf_model))
    for suffix, append_eod in ((".jsonl", True), (".jsonl.gz", False)):
        src = _write_jsonl(tmp_path / f"in{suffix}", records)
        prefix = tmp_path / f"out{suffix}" / "c"
        stats = preprocess(src, prefix, tok, json_keys=("text", "title"), append_eod=append_eod)
        assert stats["documents"] == len(records) and stats["empty"] == {"text": 1, "title": 0}
        assert _outputs(prefix.parent) == ["c_text_document.bin", "c_text_document.idx",
                                           "c_title_document.bin", "c_title_document.idx"]
        for key in ("text", "title"):
            expected = _expected(tok, [r[key] for r in records], append_eod)
            assert _read(f"{prefix}_{key}_document") == expected
            assert IndexedDataset(f"{prefix}_{key}_document").dtype == np.uint16
        assert stats["tokens"] == sum(map(len, _expected(tok, [r["text"] for r in records], append_eod))) + \
            sum(map(len, _expected(tok, [r["title"] for r in records], append_eod)))


def test_token_exact_txt_and_megatron_reader(sp_model, docs, tmp_path):
    megatron = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    tok = build_tokenizer("Llama2Tokenizer", sp_model)
    lines = [d.replace("\n", " ") for d in docs[:30]] + ["", "last line\r"]
    src = tmp_path / "in.txt"
    src.write_text("\n".join(lines), encoding="utf-8")  # no final newline
    log = []
    stats = preprocess(src, tmp_path / "out" / "t", tok, append_eod=True, log=log.append, log_interval=10)
    assert stats["documents"] == len(lines) and stats["empty"] == {"text": 0}  # BOS: never empty
    assert log and log[-1].startswith("processed 32 documents (")  # one line per batch of lines
    expected = _expected(tok, lines[:-1] + ["last line"], True)
    assert _read(tmp_path / "out" / "t_text_document") == expected
    ds = megatron.IndexedDataset(str(tmp_path / "out" / "t_text_document"))
    assert len(ds) == len(expected)
    assert [ds[i].tolist() for i in range(len(ds))] == expected
    assert ds.get(3, offset=1, length=2).tolist() == expected[3][1:3]
    with pytest.raises(ValueError, match="plain text"):
        preprocess(src, tmp_path / "x", tok, json_keys=("text", "title"))


# ---------------------------------------------------------------- workers, CLI

def test_cli_workers_2_identical_to_workers_1(sp_model, hf_model, records, tmp_path):
    src = _write_jsonl(tmp_path / "in.jsonl", records * 20)
    preprocess(src, tmp_path / "one" / "d", ("GPTSentencePieceTokenizer", sp_model),
               json_keys=("text", "title"), append_eod=True, workers=1)
    cmd = [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(src),
           "--output-prefix", str(tmp_path / "two" / "d"), "--json-keys", "text", "title",
           "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", sp_model,
           "--append-eod", "--workers", "2", "--log-interval", "100"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    assert len(re.findall(r"processed \d+ documents \([\d,]+ docs/s, [\d,]+ tokens/s\)", res.stderr)) >= 2
    assert "800 documents" in res.stderr
    for name in _outputs(tmp_path / "one"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    # spawned workers rebuild a pickled tokenizer (here a Hugging Face one)
    hf = build_tokenizer("HuggingFaceTokenizer", hf_model)
    preprocess(src, tmp_path / "hf1" / "d", hf, workers=1)
    preprocess(src, tmp_path / "hf2" / "d", hf, workers=2, start_method="spawn")
    for name in _outputs(tmp_path / "hf1"):
        assert (tmp_path / "hf1" / name).read_bytes() == (tmp_path / "hf2" / name).read_bytes(), name


def test_cli_rejects_unsupported_megatron_flags(sp_model, tmp_path, capsys):
    cli = _tool("preprocess_data")
    base = ["--input", "x.jsonl", "--output-prefix", "o", "--tokenizer-type", "GPTSentencePieceTokenizer",
            "--tokenizer-model", sp_model]
    for extra, msg in ((["--split-sentences"], "--split-sentences is not supported"),
                       (["--partitions", "2"], "--partitions > 1"),
                       (["--tokenizer-type", "BertWordPieceCase"], "invalid choice")):
        with pytest.raises(SystemExit) as exc:
            cli.parse_args(base + extra)
        assert exc.value.code == 2 and msg in capsys.readouterr().err
    assert cli.parse_args(base + ["--partitions", "1", "--keep-sequential-samples"]).workers == 1
    assert cli.main(base[:-1] + [str(tmp_path / "missing.model")]) == 2
    assert f"tokenizer model not found: {tmp_path / 'missing.model'}" in capsys.readouterr().err


# ---------------------------------------------------------------- bad input

def _bad_input(tmp_path, records):
    lines = [json.dumps(r) for r in records[:10]]
    lines[3] = '{"text": "unterminated'
    lines[7] = json.dumps({"title": "no text key"})
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return src


def test_malformed_line_stops_and_leaves_nothing(sp_model, records, tmp_path, capsys):
    src = _bad_input(tmp_path, records)
    out = tmp_path / "out"
    with pytest.raises(PreprocessError, match=f"^{src}:4: malformed JSON"):
        preprocess(src, out / "d", ("GPTSentencePieceTokenizer", sp_model), json_keys=("text", "title"))
    assert not out.exists() or _outputs(out) == []
    cli = _tool("preprocess_data")
    args = ["--input", str(src), "--output-prefix", str(out / "d"), "--tokenizer-type",
            "GPTSentencePieceTokenizer", "--tokenizer-model", sp_model]
    assert cli.main(args + ["--workers", "2"]) == 2
    assert f"{src}:4: malformed JSON" in capsys.readouterr().err
    assert _outputs(out) == []

    assert cli.main(args + ["--skip-bad", "--append-eod"]) == 0
    err = capsys.readouterr().err
    assert "8 documents" in err and "2 lines skipped" in err and f"{src}:8: missing key 'text'" in err
    tok = build_tokenizer("GPTSentencePieceTokenizer", sp_model)
    good = [r["text"] for i, r in enumerate(records[:10]) if i not in (3, 7)]
    assert _read(out / "d_text_document") == _expected(tok, good, True)


def test_interrupted_run_leaves_nothing(sp_model, records, tmp_path):
    class Interrupting:
        """A tokenizer that is interrupted (Ctrl-C) on its second batch."""
        def __init__(self):
            self.inner, self.calls = build_tokenizer("GPTSentencePieceTokenizer", sp_model), 0
            self.eod_id, self.vocab_size = self.inner.eod_id, self.inner.vocab_size

        def encode_batch(self, texts):
            self.calls += 1
            if self.calls == 3:
                raise KeyboardInterrupt
            return self.inner.encode_batch(texts)

    src = _write_jsonl(tmp_path / "in.jsonl", records * 30)  # > 1 batch of lines
    with pytest.raises(KeyboardInterrupt):
        preprocess(src, tmp_path / "out" / "d", Interrupting(), json_keys=("text", "title"))
    assert _outputs(tmp_path / "out") == []
    only_empty = _write_jsonl(tmp_path / "empty.jsonl", [{"text": ""}], blank_line=False)
    with pytest.raises(PreprocessError, match="no tokens for key 'text'"):
        preprocess(only_empty, tmp_path / "out" / "e", ("GPTSentencePieceTokenizer", sp_model))
    assert _outputs(tmp_path / "out") == []


def test_summary_mentions_everything(sp_model, records, tmp_path):
    src = _bad_input(tmp_path, records)
    stats = preprocess(src, tmp_path / "o", ("GPTSentencePieceTokenizer", sp_model), skip_bad=True)
    text = summary(stats)
    assert stats["skipped"] == 2 and "2 lines skipped" in text and "o_text_document.idx" in text
    assert stats["tokenizer"] == "GPTSentencePieceTokenizer" and stats["tokenizer"] in SUPPORTED_TYPES


# ---------------------------------------------------------------- train_tokenizer

@pytest.mark.parametrize("model_type,lines", [("bpe", 0), ("unigram", 1500)])
def test_train_tokenizer(model_type, lines, docs, tmp_path, capsys):
    src = _write_jsonl(tmp_path / "corpus.jsonl.gz", [{"body": d} for d in docs[:80]], blank_line=False)
    prefix = tmp_path / "tok" / model_type
    rc = _tool("train_tokenizer").main(["--input", str(src), "--json-keys", "body", "--model-prefix", str(prefix),
                                        "--vocab-size", "420", "--model-type", model_type,
                                        "--input-sentence-size", str(lines)])
    assert rc == 0
    report = capsys.readouterr().out
    assert f"trained {model_type} model" in report and "420 pieces (256 byte-fallback pieces)" in report
    total = sum(1 for d in docs[:80] for line in d.split("\n") if line.strip())
    assert "80 documents" in report and f"trained on {lines or total} lines" in report and total > 1500
    tok = build_tokenizer("GPTSentencePieceTokenizer", f"{prefix}.model")
    assert tok.vocab_size == 420 and tok.eod_id == 2
    assert tok.decode(tok.encode(SAMPLE)) == SAMPLE
    assert len(Path(f"{prefix}.vocab").read_text(encoding="utf-8").splitlines()) == 420
