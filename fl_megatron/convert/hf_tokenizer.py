"""The run's tokenizer for a Hugging Face directory: files `AutoTokenizer` loads to give the same
ids as our tokenizer, and the special-token ids config.json and generation_config.json name.

A SentencePiece `.model` becomes a tokenizer.json giving its ids (`sentencepiece_fast`; with a
post-processor adding the BOS for Megatron-LM's Llama2Tokenizer type only), kept beside the
model itself (tokenizer.model); tokenizer_config.json names PreTrainedTokenizerFast, which loads
tokenizer.json as it is in transformers 4 and 5, and `split_special_tokens`, so that "<s>" in a
text is characters there too. A `tokenizer.json` is copied as it is, loaded with
PreTrainedTokenizerFast (its post-processor adds what ours adds).
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..data.text_tokenizers import HUGGINGFACE_TYPE, SENTENCEPIECE_TYPES, build_tokenizer
from .sentencepiece_fast import to_hf_tokenizer

HF_BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>")
TOKENIZER_TYPES = SENTENCEPIECE_TYPES + (HUGGINGFACE_TYPE,)


@dataclass
class ExportedTokenizer:
    """What an export writes for a tokenizer."""

    files: dict = field(default_factory=dict)  # file name -> bytes
    bos_id: Optional[int] = None
    eos_id: Optional[int] = None
    description: str = ""
    vocab_size: int = 0


def default_type(path: Path) -> str:
    """A `.model` file is SentencePiece (no BOS), anything else a Hugging Face tokenizer.json."""
    return "GPTSentencePieceTokenizer" if Path(path).suffix == ".model" else HUGGINGFACE_TYPE


def export_tokenizer(path, tokenizer_type: Optional[str] = None) -> ExportedTokenizer:
    """The files and special ids for the tokenizer at `path` (ValueError / FileNotFoundError when
    it cannot be loaded). `tokenizer_type`: Megatron-LM's name, as given to preprocessing."""
    kind = tokenizer_type or default_type(Path(path))
    if kind not in TOKENIZER_TYPES:
        raise ValueError(f"--tokenizer-type {kind!r} is not one of {', '.join(TOKENIZER_TYPES)}")
    ours = build_tokenizer(kind, path)
    if kind == HUGGINGFACE_TYPE:
        return _huggingface(ours)
    return _sentencepiece(ours, kind)


def _sentencepiece(ours, kind: str) -> ExportedTokenizer:
    from tokenizers.processors import TemplateProcessing

    sp = ours._tok._sp
    piece = lambda i: sp.id_to_piece(i) if i >= 0 else None  # noqa: E731
    bos = sp.bos_id() if sp.bos_id() >= 0 else None
    model = Path(ours.model_path).read_bytes()
    fast = to_hf_tokenizer(model)
    add_bos = kind == "Llama2Tokenizer" and bos is not None  # what SentencePieceTextTokenizer adds
    if add_bos:
        fast.post_processor = TemplateProcessing(single=f"{piece(bos)} $A", pair=f"{piece(bos)} $A {piece(bos)} $B:1",
                                                 special_tokens=[(piece(bos), bos)])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos, "add_eos_token": False,
              "bos_token": piece(sp.bos_id()), "eos_token": piece(ours.eod_id), "unk_token": piece(sp.unk_id()),
              "pad_token": piece(sp.pad_id()), "split_special_tokens": True, "clean_up_tokenization_spaces": False,
              "model_max_length": 1 << 30}
    files = {"tokenizer.json": fast.to_str().encode(), "tokenizer.model": model, "tokenizer_config.json": _json(config)}
    return ExportedTokenizer(files, bos, ours.eod_id, f"SentencePiece {ours.model_path} ({kind})", ours.vocab_size)


def _huggingface(ours) -> ExportedTokenizer:
    vocab = ours._tok.get_vocab(with_added_tokens=True)
    first = lambda names: next((n for n in names if n in vocab), None)  # noqa: E731
    bos = first(HF_BOS_CANDIDATES)
    eos = ours._tok.id_to_token(ours.eod_id)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "model_max_length": 1 << 30}
    files = {"tokenizer.json": Path(ours.model_path).read_bytes(), "tokenizer_config.json": _json(config)}
    return ExportedTokenizer(files, vocab[bos] if bos else None, ours.eod_id, f"Hugging Face {ours.model_path}",
                             ours.vocab_size)


def _json(data: dict) -> bytes:
    return (json.dumps(data, indent=2) + "\n").encode()


def with_special_ids(config: dict, tokenizer: Optional[ExportedTokenizer]) -> dict:
    """`config` (config.json or generation_config.json) naming the tokenizer's BOS and EOS."""
    if tokenizer is None:
        return config
    return {**config, "bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
