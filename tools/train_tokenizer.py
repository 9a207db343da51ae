#!/usr/bin/env python3
"""Train a SentencePiece tokenizer on JSONL (.jsonl, .jsonl.gz) or text (.txt) documents.

Writes PREFIX.model and PREFIX.vocab. The model keeps text exactly (identity normalisation,
whitespace kept, byte fallback by default); its EOS ``</s>`` is the end-of-document token, so it
works with preprocess_data.py as a GPTSentencePieceTokenizer.

Usage: python tools/train_tokenizer.py --input corpus.jsonl.gz --model-prefix tok/sp \\
           --vocab-size 32000 --model-type bpe [--json-keys text] [--input-sentence-size 2000000]
"""

import argparse
import sys
import time

from fl_megatron.data.preprocess import PreprocessError, iter_documents
from fl_megatron.data.tokenizer import Tokenizer, atomic_write_bytes, train_sentencepiece


def parse_args(argv=None):
    description, epilog = __doc__.split("\n\n", 1)
    p = argparse.ArgumentParser(allow_abbrev=False, description=description, epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="a .jsonl, .jsonl.gz, .txt or .txt.gz file")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys whose text is trained on (default: text)")
    p.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, required=True, help="pieces, including control and byte pieces")
    p.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    p.add_argument("--byte-fallback", action=argparse.BooleanOptionalAction, default=True,
                   help="unknown characters as UTF-8 byte pieces (256 pieces; default: on)")
    p.add_argument("--character-coverage", type=float, default=0.9995,
                   help="fraction of characters covered by pieces (default 0.9995)")
    p.add_argument("--input-sentence-size", type=int, default=1_000_000,
                   help="train on at most N lines (documents are split at newlines), a uniform sample "
                        "of the whole input if it has more (default 1000000; 0: all)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the line sample (default 1234)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    counts = {"docs": 0, "chars": 0, "lines": 0}

    def documents():
        for text in iter_documents(args.input, args.json_keys):
            counts["docs"] += 1
            counts["chars"] += len(text)
            counts["lines"] += sum(1 for line in text.split("\n") if line.strip())
            yield text

    start = time.perf_counter()
    try:
        model = train_sentencepiece(documents(), args.vocab_size, args.model_prefix + ".model", args.model_type,
                                    byte_fallback=args.byte_fallback, character_coverage=args.character_coverage,
                                    input_sentence_size=args.input_sentence_size,
                                    sample_seed=args.seed)
    except (PreprocessError, OSError, RuntimeError, ValueError) as exc:
        print(f"train_tokenizer.py: error: {exc}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    sp = Tokenizer.from_file(model)._sp
    # one "piece<TAB>score" line per id; a newline inside a piece is written as \n
    pieces = (sp.id_to_piece(i).replace("\n", "\\n") for i in range(sp.get_piece_size()))
    vocab = "".join(f"{piece}\t{sp.get_score(i)}\n" for i, piece in enumerate(pieces))
    atomic_write_bytes(args.model_prefix + ".vocab", vocab.encode("utf-8"))
    n_bytes = sum(sp.is_byte(i) for i in range(sp.get_piece_size()))
    print(f"trained {args.model_type} model {model} ({args.model_prefix}.vocab) in {seconds:.1f} s\n"
          f"  vocab {sp.get_piece_size()} pieces ({n_bytes} byte-fallback pieces), "
          f"EOS/EOD {sp.id_to_piece(sp.eos_id())!r} = {sp.eos_id()}, BOS = {sp.bos_id()}, UNK = {sp.unk_id()}\n"
          f"  input: {counts['docs']} documents, {counts['chars']} characters, {counts['lines']} lines from "
          f"{args.input} (keys {', '.join(args.json_keys)}); trained on "
          f"{min(counts['lines'], args.input_sentence_size or counts['lines'])} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
