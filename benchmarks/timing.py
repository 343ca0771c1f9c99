"""Timing one call of a function for the benchmarks (imported, not run): CUDA events on a GPU, the wall clock
elsewhere, after one untimed call (compilation, allocation)."""

from __future__ import annotations

import time


def timed_ms(fn, reps: int) -> float:
    """Milliseconds per call of fn() over `reps` calls, after one untimed call."""
    import torch

    fn()
    if not torch.cuda.is_available():
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return 1000 * (time.perf_counter() - start) / reps
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps
