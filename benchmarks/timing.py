"""Timing shared by the benchmark scripts: CUDA events on the GPU, perf_counter on the CPU."""

from __future__ import annotations

import time
from typing import Callable

import torch


def time_ms(fn: Callable[[], object], cuda: bool = True) -> float:
    """Wall time of one call, in milliseconds, after the device has finished it."""
    if not cuda:
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def repeat_ms(fn: Callable[[], object], runs: int, warmup: int = 3, cuda: bool = True) -> list[float]:
    """``runs`` timings of ``fn`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    return [time_ms(fn, cuda) for _ in range(runs)]
