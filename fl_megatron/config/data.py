"""Where training data comes from."""

from dataclasses import dataclass, field
from typing import Optional

DATASETS = ("demo",)


@dataclass
class DataConfig:
    """Training data. For now: the demo corpus shipped in the package, tokenised at first use."""

    dataset: str = field(default="demo", metadata={"help": "data source: demo (the corpus shipped in the package)"})
    tokenizer_vocab_size: int = field(
        default=4096, metadata={"help": "vocabulary of the SentencePiece model trained on the demo corpus"})
    data_cache_dir: Optional[str] = field(
        default=None, metadata={"help": "cache for the tokenizer and tokenised data "
                                        "(default: $FL_MEGATRON_CACHE or ~/.cache/fl-megatron)"})

    def validate(self) -> None:
        errors = []
        if self.dataset not in DATASETS:
            errors.append(f"dataset={self.dataset!r} is not one of {', '.join(DATASETS)}")
        if not 256 <= self.tokenizer_vocab_size <= 65536:
            errors.append(f"tokenizer_vocab_size={self.tokenizer_vocab_size} must lie in [256, 65536]")
        if errors:
            raise ValueError("invalid data settings: " + "; ".join(errors))
