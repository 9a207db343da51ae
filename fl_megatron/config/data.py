"""Where training data comes from: Megatron indexed datasets, the shipped demo corpus, or mock data."""

from dataclasses import dataclass, field
from typing import Optional, Sequence

import math


def parse_data_path(values: Sequence[str]) -> list[tuple[float, str]]:
    """`[PREFIX]` or `[W1, PREFIX1, W2, PREFIX2, ...]` (Megatron's --data-path) -> normalised
    (weight, prefix) pairs."""
    values = [v for item in values for v in str(item).split()]
    if not values:
        raise ValueError("data_path is empty: give PREFIX or WEIGHT PREFIX WEIGHT PREFIX ...")
    if len(values) == 1:
        return [(1.0, values[0])]
    if len(values) % 2:
        raise ValueError(f"data_path '{' '.join(values)}': a blend needs WEIGHT PREFIX pairs, got "
                         f"{len(values)} values")
    pairs = []
    for weight, prefix in zip(values[0::2], values[1::2]):
        try:
            w = float(weight)
        except ValueError:
            raise ValueError(f"data_path: weight {weight!r} (before {prefix}) is not a number") from None
        if not math.isfinite(w) or w <= 0:
            raise ValueError(f"data_path: weight {weight!r} of {prefix} must be a positive number")
        pairs.append((w, prefix))
    total = sum(w for w, _ in pairs)
    return [(w / total, p) for w, p in pairs]


def parse_split(split: str) -> list[float]:
    """"969,30,1" (or "98/2/0", or "90,10") -> three weights summing to 1 (train, valid, test)."""
    parts = [p for p in str(split).replace("/", ",").split(",") if p.strip()]
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"split {split!r}: expected numbers like 969,30,1") from None
    if not 1 <= len(weights) <= 3 or any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
        raise ValueError(f"split {split!r}: expected up to three non-negative numbers with a positive sum")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return [w / total for w in weights]


@dataclass
class DataConfig:
    """Training data: Megatron indexed datasets (--data-path), mock tokens (--mock-data), or by
    default the demo corpus shipped in the package, preprocessed into an indexed dataset at first use."""

    data_path: Optional[list] = field(
        default=None, metadata={"help": "indexed dataset prefix(es), Megatron syntax: PREFIX, or a weighted "
                                        "blend WEIGHT PREFIX WEIGHT PREFIX ... (PREFIX.bin + PREFIX.idx)"})
    split: str = field(default="969,30,1", metadata={"help": "train,valid,test proportions of each dataset's "
                                                           "documents (contiguous ranges, Megatron's --split)"})
    mock_data: bool = field(default=False, metadata={"help": "random tokens instead of data files (benchmarks)"})
    tokenizer_vocab_size: int = field(
        default=4096, metadata={"help": "demo corpus only: vocabulary of the SentencePiece model trained on it"})
    data_cache_dir: Optional[str] = field(
        default=None, metadata={"help": "cache for sample indices and the demo's tokenizer and indexed data "
                                        "(default: $FL_MEGATRON_CACHE or ~/.cache/fl-megatron)"})

    @property
    def source(self) -> str:
        """"indexed", "mock" or "demo"."""
        return "indexed" if self.data_path else "mock" if self.mock_data else "demo"

    def validate(self) -> None:
        errors = []
        if self.data_path is not None and self.mock_data:
            errors.append("data_path and mock_data are exclusive: give one")
        for check in (lambda: self.data_path is not None and parse_data_path(self.data_path),
                      lambda: parse_split(self.split)):
            try:
                check()
            except ValueError as e:
                errors.append(str(e))
        if not 256 <= self.tokenizer_vocab_size <= 65536:
            errors.append(f"tokenizer_vocab_size={self.tokenizer_vocab_size} must lie in [256, 65536]")
        if errors:
            raise ValueError("invalid data settings: " + "; ".join(errors))
