"""Peak memory of this process: GPU memory allocated by torch on CUDA, resident set size on CPU."""

import resource

import torch


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def peak_memory_kind(device: torch.device) -> str:
    return "cuda_max_allocated" if device.type == "cuda" else "cpu_peak_rss"
