"""Checkpoints: Megatron-LM's directory layout, atomic publishing, metadata checks, save/resume."""

from .initial import initial_values_for, resume_source, will_resume
from .manager import Checkpointer, CheckpointReadError, CheckpointWriteError
from .metadata import find_checkpoint, source_groups
from .paths import TRACKER, iteration_dir, published_iterations, read_tracker

__all__ = ["Checkpointer", "CheckpointReadError", "CheckpointWriteError", "TRACKER", "find_checkpoint", "initial_values_for", "iteration_dir",
           "published_iterations", "read_tracker", "resume_source", "source_groups", "will_resume"]
