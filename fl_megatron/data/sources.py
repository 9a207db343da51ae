"""The train and valid samples of a run, from its data settings: indexed datasets (a blend of
--data-path prefixes split by --split), the demo corpus (preprocessed into an indexed dataset
at first use), or mock tokens."""

from __future__ import annotations

import os
from pathlib import Path

from ..config.data import DataConfig
from .demo import prepare_demo_data
from .gpt_dataset import MockSamples, build_splits


def cache_dir(data: DataConfig) -> Path:
    """--data-cache-path, else $FL_MEGATRON_CACHE, else ~/.cache/fl-megatron."""
    if data.data_cache_dir:
        return Path(data.data_cache_dir)
    return Path(os.environ.get("FL_MEGATRON_CACHE") or Path.home() / ".cache" / "fl-megatron")


def run_samples(data: DataConfig, seq_length: int, seed: int, vocab_size: int, with_valid: bool):
    """(train samples, valid samples or None); counters index them directly. The demo corpus
    is prepared under the cache directory first if it is the source."""
    if data.source == "mock":
        return (MockSamples(vocab_size, seq_length, seed),
                MockSamples(vocab_size, seq_length, seed + 1) if with_valid else None)
    cache = cache_dir(data)
    prefixes = list(data.data_path) if data.source == "indexed" else \
        [str(prepare_demo_data(cache, data.tokenizer_vocab_size).prefix)]
    splits = build_splits(prefixes, data.split, ["train", "valid"] if with_valid else ["train"],
                          seq_length, seed, cache / "indices", vocab_size)
    return splits["train"], splits.get("valid")
