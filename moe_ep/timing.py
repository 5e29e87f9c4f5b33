"""Timing on the GPU: medians of CUDA-event times, warm-up excluded."""
import statistics

import torch


def median_us(fn, iters: int = 50, warmup: int = 5) -> float:
    """Median microseconds of fn(), each call timed alone with CUDA events after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)
