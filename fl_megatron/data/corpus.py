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
