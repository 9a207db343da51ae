"""SentencePiece tokenizer wrapper and a deterministic, atomic trainer."""

from __future__ import annotations

import io
import os
import random
import tempfile
from pathlib import Path

import sentencepiece as spm

from ..file_modes import as_umask_allows

# Longest training "sentence" (one line of a document), in bytes.
_MAX_LINE_BYTES = 4096
# Upper bound on the number of training lines SentencePiece loads.
_MAX_TRAIN_LINES = 1_000_000


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a unique temp file and ``os.replace``.

    Readers see either the old file or the complete new one, never a partial
    write; concurrent writers of identical content are harmless.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        as_umask_allows(tmp)  # mkstemp creates 0600: give it what open() would
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class Tokenizer:
    """Thin wrapper over a SentencePiece model; the EOD token is the model's EOS."""

    def __init__(self, processor: spm.SentencePieceProcessor):
        self._sp = processor

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        """Load a ``.model`` file."""
        return cls(spm.SentencePieceProcessor(model_file=str(path)))

    @classmethod
    def from_bytes(cls, model_proto: bytes) -> "Tokenizer":
        """Load a serialized model (the bytes of a ``.model`` file)."""
        return cls(spm.SentencePieceProcessor(model_proto=model_proto))

    def __reduce__(self):
        # Picklable by value, so it can be sent to spawned worker processes.
        return (Tokenizer.from_bytes, (self._sp.serialized_model_proto(),))

    @property
    def vocab_size(self) -> int:
        """Number of pieces, including control and byte pieces."""
        return self._sp.get_piece_size()

    @property
    def eod_id(self) -> int:
        """Id appended after every document."""
        return self._sp.eos_id()

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added)."""
        return self._sp.encode(text, out_type=int)

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        """Token ids of several texts."""
        return self._sp.encode(texts, out_type=int, num_threads=num_threads)

    def decode(self, ids) -> str:
        """Text of token ids (control ids such as EOD decode to '')."""
        return self._sp.decode([int(i) for i in ids])


def _training_lines(documents):
    """Non-empty lines of the documents, each cut to ``_MAX_LINE_BYTES``."""
    for doc in documents:
        for line in doc.split("\n"):
            if line.strip():
                yield line.encode("utf-8")[:_MAX_LINE_BYTES].decode("utf-8", "ignore")


def _sample_lines(lines, k: int, seed: int) -> list[str]:
    """A uniform sample of ``k`` of ``lines`` in input order (reservoir sampling; seeded)."""
    rng, reservoir = random.Random(seed), []
    for i, line in enumerate(lines):
        if i < k:
            reservoir.append((i, line))
        else:
            j = rng.randrange(i + 1)
            if j < k:
                reservoir[j] = (i, line)
    return [line for _, line in sorted(reservoir)]


def train_sentencepiece(documents, vocab_size: int, model_path: str | Path, model_type: str = "bpe", *,
                        byte_fallback: bool = True, character_coverage: float = 0.9995,
                        input_sentence_size: int = _MAX_TRAIN_LINES, sample_seed: int | None = None) -> Path:
    """Train a SentencePiece model on ``documents`` (any iterable of str); write it atomically.

    Settings are chosen for an exact ``decode(encode(x)) == x`` round trip
    (identity normalisation, whitespace kept, newline as its own piece, byte
    fallback) and a reproducible result (one thread; the first
    ``input_sentence_size`` lines are used, or with ``sample_seed`` a uniform
    sample of that many lines of the whole input). EOS ``</s>`` (id 2) is the EOD token.
    """
    lines = _training_lines(documents)
    if sample_seed is not None and input_sentence_size > 0:
        lines = iter(_sample_lines(lines, input_sentence_size, sample_seed))
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines,
        model_writer=model,
        vocab_size=vocab_size,
        model_type=model_type,
        byte_fallback=byte_fallback,
        character_coverage=character_coverage,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        user_defined_symbols=["\n"],
        max_sentence_length=_MAX_LINE_BYTES * 4,
        input_sentence_size=input_sentence_size,
        shuffle_input_sentence=False,
        num_threads=1,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        minloglevel=2,
    )
    atomic_write_bytes(model_path, model.getvalue())
    return Path(model_path)
