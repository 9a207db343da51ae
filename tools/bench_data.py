#!/usr/bin/env python3
"""Benchmark preprocessing throughput against the tokenizer's own, side by side in one run.

The shipped demo corpus is repeated to --megabytes of JSONL. The baseline is the tokenizer's
``encode_batch`` of all those documents in one process (no reading, parsing or writing);
``preprocess`` then runs end to end (read, parse, tokenise, write .bin/.idx) with 1 and 2
workers. Each ratio is preprocess throughput / baseline throughput (>1: faster than one
tokenizer process). Timings are medians of --repeats interleaved rounds. Then the time to fetch
one training sample from the output through the GPT dataset (as the trainer reads it).

Usage: python tools/bench_data.py [--megabytes 8] [--repeats 3]
           [--tokenizer-type GPTSentencePieceTokenizer --tokenizer-model tok.model]
(default tokenizer: the demo's, vocab 4096, built and cached on first use)
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from fl_megatron.data import demo_corpus_path, load_documents, prepare_demo_data
from fl_megatron.config.data import DataConfig
from fl_megatron.data.gpt_dataset import build_split_samples
from fl_megatron.data.sources import cache_dir
from fl_megatron.data.preprocess import default_start_method, preprocess
from fl_megatron.data.text_tokenizers import SUPPORTED_TYPES, build_tokenizer


def parse_args(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--megabytes", type=float, default=8.0, help="size of the JSONL input (default 8)")
    p.add_argument("--repeats", type=int, default=3, help="rounds; medians are reported (default 3)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts (default 1 2)")
    p.add_argument("--tokenizer-type", choices=SUPPORTED_TYPES, default="GPTSentencePieceTokenizer")
    p.add_argument("--tokenizer-model", default=None, help="default: the demo tokenizer")
    return p.parse_args(argv)


def make_input(path: Path, megabytes: float) -> list[str]:
    """Write the demo corpus, repeated, as JSONL of at least ``megabytes``; return its documents."""
    corpus = load_documents(demo_corpus_path())
    docs, size = [], 0
    with open(path, "w", encoding="utf-8") as fh:
        while size < megabytes * 1e6:
            for doc in corpus:
                line = json.dumps({"text": doc}) + "\n"
                fh.write(line)
                size += len(line.encode("utf-8"))
                docs.append(doc)
    return docs


def main(argv=None) -> int:
    args = parse_args(argv)
    model = args.tokenizer_model
    if model is None:
        model = prepare_demo_data(cache_dir(DataConfig())).tokenizer_path
    tokenizer = build_tokenizer(args.tokenizer_type, model)
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        src = Path(tmp) / "input.jsonl"
        docs = make_input(src, args.megabytes)
        mb = src.stat().st_size / 1e6
        times = {"tokenizer": []} | {w: [] for w in args.workers}
        tokens = 0
        for _ in range(args.repeats):
            start = time.perf_counter()
            tokenizer.encode_batch(docs)
            times["tokenizer"].append(time.perf_counter() - start)
            for w in args.workers:
                start = time.perf_counter()
                stats = preprocess(src, Path(tmp) / f"out{w}", tokenizer, workers=w)
                times[w].append(time.perf_counter() - start)
                tokens = stats["tokens"]
        fetch = sample_fetch_times(Path(tmp) / f"out{args.workers[0]}_text_document", Path(tmp) / "indices")
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["tokenizer"]
    print(f"input: {len(docs)} documents, {mb:.1f} MB JSONL, {tokens} tokens; tokenizer {tokenizer.name} "
          f"(vocab {tokenizer.vocab_size}); {os.cpu_count()} CPUs; workers start by "
          f"{default_start_method()}; medians of {args.repeats}")
    print(f"{'run':<26}{'seconds':>9}{'MB/s':>8}{'Mtokens/s':>11}{'docs/s':>9}{'ratio':>8}")
    rows = [("tokenizer.encode_batch", base)] + [(f"preprocess --workers {w}", med[w]) for w in args.workers]
    for name, s in rows:
        print(f"{name:<26}{s:>9.2f}{mb / s:>8.2f}{tokens / s / 1e6:>11.2f}{len(docs) / s:>9.0f}{base / s:>8.2f}")
    print("ratio: throughput / tokenizer.encode_batch throughput in one process")
    print(f"training samples (seq {FETCH_SEQ} + 1 tokens, shuffled, across documents) from that output: "
          f"index build {fetch['build_s'] * 1e3:.0f} ms for {fetch['epochs']} epochs; one sample "
          f"{fetch['first_us']:.0f} us on first access (index memory-mapped), then median "
          f"{fetch['median_us']:.1f} us, p99 {fetch['p99_us']:.1f} us over {fetch['reads']} random reads")
    return 0


FETCH_SEQ = 2048


def sample_fetch_times(prefix: Path, cache: Path, reads: int = 2000) -> dict:
    """Time to fetch one training sample through the GPT dataset, as the trainer does."""
    samples = build_split_samples([str(prefix)], "100,0,0", "train", FETCH_SEQ, 1234, cache)
    start = time.perf_counter()
    samples.prepare_for(2 * len(samples))
    build = time.perf_counter() - start
    fresh = build_split_samples([str(prefix)], "100,0,0", "train", FETCH_SEQ, 1234, cache)
    start = time.perf_counter()
    fresh[0]
    first = time.perf_counter() - start
    counters = np.random.default_rng(0).integers(0, 2 * len(samples), reads)
    times = []
    for k in counters:
        start = time.perf_counter()
        fresh[int(k)]
        times.append(time.perf_counter() - start)
    times = np.array(times) * 1e6
    return {"build_s": build, "epochs": 2, "first_us": first * 1e6, "median_us": float(np.median(times)),
            "p99_us": float(np.percentile(times, 99)), "reads": reads}


if __name__ == "__main__":
    sys.exit(main())
