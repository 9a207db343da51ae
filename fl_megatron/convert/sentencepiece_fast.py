"""A SentencePiece model as a Hugging Face `tokenizers` Tokenizer (tokenizer.json) that gives the
ids SentencePiece gives, so that loading it needs no conversion (and no protobuf).

Read from the model's proto: BPE (a merge for every split of a piece into two pieces, ranked by
the piece's score) or Unigram (the pieces and scores); byte fallback; user-defined symbols as
added tokens, never split; the normalizer (the precompiled charsmap, `remove_extra_whitespaces`,
the dummy prefix at the start of the text only); a decoder that drops control pieces and writes
`<unk>` as the model's unk surface. Control pieces stay plain vocabulary entries, so `"<s>"` in
a text is encoded as characters, as SentencePiece does (transformers makes them special tokens:
`split_special_tokens` keeps it so there).

Known differences, none of them in BPE models `train_sentencepiece` trains (measured: the whole
demo corpus and the hard strings of tests/test_sentencepiece_fast.py give the same ids):
- Unigram: where two segmentations score the same, SentencePiece's float32 sums pick one by
  rounding, `tokenizers` (float64) the first found: 3 of the demo corpus's 547 documents, in
  runs of one character (`=====`);
- a charsmap (nmt_nfkc, ...) is applied per grapheme cluster: a cluster whose first character
  has a rule becomes that rule's output alone (`ﬁ` + U+0301 loses its accent);
- with `add_dummy_prefix`: a text that starts with a user-defined symbol gets no prefix; with
  `remove_extra_whitespaces` too, nor does one that starts with a literal U+2581; without it,
  a text the charsmap deletes entirely gets no lone prefix;
- a user-defined symbol the normalizer would change (`\n` under nmt_nfkc) splits the text for
  the whitespace rules, which then see each side as a text of its own;
- BPE: pieces of equal score merge in rank order (SentencePiece: leftmost first), and an UNUSED
  piece stays in the output (SentencePiece splits it back); Unigram: control, byte and unused
  pieces lose to any path through the text's characters, unless one of those is unknown;
- decoding ids SentencePiece never outputs: an invalid byte sequence becomes U+FFFD throughout
  (SentencePiece keeps its valid characters); a leading space decoded from an unknown or byte
  piece is stripped like the dummy prefix's.
WORD and CHAR models, `treat_whitespace_as_suffix`, unescaped whitespace and denormalization
rules are refused with a ValueError.
"""

from __future__ import annotations

from pathlib import Path

SPACE = "\u2581"  # SentencePiece's escaped space
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
UNIGRAM, BPE = 1, 2


def read_proto(model: bytes | str | Path):
    """The ModelProto of a `.model` file (its bytes or its path)."""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except Exception as exc:  # noqa: BLE001 - protobuf missing (ImportError), or older than the module (VersionError)
        raise ValueError(f"reading a SentencePiece model's settings needs a protobuf as new as the one sentencepiece's "
                         f"model module was generated with: {exc} (pip install -U protobuf)") from exc
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model if isinstance(model, bytes) else Path(model).read_bytes())
    return proto


def to_hf_tokenizer(model: bytes | str | Path):
    """A `tokenizers.Tokenizer` giving the SentencePiece model's ids (ValueError if it cannot)."""
    from tokenizers import AddedToken, Tokenizer

    proto = read_proto(model)
    _check_supported(proto)
    tokenizer = Tokenizer(_bpe(proto) if proto.trainer_spec.model_type == BPE else _unigram(proto))
    tokenizer.normalizer = _normalizer(proto.normalizer_spec)
    if proto.normalizer_spec.add_dummy_prefix:
        tokenizer.pre_tokenizer = _dummy_prefix(proto.normalizer_spec)
    tokenizer.decoder = _decoder(proto)
    # matched in the normalized text (so that the whitespace rules see the whole text, as in
    # SentencePiece) unless normalizing would change the symbol itself
    symbols = [p.piece for p in proto.pieces if p.type == USER_DEFINED]
    tokenizer.add_tokens([AddedToken(p, normalized=tokenizer.normalizer.normalize_str(p) == p, special=False)
                          for p in symbols])
    return tokenizer


def _check_supported(proto) -> None:
    problems = []
    if proto.trainer_spec.model_type not in (BPE, UNIGRAM):
        problems.append(f"model_type {proto.trainer_spec.model_type} (only BPE and UNIGRAM convert)")
    if proto.trainer_spec.treat_whitespace_as_suffix:
        problems.append("treat_whitespace_as_suffix")
    if not proto.normalizer_spec.escape_whitespaces:
        problems.append("escape_whitespaces off")
    if proto.denormalizer_spec.precompiled_charsmap:
        problems.append("denormalization rules")
    if problems:
        raise ValueError(f"cannot convert this SentencePiece model to tokenizer.json: {', '.join(problems)}")


