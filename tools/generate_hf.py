#!/usr/bin/env python
"""Generate text with transformers from a Hugging Face directory (e.g. one exported by
tools/convert_checkpoint_to_hf.py): greedy decoding from a prompt, on the CPU.

    python tools/generate_hf.py runs/demo/ckpt-hf --prompt "def read(self, path):" --max-new-tokens 32
"""

import argparse
import sys
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("model", help="a Hugging Face model directory")
    p.add_argument("--prompt", default="def read(self, path):", help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=32)
    args = p.parse_args(argv)
    if not (Path(args.model) / "config.json").is_file():
        print(f"generate_hf: error: {args.model} is not a Hugging Face model directory (no config.json); "
              "export one with tools/convert_checkpoint_to_hf.py", file=sys.stderr)
        return 2
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        print("generate_hf: error: transformers is not installed: pip install -e '.[hf]'", file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.eos_token_id)
    print(tokenizer.decode(out[0], skip_special_tokens=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
