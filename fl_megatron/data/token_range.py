"""Whether a dataset's token ids fit the model's vocabulary, checked before training starts.

A token id >= --vocab-size makes the embedding lookup fail at the first step (or, on some
devices, read garbage). The index says how many tokens there are, not which; a dataset of up
to SCAN_TOKENS tokens is read whole (exact), a larger one in evenly spaced blocks adding up to
SCAN_TOKENS (a tokenizer with a larger vocabulary shows in any sizeable sample).
"""

from typing import Optional

import numpy as np

from .indexed import IndexedDataset

SCAN_TOKENS = 1 << 24  # 16 Mi tokens, 32 MiB of uint16: a fraction of a second, even on every rank
SCAN_BLOCKS = 64


def largest_token_id(ds: IndexedDataset, budget: int = SCAN_TOKENS) -> tuple[int, int]:
    """(largest id read, tokens read): every token when there are at most `budget`, else
    `budget` of them in SCAN_BLOCKS evenly spaced blocks."""
    tokens = ds.tokens
    total = len(tokens)
    if total <= budget:
        return int(tokens.max()), total
    block = budget // SCAN_BLOCKS
    starts = np.linspace(0, total - block, SCAN_BLOCKS).astype(np.int64)
    return max(int(tokens[s:s + block].max()) for s in starts), block * SCAN_BLOCKS


def token_id_problem(ds: IndexedDataset, vocab_size: int, budget: int = SCAN_TOKENS) -> Optional[str]:
    """What is wrong with `ds` for a model of `vocab_size` tokens (None: nothing found)."""
    if np.iinfo(ds.dtype).max < vocab_size:  # the dtype cannot hold an id that large
        return None
    largest, read = largest_token_id(ds, budget)
    if largest < vocab_size:
        return None
    seen = "among all its tokens" if read == ds.num_tokens else f"among {read:,} sampled of its {ds.num_tokens:,} tokens"
    return (f"{ds.prefix} has token id {largest} {seen}, but --vocab-size is {vocab_size}: give the tokenizer's "
            "vocabulary size, or preprocess the data with the tokenizer the model is meant for")
