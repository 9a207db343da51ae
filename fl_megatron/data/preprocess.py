"""Text (JSONL, .jsonl.gz, .txt) to Megatron indexed datasets, one per JSON key.

The input is streamed as batches of raw lines; parsing and tokenisation run in
the worker processes (or in-process for ``workers=1``); the main process writes
the results in input order, so the output does not depend on ``workers``.
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import itertools
import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from fl_megatron.data.indexed import IndexedDatasetWriter, optimal_dtype
from fl_megatron.data.text_tokenizers import build_tokenizer

BATCH_LINES = 256            # lines per task sent to a worker
BATCH_BYTES = 1 << 20        # ... or fewer, once they reach this many bytes
MAX_BAD_EXAMPLES = 5         # skipped lines quoted in the report


class PreprocessError(ValueError):
    """Bad input: a malformed line (``FILE:LINE: reason``) or no documents at all."""


def is_text_file(path) -> bool:
    """Whether ``path`` is plain text (``.txt``/``.txt.gz``: one document per line)."""
    name = os.fspath(path).lower()
    return name.endswith(".txt") or name.endswith(".txt.gz")


def output_prefix_for(output_prefix, key: str) -> str:
    """Megatron-LM's output naming: ``{output_prefix}_{key}_document``."""
    return f"{os.fspath(output_prefix)}_{key}_document"


def read_batches(path, batch_lines: int = BATCH_LINES, batch_bytes: int = BATCH_BYTES):
    """Yield lists of ``(line_number, raw_bytes)``, streaming the (gzip) file."""
    opener = gzip.open if os.fspath(path).lower().endswith(".gz") else open
    with opener(path, "rb") as fh:
        batch, size = [], 0
        for lineno, line in enumerate(fh, start=1):
            batch.append((lineno, line))
            size += len(line)
            if len(batch) >= batch_lines or size >= batch_bytes:
                yield batch
                batch, size = [], 0
        if batch:
            yield batch


def parse_line(raw: bytes, json_keys, text_mode: bool):
    """The texts of one line per key, ``None`` for a blank JSONL line; ValueError if malformed."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"invalid UTF-8 at byte {exc.start}") from None
    if text_mode:
        text = line[:-1] if line.endswith("\n") else line
        return [text[:-1] if text.endswith("\r") else text]
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"malformed JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    texts = []
    for key in json_keys:
        if key not in record:
            raise ValueError(f"missing key {key!r}")
        if not isinstance(record[key], str):
            raise ValueError(f"key {key!r} is {type(record[key]).__name__}, expected a string")
        texts.append(record[key])
    return texts


def iter_documents(path, json_keys=("text",), skip_bad: bool = False, skipped: list | None = None):
    """Yield the text of every key of every document of ``path``, streaming.

    A malformed line raises ``PreprocessError`` (``FILE:LINE: reason``) unless
    ``skip_bad``; then its line number is appended to ``skipped``.
    """
    text_mode = is_text_file(path)
    for batch in read_batches(path):
        for lineno, raw in batch:
            try:
                texts = parse_line(raw, json_keys, text_mode)
            except ValueError as exc:
                if not skip_bad:
                    raise PreprocessError(f"{path}:{lineno}: {exc}") from None
                if skipped is not None:
                    skipped.append(lineno)
                continue
            if texts is not None:
                yield from texts


class Encoder:
    """Parses and tokenises one batch of lines; picklable (the tokenizer pickles itself)."""

    def __init__(self, tokenizer, json_keys, append_eod: bool, text_mode: bool, dtype):
        self.tokenizer, self.json_keys = tokenizer, tuple(json_keys)
        self.append_eod, self.text_mode, self.dtype = append_eod, text_mode, np.dtype(dtype)

    def __call__(self, batch):
        """``(docs, bad, {key: (tokens, lengths)})`` for the batch's good lines, in order."""
        bad, columns = [], [[] for _ in self.json_keys]
        for lineno, raw in batch:
            try:
                texts = parse_line(raw, self.json_keys, self.text_mode)
            except ValueError as exc:
                bad.append((lineno, str(exc)))
                continue
            if texts is not None:
                for column, text in zip(columns, texts):
                    column.append(text)
        out = {}
        eod = [self.tokenizer.eod_id] if self.append_eod else []
        for key, texts in zip(self.json_keys, columns):
            ids = self.tokenizer.encode_batch(texts) if texts else []
            docs = [x + eod if x else x for x in ids]  # as Megatron: no EOD on an empty document
            lengths = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
            flat = itertools.chain.from_iterable(docs)
            out[key] = (np.fromiter(flat, dtype=self.dtype, count=int(lengths.sum())), lengths)
        return len(columns[0]), bad, out


