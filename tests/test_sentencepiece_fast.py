"""fl_megatron.convert.sentencepiece_fast against SentencePiece itself: the converted tokenizer
gives SentencePiece's ids and decodes them to SentencePiece's text, on corpus documents and on
strings that exercise whitespace, byte fallback, user-defined and control pieces."""

import io

import pytest

from fl_megatron.data.corpus import demo_corpus_path, load_documents
from fl_megatron.data.tokenizer import train_sentencepiece

spm = pytest.importorskip("sentencepiece")
pytest.importorskip("tokenizers")
pytest.importorskip("google.protobuf")
from fl_megatron.convert.sentencepiece_fast import to_hf_tokenizer  # noqa: E402

pytestmark = pytest.mark.timeout(300)

# not "ﬁ\u0301": a known difference of charsmaps (the module's docstring)
HARD = ["", " ", "   ", "a", " a", "  a", "a ", "a  ", " a  b   c ", "\t", "a\tb\t", "\n", "\n\n", "a\n", "\na",
        " \n ", "a \n b", "\r\n", "def f(x):\n    return x  \n\n", "x = 1234567890 + 0.5e-3", "Grüße, naïve café",
        "日本語のテキスト", "Ω≈ç√∫ ①② ｈｅｌｌｏ", "😀", "a😀b", "😀😀 🚀\U0001f9ec", "\u200b", "a\u200bb", "\x00\x07",
        "\ufeffBOM", "<s>", "</s>", "<unk>", "a<s>b</s>c", "<0x41>", "\u2581", "a\u2581", "\u2581 a \u2581", "\u3000a\u3000",
        "e\u0301", "\u00a8x", "a <br> b", " <br>", "a<br>  \n\n <br> b <br>", "\t<br>\t"]


@pytest.fixture(scope="module")
def documents():
    docs = load_documents(demo_corpus_path())
    return docs[:100], docs[100:400]


def _defaults(train, path, **options):
    """A model trained with SentencePiece's own defaults (unigram, nmt_nfkc, dummy prefix, extra
    whitespace removed, no byte fallback) but for `options`."""
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(train), model_writer=model, vocab_size=800, num_threads=1,
                                   minloglevel=2, **options)
    path.write_bytes(model.getvalue())
    return path


MODELS = {
    "bpe": lambda train, path: train_sentencepiece(train, 800, path, "bpe"),
    "unigram": lambda train, path: train_sentencepiece(train, 800, path, "unigram"),
    "defaults": lambda train, path: _defaults(train, path, user_defined_symbols=["<br>"]),
    # Llama 2's settings (a prefix space, spaces kept, byte fallback) and our newline symbol
    "prefix-bpe": lambda train, path: _defaults(train, path, model_type="bpe", normalization_rule_name="identity",
                                                remove_extra_whitespaces=False, byte_fallback=True,
                                                user_defined_symbols=["\n"]),
}


def _same_score(sp, a, b) -> bool:
    """Two segmentations of the same text with the same total score (a Unigram tie)."""
    score = lambda ids: sum(sp.get_score(i) for i in ids)  # noqa: E731
    return sp.decode(a) == sp.decode(b) and abs(score(a) - score(b)) <= 1e-4 * (1 + abs(score(a)))


@pytest.mark.parametrize("name", list(MODELS))
def test_converted_tokenizer_gives_sentencepieces_ids(documents, tmp_path, name):
    train, held_out = documents
    path = MODELS[name](train, tmp_path / f"{name}.model")
    sp, fast = spm.SentencePieceProcessor(model_file=str(path)), to_hf_tokenizer(path)
    assert fast.get_vocab_size() == sp.get_piece_size()
    unigram, ties = name in ("unigram", "defaults"), []
    for text in held_out + HARD:
        if text.startswith(("\n", "<br>")) and name in ("defaults", "prefix-bpe"):
            continue  # no dummy prefix before a leading user-defined symbol: a known difference
        ours, theirs = sp.encode(text), fast.encode(text).ids
        if ours != theirs and unigram and _same_score(sp, ours, theirs):
            ties.append(text)
            continue
        assert theirs == ours, (name, text[:80], [sp.id_to_piece(i) for i in ours][:40],
                                [fast.id_to_token(i) for i in theirs][:40])
        assert fast.decode(theirs, skip_special_tokens=False) == sp.decode(ours), (name, text[:80])
    assert len(ties) <= 3, ties  # float32 ties (the module's docstring): none in this corpus slice today
    for text in HARD:  # control ids decode to nothing, as in SentencePiece
        ids = [sp.bos_id(), *sp.encode(text), sp.eos_id()]
        assert fast.decode(ids, skip_special_tokens=False) == sp.decode(ids), (name, text)


def test_models_it_cannot_match_are_refused(documents, tmp_path):
    path = _defaults(documents[0], tmp_path / "char.model", model_type="char")
    with pytest.raises(ValueError, match="model_type 4 .only BPE and UNIGRAM convert"):
        to_hf_tokenizer(path)
