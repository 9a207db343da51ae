"""Configuration: dataclasses per section, validation, JSON files and Megatron-style flags."""

from .data import DataConfig
from .model import ARCHITECTURES, ModelConfig
from .parallel import BACKENDS, FederationConfig, ParallelConfig
from .run import SECTIONS, RunConfig
from .training import TrainingConfig

__all__ = ["ARCHITECTURES", "BACKENDS", "DataConfig", "FederationConfig", "ModelConfig",
           "ParallelConfig", "RunConfig", "SECTIONS", "TrainingConfig"]
