"""The demo data, built once and cached: a SentencePiece tokenizer trained on the shipped
corpus, and the corpus preprocessed by the same code as tools/preprocess_data.py into a
Megatron indexed dataset, which training reads like any other."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path

from fl_megatron.data.corpus import demo_corpus_path, load_documents
from fl_megatron.data.indexed import IndexedDataset
from fl_megatron.data.tokenizer import Tokenizer, atomic_write_bytes, train_sentencepiece

# Bump when the cached layout or tokenisation recipe changes.
FORMAT_VERSION = 2

_TOKENIZER = "tokenizer.model"
_OUTPUT = "stdlib-docs"         # preprocess writes {_OUTPUT}_text_document.bin/.idx
_META = "meta.json"             # written last: its presence marks a complete cache entry


@dataclasses.dataclass(frozen=True)
class DemoData:
    """Where one prepared demo data set lives."""

    tokenizer_path: Path
    prefix: Path                # indexed dataset prefix (PREFIX.bin + PREFIX.idx)

    def tokenizer(self) -> Tokenizer:
        """Load the tokenizer model."""
        return Tokenizer.from_file(self.tokenizer_path)

    def dataset(self) -> IndexedDataset:
        """Open the indexed dataset (memory-mapped)."""
        return IndexedDataset(self.prefix)


def cache_key(corpus_bytes: bytes, vocab_size: int) -> str:
    """Hash of everything the cached artefacts depend on."""
    h = hashlib.sha256()
    h.update(f"fl-megatron-demo-v{FORMAT_VERSION}:vocab={vocab_size}:".encode())
    h.update(corpus_bytes)
    return h.hexdigest()[:16]


def _log(msg: str) -> None:
    print(f"[fl_megatron.data] {msg}", file=sys.stderr, flush=True)


def _build(folder: Path, corpus_path: Path, vocab_size: int, key: str) -> None:
    """Train the tokenizer on the corpus, preprocess the corpus, then write meta.json."""
    from fl_megatron.data.preprocess import preprocess

    docs = load_documents(corpus_path)
    _log(f"training tokenizer (vocab {vocab_size}) on {len(docs)} docs...")
    start = time.perf_counter()
    model_path = train_sentencepiece(docs, vocab_size, folder / _TOKENIZER)
    _log(f"tokenizer trained in {time.perf_counter() - start:.1f} s")
    stats = preprocess(corpus_path, folder / _OUTPUT, Tokenizer.from_file(model_path), json_keys=("text",),
                       append_eod=True, workers=1, log=_log)
    meta = {"format_version": FORMAT_VERSION, "key": key, "vocab_size": vocab_size,
            "corpus": corpus_path.name, "preprocess": stats}
    atomic_write_bytes(folder / _META, json.dumps(meta, indent=1, default=str).encode())


def prepare_demo_data(cache_dir: str | Path, vocab_size: int = 4096, corpus_path: str | Path | None = None) -> DemoData:
    """Return the demo data, building it under ``cache_dir`` on first use.

    The cache sub-folder is keyed by the corpus bytes, ``vocab_size`` and ``FORMAT_VERSION``.
    Several processes may call this at once: every file is replaced atomically and concurrent
    builders write identical content.
    """
    corpus_path = Path(corpus_path) if corpus_path is not None else demo_corpus_path()
    key = cache_key(corpus_path.read_bytes(), vocab_size)
    folder = Path(cache_dir) / f"demo-{key}"
    if not (folder / _META).is_file():
        folder.mkdir(parents=True, exist_ok=True)
        _build(folder, corpus_path, vocab_size, key)
    return DemoData(tokenizer_path=folder / _TOKENIZER, prefix=folder / f"{_OUTPUT}_text_document")


def cached_tokenizer_path(cache_dir: str | Path, vocab_size: int) -> Path:
    """Where `prepare_demo_data` keeps the tokenizer for `vocab_size` (it may not be built yet)."""
    key = cache_key(demo_corpus_path().read_bytes(), vocab_size)
    return Path(cache_dir) / f"demo-{key}" / _TOKENIZER
