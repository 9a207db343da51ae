"""A Hugging Face directory from an fl-megatron checkpoint of either backend, streamed tensor by
tensor: the groups' average (what the next sync gives), or one group."""

import sys
import time
from pathlib import Path

import torch

from ..checkpoint.reader import CheckpointReader
from .hf_config import generation_config, hf_config
from .hf_files import write_hf_dir
from .hf_keys import export_tensors
from .hf_tokenizer import TOKENIZER_TYPES, ExportedTokenizer, export_tokenizer, with_special_ids

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _tokenizer_file(config: dict) -> Path | None:
    """The SentencePiece model of a run trained on the demo corpus (the only tokenizer a run records)."""
    from ..config.data import DataConfig
    from ..data.demo import cached_tokenizer_path
    from ..data.sources import cache_dir

    data = DataConfig(**(config.get("data") or {}))
    if data.source != "demo":
        return None
    return cached_tokenizer_path(cache_dir(data), data.tokenizer_vocab_size)


def _run_tokenizer(reader: CheckpointReader, path: str | None, kind: str | None) -> ExportedTokenizer | None:
    """The tokenizer to export: `path` (--tokenizer), else the demo corpus's if the run trained on
    it, else none; checked to fit the model's vocabulary."""
    if path is None:
        demo = _tokenizer_file(reader.meta.get("config") or {})
        if demo is None or not demo.is_file():
            return None
        path, kind = str(demo), "GPTSentencePieceTokenizer"
    tokenizer = export_tokenizer(path, kind)
    if tokenizer.vocab_size > reader.model_cfg.vocab_size:
        raise ValueError(f"--tokenizer {path} has {tokenizer.vocab_size} tokens but the model's vocabulary is "
                         f"{reader.model_cfg.vocab_size}: it is not the tokenizer this model was trained with")
    return tokenizer


def convert(checkpoint: str, output: str, iteration: int | None = None, dtype: str = "bf16",
            group: int | None = None, max_shard_bytes: int = 5 << 30, log=print,
            tokenizer: str | None = None, tokenizer_type: str | None = None) -> Path:
    """Write `output` (config.json, generation_config.json, safetensors, the tokenizer's files)
    from `checkpoint`. `tokenizer`: the run's SentencePiece .model or tokenizer.json (default:
    the demo corpus's, for a run trained on it)."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    out = Path(output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"output {out} exists and is not empty; give a new directory")
    reader = CheckpointReader(checkpoint, iteration)
    if group is not None and group not in reader.groups:
        raise ValueError(f"--group {group}: checkpoint {reader.path} holds groups "
                         f"{', '.join(map(str, reader.groups))}")
    special = _run_tokenizer(reader, tokenizer, tokenizer_type)
    cfg, target = reader.model_cfg, DTYPES[dtype]
    which = f"group {group}" if group is not None else (
        f"the average of {len(reader.groups)} groups" if len(reader.groups) > 1 else "its single model")
    log(f"converting {reader.path} (step {reader.iteration}, {reader.meta['backend']}): {which}, {dtype}")
    start, done = time.perf_counter(), [0]

    def get(name: str) -> torch.Tensor:
        tensor = reader.tensor(name, group) if group is not None else reader.averaged(name)
        done[0] += 1
        log(f"  [{done[0]}/{len(reader.names)}] {name} {tuple(tensor.shape)}")
        return tensor.to(target)

    config = hf_config(cfg, "bfloat16" if dtype == "bf16" else "float32")
    write_hf_dir(out, with_special_ids(config, special), with_special_ids(generation_config(cfg), special),
                 export_tensors(cfg, get), max_shard_bytes=max_shard_bytes, extra_files=special and special.files)
    if special is not None:
        log(f"  tokenizer: {special.description} as {', '.join(special.files)} "
            f"(bos {special.bos_id}, eos {special.eos_id})")
    else:
        log("  no tokenizer exported (give --tokenizer with the run's .model or tokenizer.json)")
    log(f"wrote {out} in {time.perf_counter() - start:.1f} s")
    return out


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(allow_abbrev=False, description="Convert an fl-megatron checkpoint (FSDP2 or DeepSpeed) to a "
                                            "Hugging Face directory (LlamaForCausalLM or GPT2LMHeadModel).")
    p.add_argument("--checkpoint", required=True, help="the --save directory of a run")
    p.add_argument("--iteration", type=int, help="which checkpoint (default: the latest)")
    p.add_argument("--output", required=True, help="new directory to write")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="weight dtype (default bf16)")
    p.add_argument("--group", type=int, help="export one federation group instead of the groups' average")
    p.add_argument("--max-shard-size-gb", type=float, default=5.0, help="safetensors shard size (default 5)")
    p.add_argument("--tokenizer", metavar="PATH",
                   help="the run's tokenizer: a SentencePiece .model, or a tokenizer.json (or its directory); "
                        "written so that AutoTokenizer gives the same ids, with bos/eos in config.json "
                        "(default: the demo corpus's tokenizer for a run trained on it, else none)")
    p.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES,
                   help="Megatron-LM's tokenizer type, as given to tools/preprocess_data.py (default: "
                        "GPTSentencePieceTokenizer for a .model, HuggingFaceTokenizer otherwise; Llama2Tokenizer "
                        "adds a BOS)")
    args = p.parse_args(argv)
    try:
        convert(args.checkpoint, args.output, args.iteration, args.dtype, args.group,
                int(args.max_shard_size_gb * (1 << 30)), tokenizer=args.tokenizer, tokenizer_type=args.tokenizer_type)
    except (ValueError, OSError) as e:
        print(f"convert_checkpoint_to_hf: error: {e}", file=sys.stderr)
        return 2
    return 0
