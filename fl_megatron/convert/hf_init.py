"""--init-from-hf: a run's shards start from a Hugging Face directory, each rank reading only
the rows it holds."""

import torch

from ..config.model import ModelConfig
from .hf_files import SafetensorsDir
from .hf_keys import import_rows

def check_hf_source(path: str, model: ModelConfig) -> None:
    """ValueError naming every difference between the directory's model and the run's."""
    with SafetensorsDir(path) as source:
        diffs = model.differences(vars(source.model_config), "Hugging Face")
    if diffs:
        raise ValueError(f"--init-from-hf {path} holds another model: " + "; ".join(diffs)
                         + " (give the same shape flags, or drop --model and shape flags that disagree)")


class HFValues:
    """`InitialValues` read from a Hugging Face directory (row slices from safetensors files)."""

    def __init__(self, path: str, model: ModelConfig) -> None:
        self.model = model
        self.source = SafetensorsDir(path)

    def rows(self, name: str, shape: tuple, start: int, stop: int) -> torch.Tensor:
        from ..models.init import canonical_name

        return import_rows(self.model, canonical_name(name), start, stop, self.source.read_slice).float()
