"""Hugging Face <-> fl-megatron conversion: configs, key mapping, streaming file reads and writes."""

from .hf_config import generation_config, hf_config, model_config_from_hf
from .hf_files import SafetensorsDir, write_hf_dir
from .hf_keys import (GPT_KEYS, GPT_TRANSPOSED, LLAMA_KEYS, Location, export_tensors, hf_names_for,
                      hf_tensor_specs, import_rows, import_tensor, locate, our_names, our_shapes)

__all__ = ["GPT_KEYS", "GPT_TRANSPOSED", "LLAMA_KEYS", "Location", "SafetensorsDir", "export_tensors",
           "generation_config", "hf_config", "hf_names_for", "hf_tensor_specs", "import_rows",
           "import_tensor", "locate", "model_config_from_hf", "our_names", "our_shapes",
           "write_hf_dir"]
