"""Tokenizers by Megatron-LM type name, for preprocessing text into indexed datasets.

``build_tokenizer(type, model)`` returns an object with ``encode``,
``encode_batch``, ``eod_id``, ``vocab_size`` and ``name``. Objects pickle as
their (type, model, eod_token) spec and are rebuilt on unpickling, so they can
be handed to spawned worker processes.
"""

from __future__ import annotations

from pathlib import Path

from fl_megatron.data.tokenizer import Tokenizer

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
HUGGINGFACE_TYPE = "HuggingFaceTokenizer"
SUPPORTED_TYPES = SENTENCEPIECE_TYPES + (HUGGINGFACE_TYPE,)
# EOD of a Hugging Face tokenizer: the first of these in the vocabulary.
HF_EOD_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")


class _SpecPickled:
    """Pickles as ``build_tokenizer(name, model_path, eod_token)``."""

    name: str
    model_path: str
    _eod_token: str | None

    def __reduce__(self):
        return (build_tokenizer, (self.name, self.model_path, self._eod_token))

    def __repr__(self):
        return f"{self.name}({self.model_path!r}, vocab_size={self.vocab_size}, eod_id={self.eod_id})"


class SentencePieceTextTokenizer(_SpecPickled):
    """A SentencePiece ``.model``; EOD is the model's EOS (or ``eod_token``).

    Megatron-LM's plain ``SentencePieceTokenizer`` appends its own <EOD> etc.
    after the model's pieces; here all three types use the model's EOS instead.
    ``Llama2Tokenizer`` prepends the model's BOS to every text, as Megatron-LM's does.
    """

    def __init__(self, name: str, model_path: str, eod_token: str | None = None):
        self.name, self.model_path, self._eod_token = name, model_path, eod_token
        self._tok = _load(Tokenizer.from_file, name, model_path)
        sp = self._tok._sp
        if eod_token is not None:
            self.eod_id = _sp_piece_id(sp, eod_token, model_path)
        elif sp.eos_id() < 0:
            raise ValueError(f"{name}: SentencePiece model {model_path} has no EOS piece to use as "
                             "end-of-document; pass eod_token or retrain it with an EOS")
        else:
            self.eod_id = sp.eos_id()
        self.vocab_size = self._tok.vocab_size
        self._bos = [sp.bos_id()] if name == "Llama2Tokenizer" and sp.bos_id() >= 0 else []

    def encode(self, text: str) -> list[int]:
        return self._bos + self._tok.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        ids = self._tok.encode_batch(list(texts))
        return [self._bos + x for x in ids] if self._bos else ids

    def decode(self, ids) -> str:
        return self._tok.decode(ids)


def _load(loader, name: str, model_path: str):
    try:
        return loader(model_path)
    except Exception as exc:  # the libraries raise RuntimeError, OSError or a bare Exception
        raise ValueError(f"{name}: cannot load tokenizer model {model_path}: {exc}") from exc


def _sp_piece_id(sp, piece: str, model_path: str) -> int:
    pid = sp.piece_to_id(piece)
    if pid == sp.unk_id() and piece != sp.id_to_piece(sp.unk_id()):
        raise ValueError(f"eod_token {piece!r} is not a piece of {model_path}")
    return pid


class HuggingFaceTextTokenizer(_SpecPickled):
    """A ``tokenizer.json`` loaded with the ``tokenizers`` library.

    Special tokens of the post-processor (e.g. a BOS) are added, as
    Megatron-LM's ``HuggingFaceTokenizer`` does. EOD: ``eod_token`` or the
    first of ``HF_EOD_CANDIDATES`` in the vocabulary.
    """

    name = HUGGINGFACE_TYPE

    def __init__(self, model_path: str, eod_token: str | None = None):
        from tokenizers import Tokenizer as HFTokenizer

        self.model_path, self._eod_token = model_path, eod_token
        self._tok = _load(HFTokenizer.from_file, self.name, model_path)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        candidates = (eod_token,) if eod_token is not None else HF_EOD_CANDIDATES
        found = [t for t in candidates if t in vocab]
        if not found:
            raise ValueError(f"{HUGGINGFACE_TYPE}: none of {', '.join(candidates)} is in the vocabulary of "
                             f"{model_path}; pass eod_token to name the end-of-document token")
        self.eod_id = vocab[found[0]]
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._batch(list(texts))]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | Path, eod_token: str | None = None):
    """The tokenizer of Megatron-LM type ``tokenizer_type`` loaded from ``tokenizer_model``.

    SentencePiece types take a ``.model`` file; ``HuggingFaceTokenizer`` takes a
    ``tokenizer.json`` or a directory holding one.
    """
    if tokenizer_type not in SUPPORTED_TYPES:
        raise ValueError(f"unsupported tokenizer type {tokenizer_type!r}; supported: {', '.join(SUPPORTED_TYPES)}")
    if tokenizer_model is None:
        raise ValueError(f"{tokenizer_type} needs a tokenizer model file (--tokenizer-model)")
    path = Path(tokenizer_model).expanduser()
    if tokenizer_type == HUGGINGFACE_TYPE and path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{tokenizer_type}: tokenizer model not found: {path}")
    path = str(path.resolve())
    if tokenizer_type == HUGGINGFACE_TYPE:
        return HuggingFaceTextTokenizer(path, eod_token)
    return SentencePieceTextTokenizer(tokenizer_type, path, eod_token)
