"""Data: Megatron indexed datasets, GPT samples over them, the shipped demo corpus, the sampling contract."""

from fl_megatron.data.corpus import demo_corpus_path, load_documents
from fl_megatron.data.demo import DemoData, prepare_demo_data
from fl_megatron.data.samples import (
    BatchSource,
    SampleOrder,
    TokenSamples,
    eval_batches,
    eval_sample_indices,
    global_sample_ids,
)
from fl_megatron.data.tokenizer import Tokenizer, train_sentencepiece

__all__ = [
    "BatchSource",
    "DemoData",
    "SampleOrder",
    "TokenSamples",
    "Tokenizer",
    "demo_corpus_path",
    "eval_batches",
    "eval_sample_indices",
    "global_sample_ids",
    "load_documents",
    "prepare_demo_data",
    "train_sentencepiece",
]
