"""The device's matrix-product rate, timed before step 1, for --fl-tune's first choice: the
compute time a step takes follows from the model's FLOPs at --mfu of this rate, where the
configured --peak-tflops (an A100's by default) may describe other hardware entirely (a CPU rank
computes about 10^4 times slower). One product of the model's own shape (a micro-batch's tokens
through the first MLP projection) in the compute dtype, repeated until it has run long enough to
time; every rank of the job times it at once, as they will compute, and the slowest rank's time
counts (the same figure on every rank)."""

import time
from dataclasses import dataclass
from typing import Callable

import torch

MIN_SECONDS = 0.02     # long enough to time on the host clock (a start-up cost: kept short)
MAX_PRODUCTS = 1 << 12  # a bound on the repeats (a tiny product on a fast device)


@dataclass(frozen=True)
class ComputeRate:
    """What was timed: `products` products of (rows x inner) @ (inner x cols) in `seconds` (the
    slowest rank's), and the rate they make."""

    rows: int
    inner: int
    cols: int
    products: int
    seconds: float
    dtype: str
    wall_seconds: float  # the whole measurement, set-up and calibration included (start-up time)

    @property
    def tflops(self) -> float:
        return 2.0 * self.rows * self.inner * self.cols * self.products / max(self.seconds, 1e-12) / 1e12


def _timed_products(a: torch.Tensor, b: torch.Tensor, products: int) -> float:
    """Seconds for `products` products on the device (a device sync at both ends on CUDA)."""
    if a.is_cuda:
        torch.cuda.synchronize(a.device)
    start = time.perf_counter()
    for _ in range(products):
        torch.mm(a, b)
    if a.is_cuda:
        torch.cuda.synchronize(a.device)
    return time.perf_counter() - start


def measure_compute_rate(device: torch.device, dtype: torch.dtype, rows: int, inner: int, cols: int,
                         agree: Callable[[float], float]) -> ComputeRate:
    """Time products of the given shape on `device`: each rank finds how many take MIN_SECONDS on
    its own, then every rank times the largest such count. `agree(figure)` returns the job's MAX
    (three calls: the first only gathers the ranks), so that every rank ends with the same rate:
    the slowest rank's."""
    agree(0.0)  # every rank here: the time is the measurement's, not the wait for the last rank
    began = time.perf_counter()
    a = torch.randn(rows, inner, device=device, dtype=dtype)
    b = torch.randn(inner, cols, device=device, dtype=dtype)
    _timed_products(a, b, 1)  # the library's own set-up (cuBLAS handles, thread pools)
    products = 1
    while products < MAX_PRODUCTS and _timed_products(a, b, products) < MIN_SECONDS:
        products *= 2
    products = int(agree(float(products)))
    seconds = agree(_timed_products(a, b, products))
    return ComputeRate(rows, inner, cols, products, seconds, str(dtype).removeprefix("torch."),
                       time.perf_counter() - began)
