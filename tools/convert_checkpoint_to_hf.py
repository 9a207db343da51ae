#!/usr/bin/env python
"""Convert an fl-megatron checkpoint (FSDP2 or DeepSpeed) into a Hugging Face directory.

    python tools/convert_checkpoint_to_hf.py --checkpoint runs/ckpt --output hf/llama [--iteration N]
        [--dtype bf16|fp32] [--group K]

By default the federated model is exported: the average of the groups' parameters, which is what
the next sync would give. Tensors are streamed: at most about one copy of the model is held.
"""

import sys

from fl_megatron.convert.from_checkpoint import main

if __name__ == "__main__":
    sys.exit(main())
