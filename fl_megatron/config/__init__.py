"""Configuration: dataclasses per section, validation, JSON files and Megatron-style flags."""

from .checkpoint import CheckpointConfig
from .cluster import ClusterConfig
from .data import DataConfig
from .model import ARCHITECTURES, ModelConfig
from .parallel import BACKENDS, FederationConfig, ParallelConfig
from .resolved import ResolvedRun, resolve
from .run import SECTIONS, RunConfig
from .training import TrainingConfig

__all__ = ["ARCHITECTURES", "BACKENDS", "CheckpointConfig", "ClusterConfig", "DataConfig", "FederationConfig", "ModelConfig",
           "ParallelConfig", "ResolvedRun", "RunConfig", "SECTIONS", "TrainingConfig", "resolve"]
