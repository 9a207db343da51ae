"""Solve for the value of one assumption at which the model reproduces a measured speed-up."""

import math
from typing import Callable, Optional


def solve_monotone(f: Callable[[float], float], target: float, low: float, high: float,
                   iterations: int = 64) -> Optional[float]:
    """x in [low, high] (both > 0) with f(x) = target for a monotone f, by bisection on log x;
    None when the target lies outside [f(low), f(high)]."""
    f_low, f_high = f(low), f(high)
    if not min(f_low, f_high) <= target <= max(f_low, f_high):
        return None
    rising = f_high > f_low
    a, b = math.log(low), math.log(high)
    for _ in range(iterations):
        mid = (a + b) / 2
        if (f(math.exp(mid)) < target) == rising:
            a = mid
        else:
            b = mid
    return math.exp((a + b) / 2)
