"""The shipped demo corpus: locating, loading and splitting JSONL documents."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

_CORPUS_FILE = "stdlib-docs.jsonl.gz"


def demo_corpus_path() -> Path:
    """Path of the demo corpus shipped inside the package."""
    return Path(__file__).resolve().parent / "corpus" / _CORPUS_FILE


def load_documents(path: str | Path) -> list[str]:
    """Read the ``text`` field of every line of a ``.jsonl`` or ``.jsonl.gz`` file.

    Blank lines are skipped. A line that is not a JSON object with a string
    ``text`` field raises ``ValueError`` naming ``file:line``.
    """
    path = Path(path)
    opener = gzip.open if path.name.endswith(".gz") else open
    docs = []
    with opener(path, "rt", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: malformed JSON ({exc.msg})") from exc
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"{path}:{lineno}: expected an object with a string 'text' field")
            docs.append(record["text"])
    return docs


def split_documents(docs: list[str], valid_fraction: float = 0.05) -> tuple[list[str], list[str]]:
    """Deterministic train/valid split: every ``round(1/valid_fraction)``-th document is held out.

    Documents at positions ``stride-1, 2*stride-1, ...`` go to valid, so the
    split depends only on document order. ``valid_fraction=0`` holds out nothing.
    """
    if not 0.0 <= valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must be in [0, 1), got {valid_fraction}")
    if valid_fraction == 0.0:
        return list(docs), []
    stride = max(2, round(1.0 / valid_fraction))
    train, valid = [], []
    for i, doc in enumerate(docs):
        (valid if i % stride == stride - 1 else train).append(doc)
    return train, valid
