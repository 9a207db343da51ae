#!/usr/bin/env python3
"""Tokenise JSONL (.jsonl, .jsonl.gz) or text (.txt: one document per line) into Megatron
indexed datasets, ``{output_prefix}_{key}_document.bin/.idx`` per JSON key; Megatron-LM's
``tools/preprocess_data.py`` flags.

Usage: python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
           --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model tok.model --append-eod --workers 2
Blank JSONL lines are skipped; documents with no tokens are dropped (Megatron stores no
sequence for them). Outputs appear only when complete. Exit status: 0 done, 2 bad input or
arguments (nothing written), 130 interrupted (nothing written).
"""

import argparse
import sys

from fl_megatron.data.preprocess import PreprocessError, preprocess, summary
from fl_megatron.data.text_tokenizers import SUPPORTED_TYPES, build_tokenizer

# Megatron-LM flags this tool does not implement: (flag, argparse kwargs, why).
_UNSUPPORTED = [
    ("--split-sentences", dict(action="store_true"), "sentence splitting (NLTK)"),
    ("--keep-newlines", dict(action="store_true"), "sentence splitting (NLTK)"),
    ("--lang", dict(default=None), "sentence splitting (NLTK)"),
    ("--find-optimal-num-workers", dict(action="store_true"), "worker search (see tools/bench_data.py)"),
    ("--workers-to-check", dict(nargs="+", default=None), "worker search"),
    ("--max-documents", dict(type=int, default=None), "worker search"),
    ("--performance-dir", dict(default=None), "worker search"),
    ("--vocab-file", dict(default=None), "vocab/merges tokenizers (BERT, GPT2BPETokenizer)"),
    ("--merge-file", dict(default=None), "vocab/merges tokenizers (BERT, GPT2BPETokenizer)"),
]


def parse_args(argv=None):
    description, epilog = __doc__.split("\n\n", 1)
    p = argparse.ArgumentParser(allow_abbrev=False, description=description, epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="a .jsonl, .jsonl.gz, .txt or .txt.gz file")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys to extract, one output per key (default: text; a .txt input takes one key, "
                        "used only to name the output)")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=SUPPORTED_TYPES)
    g.add_argument("--tokenizer-model", required=True,
                   help="SentencePiece .model, or (HuggingFaceTokenizer) tokenizer.json or its directory")
    g.add_argument("--eod-token", default=None,
                   help="end-of-document token (default: the model's EOS; Hugging Face: the first of "
                        "<|end_of_text|>, <|endoftext|>, </s>, <eos> in the vocabulary)")
    g = p.add_argument_group("tokenization process")
    g.add_argument("--append-eod", action="store_true", help="append the EOD token to every document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="path of the outputs without _{key}_document.bin")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenising processes (1: in-process; the output "
                   "is identical for any value)")
    g.add_argument("--log-interval", type=int, default=1000, help="progress line every N documents")
    g.add_argument("--skip-bad", action="store_true",
                   help="skip malformed lines (reported at the end) instead of stopping at the first")
    g.add_argument("--partitions", type=int, default=1, help="accepted only as 1 (one input file)")
    g.add_argument("--keep-sequential-samples", action="store_true",
                   help="accepted, no effect: the output always keeps the input order")
    g = p.add_argument_group("Megatron-LM flags not supported (an error if given)")
    for flag, kwargs, why in _UNSUPPORTED:
        g.add_argument(flag, help=f"not supported: {why}", **kwargs)
    args = p.parse_args(argv)
    for flag, _, why in _UNSUPPORTED:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value not in (None, False):
            p.error(f"{flag} is not supported ({why})")
    if args.partitions != 1:
        p.error("--partitions > 1 is not supported; use --workers for parallelism")
    if args.workers < 1 or args.log_interval < 1:
        p.error("--workers and --log-interval must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    try:
        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.eod_token)
        log(f"tokenizer: {tokenizer.name} {tokenizer.model_path}, vocab {tokenizer.vocab_size}, "
            f"EOD id {tokenizer.eod_id}")
        stats = preprocess(args.input, args.output_prefix, tokenizer, json_keys=args.json_keys,
                           append_eod=args.append_eod, workers=args.workers, skip_bad=args.skip_bad,
                           log=log, log_interval=args.log_interval)
    except (PreprocessError, ValueError, OSError) as exc:
        log(f"preprocess_data.py: error: {exc}")
        return 2
    except KeyboardInterrupt:
        log("preprocess_data.py: interrupted; no output written")
        return 130
    log(summary(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
