"""The train and valid samples of a run, from its data settings: indexed datasets (a blend of
--data-path prefixes split by --split), the demo corpus (preprocessed into an indexed dataset
at first use), or mock tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..config.data import DataConfig
from .demo import prepare_demo_data
from .gpt_dataset import MockSamples, build_split_samples


def data_prefixes(data: DataConfig, cache_dir: Path) -> list[str]:
    """--data-path, or the demo corpus's indexed dataset (built under `cache_dir` on first use)."""
    if data.source == "indexed":
        return list(data.data_path)
    return [str(prepare_demo_data(cache_dir, data.tokenizer_vocab_size).prefix)]


def split_samples(data: DataConfig, prefixes: list[str], which: str, seq_length: int, seed: int,
                  vocab_size: int, cache_dir: Optional[Path]):
    """Samples of split `which` ("train" or "valid"); counters index them directly."""
    if data.source == "mock":
        return MockSamples(vocab_size, seq_length, seed + (which != "train"))
    index_cache = cache_dir / "indices" if cache_dir is not None else None
    return build_split_samples(prefixes, data.split, which, seq_length, seed, index_cache)
