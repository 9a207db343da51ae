"""Build-once, cached demo data: tokenizer plus train/valid token streams."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import sys
import time
from pathlib import Path

import numpy as np

from fl_megatron.data.corpus import demo_corpus_path, load_documents, split_documents
from fl_megatron.data.tokenizer import Tokenizer, atomic_write_bytes, train_sentencepiece

# Bump when the cached layout or tokenisation recipe changes.
FORMAT_VERSION = 1

_TOKENIZER = "tokenizer.model"
_TRAIN = "train.npy"
_VALID = "valid.npy"
_META = "meta.json"  # written last: its presence marks a complete cache entry


@dataclasses.dataclass(frozen=True)
class DemoData:
    """Paths and token arrays of one prepared demo data set."""

    tokenizer_path: Path
    train_tokens: np.ndarray
    valid_tokens: np.ndarray

    def tokenizer(self) -> Tokenizer:
        """Load the tokenizer model."""
        return Tokenizer.from_file(self.tokenizer_path)


def cache_key(corpus_bytes: bytes, vocab_size: int) -> str:
    """Hash of everything the cached artefacts depend on."""
    h = hashlib.sha256()
    h.update(f"fl-megatron-demo-v{FORMAT_VERSION}:vocab={vocab_size}:".encode())
    h.update(corpus_bytes)
    return h.hexdigest()[:16]


def tokenize_documents(tokenizer: Tokenizer, docs: list[str]) -> np.ndarray:
    """Concatenate the documents' ids as int32, with the EOD id after each one."""
    eod = tokenizer.eod_id
    pieces = [np.asarray(ids + [eod], dtype=np.int32) for ids in tokenizer.encode_batch(docs)]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


def _save_npy(path: Path, array: np.ndarray) -> None:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    atomic_write_bytes(path, buf.getvalue())


def _log(msg: str) -> None:
    print(f"[fl_megatron.data] {msg}", file=sys.stderr, flush=True)


def _build(folder: Path, corpus_path: Path, vocab_size: int, key: str) -> None:
    """Train the tokenizer, tokenise both splits and write every file atomically."""
    train_docs, valid_docs = split_documents(load_documents(corpus_path))
    _log(f"training tokenizer (vocab {vocab_size}) on {len(train_docs)} docs...")
    start = time.perf_counter()
    model_path = train_sentencepiece(train_docs, vocab_size, folder / _TOKENIZER)
    _log(f"tokenizer trained in {time.perf_counter() - start:.1f} s")
    tokenizer = Tokenizer.from_file(model_path)
    start = time.perf_counter()
    train = tokenize_documents(tokenizer, train_docs)
    valid = tokenize_documents(tokenizer, valid_docs)
    _log(f"tokenised {len(train) + len(valid)} tokens in {time.perf_counter() - start:.1f} s")
    _save_npy(folder / _TRAIN, train)
    _save_npy(folder / _VALID, valid)
    meta = {
        "format_version": FORMAT_VERSION, "key": key, "vocab_size": vocab_size,
        "corpus": corpus_path.name, "train_docs": len(train_docs), "valid_docs": len(valid_docs),
        "train_tokens": int(len(train)), "valid_tokens": int(len(valid)),
    }
    atomic_write_bytes(folder / _META, json.dumps(meta, indent=1).encode())


def prepare_demo_data(cache_dir: str | Path, vocab_size: int = 4096, corpus_path: str | Path | None = None) -> DemoData:
    """Return the demo data, building it under ``cache_dir`` on first use.

    The cache sub-folder is keyed by the corpus bytes, ``vocab_size`` and
    ``FORMAT_VERSION``; later calls memory-map the cached arrays. Several
    processes may call this at once: each file is replaced atomically and
    concurrent builders write identical content.
    """
    corpus_path = Path(corpus_path) if corpus_path is not None else demo_corpus_path()
    key = cache_key(corpus_path.read_bytes(), vocab_size)
    folder = Path(cache_dir) / f"demo-{key}"
    if not (folder / _META).is_file():
        _build(folder, corpus_path, vocab_size, key)
    return DemoData(
        tokenizer_path=folder / _TOKENIZER,
        train_tokens=np.load(folder / _TRAIN, mmap_mode="r"),
        valid_tokens=np.load(folder / _VALID, mmap_mode="r"),
    )
