"""Timing GPU work: CUDA-event medians, device-only time through CUDA graphs, back-to-back calls, the copy roofline.

torch is imported inside the functions (the ``fp8rl`` command's parser imports the benchmarks that use these).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def time_ms(fn: Callable[[], object], warmup: int = 3, reps: int = 20) -> float:
    """Median milliseconds of ``fn`` on the current CUDA stream (CUDA events around each call)."""
    return statistics.median(event_samples_ms(fn, reps, warmup))


def event_samples_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> list[float]:
    """Milliseconds of ``reps`` single calls of ``fn`` between CUDA events on the current stream (the host's launch
    cost included where the GPU waits for it), after ``warmup`` calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def gpu_time_ms(fn: Callable[[], object], calls: int = 10, reps: int = 10) -> float:
    """Median device milliseconds per call of ``fn``, with no host time in it: ``calls`` calls captured
    in a CUDA graph and replayed (the kernels' own time, for the bandwidth roofline)."""
    return time_ms(capture_graph(fn, calls, warmup=2).replay, warmup=2, reps=reps) / calls


def capture_graph(fn: Callable[[], object], calls: int, warmup: int) -> Any:
    """A ``torch.cuda.CUDAGraph`` of ``calls`` calls of ``fn``, after ``warmup`` calls on a side stream (compiling,
    autotuning and handle creation happen outside the capture)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def back_to_back_ms(fn: Callable[[], object], calls: int = 20) -> tuple[float, float]:
    """(milliseconds per call, host milliseconds per call) of ``calls`` eager calls issued back to back:
    the host runs ahead of the device as in a training loop, so this is max(device, host) per call."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    host = (time.perf_counter() - t0) * 1e3 / calls
    end.synchronize()
    return start.elapsed_time(end) / calls, host


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus written (the memory roofline)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), reps=10)
    return 2 * nbytes / ms / 1e6
