"""--deterministic-mode: the same bits from the same inputs on GPUs as well as on CPUs."""

import os

import torch


def make_deterministic() -> None:
    """Ask torch for deterministic kernels (FlashAttention's and cuBLAS's included) in this
    process, before its first CUDA matrix product: cuBLAS reads CUBLAS_WORKSPACE_CONFIG when it
    creates its handle. An operation with no deterministic kernel warns rather than stops the run."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
