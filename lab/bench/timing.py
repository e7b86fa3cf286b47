"""Wall time of a callable (median and spread of repeated calls), with CUDA events on GPU."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable


@dataclass(slots=True, frozen=True)
class Timing:
    """Seconds of repeated calls: their median and the fastest and slowest call (the spread)."""

    median: float
    low: float
    high: float


def time_calls(fn: Callable[[], object], repeats: int = 10, warmup: int = 2, cuda: bool = False,
               back_to_back: int = 1) -> Timing:
    """Median, fastest and slowest of ``repeats`` samples of ``fn`` after ``warmup`` calls; a sample is
    ``back_to_back`` calls in a row between two clock reads (CUDA events on a GPU), divided by their number: the
    device's time per call without the host's gap between launches."""
    for _ in range(warmup):
        fn()

    def burst():
        for _ in range(back_to_back):
            fn()

    times = _cuda_times(burst, repeats) if cuda else _cpu_times(burst, repeats)
    times = [t / back_to_back for t in times]
    return Timing(statistics.median(times), min(times), max(times))


def median_seconds(fn: Callable[[], object], repeats: int = 10, warmup: int = 2, cuda: bool = False) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after ``warmup`` calls."""
    return time_calls(fn, repeats, warmup, cuda).median


def _cpu_times(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _cuda_times(fn, repeats: int) -> list[float]:
    import torch

    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times