_worker_encoder = None


def _init_worker(encoder):
    global _worker_encoder
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread per worker process
    _worker_encoder = encoder


def _encode_in_worker(batch):
    return _worker_encoder(batch)


def default_start_method() -> str:
    """``fork`` when available and this process has one OS thread (fast, and safe then), else ``spawn``."""
    if "fork" in multiprocessing.get_all_start_methods():
        try:
            if len(os.listdir("/proc/self/task")) == 1:
                return "fork"
        except OSError:
            pass
    return "spawn"


def _encoded_batches(encoder, batches, workers: int, start_method: str | None):
    """Results of ``encoder`` on ``batches``, in order; bounded read-ahead across workers."""
    if workers <= 1:
        yield from map(encoder, batches)
        return
    ctx = multiprocessing.get_context(start_method or default_start_method())
    pending = collections.deque()
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(encoder,))
    try:
        # Keep 4 tasks per worker in flight (Pool.imap would read the whole input ahead of slow workers).
        for batch in batches:
            pending.append(pool.submit(_encode_in_worker, batch))
            if len(pending) >= 4 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class _Progress:
    """Progress lines every ``interval`` documents, and the elapsed time."""

    def __init__(self, log, interval: int):
        self.log, self.interval, self.start = log, max(1, interval), time.perf_counter()
        self.next = self.interval

    def seconds(self) -> float:
        return time.perf_counter() - self.start

    def update(self, docs: int, tokens: int) -> None:
        if self.log is None or docs < self.next:
            return
        self.next = (docs // self.interval + 1) * self.interval
        s = max(self.seconds(), 1e-9)
        self.log(f"processed {docs} documents ({docs / s:,.0f} docs/s, {tokens / s:,.0f} tokens/s)")


def preprocess(input_path, output_prefix, tokenizer, json_keys=("text",), append_eod: bool = True,
               workers: int = 1, skip_bad: bool = False, log=None, log_interval: int = 1000,
               start_method: str | None = None) -> dict:
    """Tokenise ``input_path`` into ``{output_prefix}_{key}_document.bin/.idx`` per key.

    ``tokenizer``: an object with ``encode_batch``, ``eod_id`` and ``vocab_size``
    (picklable if ``workers > 1``), or a ``(tokenizer_type, tokenizer_model)``
    pair. Workers start with ``start_method`` (default: ``default_start_method()``;
    any method works). Raises ``PreprocessError`` on a malformed line (unless ``skip_bad``) or
    if a key ends up with no tokens; then no output file is left. Returns stats.
    """
    if isinstance(tokenizer, (tuple, list)):
        tokenizer = build_tokenizer(*tokenizer)
    json_keys = tuple(json_keys)
    if not json_keys or len(set(json_keys)) != len(json_keys):
        raise ValueError(f"json_keys must be distinct and non-empty, got {list(json_keys)}")
    text_mode = is_text_file(input_path)
    if text_mode and len(json_keys) != 1:
        raise ValueError(f"{input_path} is plain text (one document per line): give one key, got {list(json_keys)}")
    if not Path(input_path).is_file():
        raise FileNotFoundError(f"input not found: {input_path}")
    dtype = optimal_dtype(tokenizer.vocab_size)
    encoder = Encoder(tokenizer, json_keys, append_eod, text_mode, dtype)
    progress = _Progress(log, log_interval)
    stats = dict(input=os.fspath(input_path), tokenizer=getattr(tokenizer, "name", type(tokenizer).__name__),
                 vocab_size=tokenizer.vocab_size, eod_id=tokenizer.eod_id, dtype=str(dtype),
                 append_eod=append_eod, workers=workers, documents=0, tokens=0, skipped=0,
                 skipped_examples=[], empty={k: 0 for k in json_keys}, tokens_per_key={k: 0 for k in json_keys})
    writers, done = {}, []
    try:
        for key in json_keys:
            writers[key] = IndexedDatasetWriter(output_prefix_for(output_prefix, key), dtype)
        results = _encoded_batches(encoder, read_batches(input_path), workers, start_method)
        with contextlib.closing(results):  # stops the pool early on an error
            for docs, bad, out in results:
                _count_bad(stats, bad, input_path, skip_bad)
                for key, (tokens, lengths) in out.items():
                    _write(writers[key], tokens, lengths)
                    stats["empty"][key] += int(np.count_nonzero(lengths == 0))
                    stats["tokens_per_key"][key] += int(tokens.size)
                    stats["tokens"] += int(tokens.size)
                stats["documents"] += docs
                progress.update(stats["documents"], stats["tokens"])
        for key in json_keys:
            if stats["tokens_per_key"][key] == 0:
                raise PreprocessError(f"{input_path}: no tokens for key {key!r} "
                                      f"({stats['documents']} documents, {stats['skipped']} lines skipped)")
        for key in json_keys:
            writers[key].finalize()
            done += [writers[key].bin_path, writers[key].idx_path]
    except BaseException as exc:
        for writer in writers.values():
            writer.abort()
        for path in done:  # a key finalized before a later one failed: nothing may look complete
            Path(path).unlink(missing_ok=True)
        if isinstance(exc, OSError) and (exc.filename is None or str(exc.filename).startswith(str(output_prefix))):
            raise PreprocessError(f"could not write the output {output_prefix} (.bin/.idx): {exc}; nothing "
                                  f"was left there and {input_path} is untouched") from exc
        raise
    stats["outputs"] = done
    stats["seconds"] = progress.seconds()
    return stats


def _count_bad(stats: dict, bad: list, input_path, skip_bad: bool) -> None:
    """Raise on the first malformed line, or count it (and quote the first few) if ``skip_bad``."""
    if bad and not skip_bad:
        raise PreprocessError(f"{input_path}:{bad[0][0]}: {bad[0][1]}")
    stats["skipped"] += len(bad)
    room = max(MAX_BAD_EXAMPLES - len(stats["skipped_examples"]), 0)
    stats["skipped_examples"] += [f"{input_path}:{n}: {why}" for n, why in bad[:room]]


def _write(writer, tokens: np.ndarray, lengths: np.ndarray) -> None:
    """Add each non-empty document (empty ones are dropped, as Megatron drops empty sequences)."""
    ends = np.cumsum(lengths)
    for start, end in zip((ends - lengths).tolist(), ends.tolist()):
        if end > start:
            writer.add_document(tokens[start:end])


def summary(stats: dict) -> str:
    """Human-readable final report of ``preprocess``'s stats."""
    s = max(stats["seconds"], 1e-9)
    lines = [f"{stats['documents']} documents, {stats['tokens']} tokens ({stats['dtype']}) in {s:.2f} s "
             f"({stats['documents'] / s:,.0f} docs/s, {stats['tokens'] / s:,.0f} tokens/s), "
             f"{stats['skipped']} lines skipped"]
    lines += [f"  skipped {example}" for example in stats["skipped_examples"]]
    if stats["skipped"] > len(stats["skipped_examples"]):
        lines.append(f"  ... and {stats['skipped'] - len(stats['skipped_examples'])} more")
    for key, n in stats["empty"].items():
        if n:
            lines.append(f"  {n} empty '{key}' documents dropped")
    lines += [f"  wrote {path}" for path in stats["outputs"]]
    return "\n".join(lines)
