"""Median wall time of a callable, with CUDA events on GPU."""
from __future__ import annotations

import statistics
import time
from typing import Callable


def median_seconds(fn: Callable[[], object], repeats: int = 10, warmup: int = 2, cuda: bool = False) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    if cuda:
        return _cuda_median(fn, repeats)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cuda_median(fn, repeats: int) -> float:
    import torch

    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)
