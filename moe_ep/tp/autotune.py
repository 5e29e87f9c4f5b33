"""AsyncTP's choice of path per shape under overlap="auto": the first call of each shape (op, M, K, N)
times the candidates ``cost.candidate_paths`` leaves, on that call's operands, and every later call of
the shape takes the fastest (``cost.measured_choice``: the same on every rank)."""
from __future__ import annotations

import time

import torch

from ..timing import median_us
from .config import TPConfig
from .cost import candidate_paths, measured_choice

MEASURE_WARMUP = 1        # untimed calls of each candidate (the first compiles the Triton kernels)
MEASURE_ITERS = 3         # timed calls of each candidate; the median counts


class Autotuner:
    """The paths of one AsyncTP's calls. config.overlap: "auto" measures, another value is every call's path.

    choices: (op, M, K, N) -> {"path", "times_us": {path: us on the slowest rank}, "first_call_ms": host
    time spent choosing}, filled by the first call of each shape under overlap="auto"."""

    def __init__(self, config: TPConfig, group, device: torch.device):
        self.config, self.group, self.device = config, group, device
        self.choices: dict[tuple, dict] = {}

    def path(self, op: str, m: int, k: int, n: int, run) -> str:
        """"never", "fused" or "chunked" for a call of `op` on [M, K] @ [K, N]. Under overlap="auto" the
        first call of a shape runs `run(path)` (the op on this call's operands, result dropped) for each
        candidate: collective, as every call."""
        if m == 0 or n == 0:
            return "never"
        c = self.config
        if c.overlap != "auto":
            return c.overlap
        key = (op, m, k, n)
        if key not in self.choices:
            start = time.perf_counter()
            candidates = candidate_paths(op, m, k, n, c.world, c.dtype.itemsize)
            path, times = "never", {}
            if len(candidates) > 1:
                path, times = measured_choice(candidates, lambda p: self.time_us(lambda: run(p)), self.group,
                                              self.device)
            self.choices[key] = {"path": path, "times_us": times,
                                 "first_call_ms": (time.perf_counter() - start) * 1e3}
        return self.choices[key]["path"]

    def time_us(self, fn) -> float:
        return median_us(fn, MEASURE_ITERS, MEASURE_WARMUP)
