"""Build the demo corpus from Python standard-library docstrings.

One JSONL document per module: the module docstring followed by the
docstrings of the classes, functions and methods it defines. Docstrings are
de-duplicated across the whole corpus. The output is gzip-compressed with
``mtime=0`` so that a rerun on the same Python produces identical bytes.

Usage: python tools/make_demo_corpus.py [--out PATH] [--max-bytes N]
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import importlib
import inspect
import io
import json
import os
import pkgutil
import re
import sys
import warnings
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "fl_megatron" / "data" / "corpus" / "stdlib-docs.jsonl.gz"

# Top-level modules that have side effects on import, need a GUI, or are
# test/tooling packages we do not want in a training corpus.
SKIP_TOP = frozenset({
    "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo",
    "test", "lib2to3", "ensurepip", "venv", "pydoc_data", "msilib",
    "winreg", "winsound", "msvcrt", "_winapi", "nt", "site", "sitecustomize",
    "usercustomize", "__main__", "__hello__", "__phello__",
})

# Default values such as ``<object object at 0x7f...>`` would make reruns differ.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def stdlib_module_names() -> list[str]:
    """Sorted stdlib module and submodule names, minus side-effect, GUI and test modules."""
    names = set()
    for top in sorted(sys.stdlib_module_names):
        if top in SKIP_TOP or top.startswith(("_test", "_xx", "__")):
            continue
        names.add(top)
        mod = _quiet_import(top)
        if mod is None or not hasattr(mod, "__path__"):
            continue
        for info in pkgutil.walk_packages(mod.__path__, prefix=top + ".", onerror=lambda _n: None):
            parts = info.name.split(".")
            if any(p.startswith("__") or p in ("test", "tests", "idle_test") for p in parts):
                continue
            names.add(info.name)
    return sorted(names)


def _quiet_import(name: str):
    """Import ``name`` with warnings and stdout/stderr suppressed; None on failure."""
    sink = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except BaseException:  # noqa: BLE001 - any import failure just skips the module
        return None


def _doc(obj) -> str:
    """The object's own cleaned docstring, or ''."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        raw = getattr(obj, "__doc__", None)
    if not isinstance(raw, str):
        return ""
    return inspect.cleandoc(raw).strip()


def _signature(obj) -> str:
    """``(args)`` text of a callable's signature, or '' when unavailable."""
    if not callable(obj):
        return ""
    try:
        text = str(inspect.signature(obj))
    except Exception:  # noqa: BLE001 - some C objects have broken signatures
        return ""
    return _ADDRESS.sub("", text)


def _members(mod):
    """(qualified name, object) pairs for the classes/functions ``mod`` exposes."""
    out = []
    for name, obj in sorted(vars(mod).items()):
        if name.startswith("__") or inspect.ismodule(obj):
            continue
        if inspect.isclass(obj):
            out.append((name, obj))
            for attr, member in sorted(vars(obj).items()):
                func = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
                if inspect.isroutine(func) or inspect.isdatadescriptor(func):
                    out.append((f"{name}.{attr}", func))
        elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
            out.append((name, obj))
    return out


def module_document(name: str, seen: set[str]) -> str:
    """Text of one module's document; '' if it adds nothing new."""
    mod = _quiet_import(name)
    if mod is None:
        return ""
    parts = []
    doc = _doc(mod)
    if doc and doc not in seen:
        seen.add(doc)
        parts.append(f"Module {name}\n\n{doc}")
    for qual, obj in _members(mod):
        doc = _doc(obj)
        if len(doc) < 8 or doc in seen:
            continue
        seen.add(doc)
        parts.append(f"{name}.{qual}{_signature(obj)}\n\n{doc}")
    return "\n\n".join(parts)


def build_documents(max_bytes: int) -> list[str]:
    """Documents in sorted module order, stopping once ``max_bytes`` is reached."""
    seen: set[str] = set()
    docs, total = [], 0
    for name in stdlib_module_names():
        text = module_document(name, seen)
        if not text:
            continue
        size = len(text.encode("utf-8"))
        if total + size > max_bytes:
            continue
        docs.append(text)
        total += size
    return docs


def write_corpus(docs: list[str], out: Path) -> int:
    """Write gzip JSONL atomically; return the uncompressed size in bytes."""
    raw = "".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs).encode("utf-8")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        with gzip.GzipFile(filename="", mode="wb", fileobj=fh, mtime=0, compresslevel=9) as gz:
            gz.write(raw)
    os.replace(tmp, out)
    return len(raw)


def main(argv: list[str] | None = None) -> None:
    """CLI entry point."""
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--max-bytes", type=int, default=3_500_000, help="cap on raw text size")
    args = parser.parse_args(argv)
    docs = build_documents(args.max_bytes)
    raw = write_corpus(docs, args.out)
    print(f"{len(docs)} documents, {raw} bytes raw, {args.out.stat().st_size} bytes gzip -> {args.out}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
