"""Checkpoints: Megatron-LM's directory layout, atomic publishing, metadata checks, save/resume."""

from .manager import Checkpointer, CheckpointReadError, CheckpointWriteError
from .metadata import find_checkpoint, saved_mode, source_groups
from .paths import TRACKER, iteration_dir, published_iterations, read_tracker
from .resume import resume_source

__all__ = ["Checkpointer", "CheckpointReadError", "CheckpointWriteError", "TRACKER", "find_checkpoint",
           "iteration_dir", "published_iterations", "read_tracker", "resume_source", "saved_mode", "source_groups"]
