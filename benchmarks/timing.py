"""Timing for the benchmarks (imported, not run): one call of a function (CUDA events on a GPU, the wall clock
elsewhere, after one untimed call: compilation, allocation), and what torch.compile spent, by function."""

from __future__ import annotations

import time
from pathlib import Path


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


BACKWARD = "(backward graphs, each compiled at its first backward)"


def _field(record, name: str):
    """A CompilationMetrics field; torch added fields over its releases, so an absent one reads as None."""
    return getattr(record, name, None)


def compilation_lines(records, top: int = 8) -> list[str]:
    """What torch.compile spent in this process, from torch._dynamo.utils.get_compilation_metrics() (records with
    its CompilationMetrics' fields): a line with the total (graphs compiled, seconds), then the `top` functions that
    took longest, each with its file:line, graphs and seconds. A record without a code object is a backward graph
    compiled at its first backward (timed from its start and end); those count as one entry."""
    groups: dict[tuple, list[float]] = {}
    for r in records:
        if _field(r, "co_name"):
            key = (r.co_name, Path(_field(r, "co_filename") or "?").name, _field(r, "co_firstlineno"))
            seconds = _field(r, "entire_frame_compile_time_s") or 0.0
        else:
            key = (BACKWARD, "", None)
            start, end = _field(r, "start_time_us"), _field(r, "end_time_us")
            cumulative = _field(r, "backward_cumulative_compile_time_us") or 0
            seconds = (end - start) / 1e6 if start and end else cumulative / 1e6
        groups.setdefault(key, []).append(seconds)
    if not groups:
        return ["torch.compile in this process: nothing compiled"]
    total = sum(sum(v) for v in groups.values())
    graphs = sum(len(v) for v in groups.values())
    lines = [f"torch.compile in this process: {graphs} graph{'' if graphs == 1 else 's'}, {total:.1f} s "
             f"(dynamo, AOT autograd, inductor and the Triton compiles it waited for); the longest:"]
    for (name, file, line), seconds in sorted(groups.items(), key=lambda item: -sum(item[1]))[:top]:
        where = f" ({file}:{line})" if file else ""
        lines.append(f"  {sum(seconds):7.1f} s  {len(seconds):3d} x  {name}{where}")
    return lines