def _unk(proto) -> str | None:
    return next((p.piece for p in proto.pieces if p.type == UNKNOWN), None)


def _bpe(proto):
    """SentencePiece BPE merges the adjacent pair whose concatenation is the highest-scored piece,
    so every split of a piece into two mergeable pieces is a merge, ranked by that score."""
    from tokenizers.models import BPE as HFBPE

    pieces = list(proto.pieces)
    vocab = {p.piece: i for i, p in enumerate(pieces)}
    mergeable = {p.piece for p in pieces if p.type in (NORMAL, UNUSED)}
    ranked = sorted((i for i, p in enumerate(pieces) if p.type in (NORMAL, UNUSED)),
                    key=lambda i: (-pieces[i].score, i))
    merges = []
    for i in ranked:
        text = pieces[i].piece
        merges += [(text[:k], text[k:]) for k in range(1, len(text))
                   if text[:k] in mergeable and text[k:] in mergeable]
    return HFBPE(vocab=vocab, merges=merges, unk_token=_unk(proto), fuse_unk=True,
                 byte_fallback=proto.trainer_spec.byte_fallback)


def _unigram(proto):
    """The pieces and their scores; pieces SentencePiece never matches in a text score below any
    path through the text's own pieces (unknown-character nodes stay at the lowest score - 10)."""
    from tokenizers.models import Unigram

    normal = [p.score for p in proto.pieces if p.type == NORMAL]
    hidden = {UNKNOWN, CONTROL, BYTE, UNUSED}
    longest = max((len(p.piece) for p in proto.pieces if p.type in hidden), default=0)
    low = min(min(normal, default=0.0), 0.0) * (longest + 1) - 10.0
    vocab = [(p.piece, low if p.type in hidden else p.score) for p in proto.pieces]
    unk_id = next((i for i, p in enumerate(proto.pieces) if p.type == UNKNOWN), None)
    return Unigram(vocab, unk_id, proto.trainer_spec.byte_fallback)


def _normalizer(spec):
    """The charsmap, then the whitespace rules on the normalized text, then spaces escaped (by
    `_dummy_prefix` when it turns the leading space left by the rules into the dummy prefix)."""
    from tokenizers import Regex, normalizers

    steps = [normalizers.Precompiled(spec.precompiled_charsmap)] if spec.precompiled_charsmap else []
    if spec.remove_extra_whitespaces:
        steps += [normalizers.Replace(Regex(" {2,}"), " "), normalizers.Replace(Regex(f"[ {SPACE}]+\\z"), "")]
        if not spec.add_dummy_prefix:
            steps.append(normalizers.Replace(Regex(r"\A "), ""))
    if not (spec.remove_extra_whitespaces and spec.add_dummy_prefix):
        steps.append(normalizers.Replace(" ", SPACE))
    return normalizers.Sequence(steps)


def _dummy_prefix(spec):
    """The dummy prefix, at the start of the text only: a pre-tokenizer, which (unlike a
    normalizer) sees where the text starts when user-defined symbols split it."""
    from tokenizers import pre_tokenizers

    if spec.remove_extra_whitespaces:  # a leading space left by the rules becomes the prefix
        return pre_tokenizers.Metaspace(SPACE, "first", split=False)
    # the text has no space left: a space goes first, then becomes the prefix
    return pre_tokenizers.Sequence([pre_tokenizers.Metaspace(" ", "first", split=False),
                                    pre_tokenizers.Metaspace(SPACE, "never", split=False)])


def _decoder(proto):
    """Control pieces decode to nothing, `<unk>` to the unk surface, the escaped space to a space,
    byte pieces to their characters; the dummy prefix's space is dropped from the start."""
    from tokenizers import Regex, decoders

    spec = proto.normalizer_spec
    control = [p.piece for p in proto.pieces if p.type == CONTROL]
    steps = [decoders.Replace(Regex(r"\A(?:" + "|".join(map(_literal, control)) + r")\z"), "")] if control else []
    if _unk(proto) is not None:
        steps.append(decoders.Replace(Regex(r"\A" + _literal(_unk(proto)) + r"\z"), proto.trainer_spec.unk_surface))
    steps.append(decoders.Replace(SPACE, " "))
    if proto.trainer_spec.byte_fallback:
        steps.append(decoders.ByteFallback())
    steps.append(decoders.Fuse())
    if spec.add_dummy_prefix or spec.remove_extra_whitespaces:
        steps.append(decoders.Strip(" ", 1, 0))
    return decoders.Sequence(steps)


def _literal(text: str) -> str:
    """`text` as an Oniguruma pattern matching it literally."""
    return "".join(c if c.isalnum() and c.isascii() else f"\\x{{{ord(c):X}}}" for c in text)
