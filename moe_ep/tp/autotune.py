"""AsyncTP's choice of path per shape under overlap="auto": the first call of each shape (op, M, K, N)
times the candidates ``cost.candidate_paths`` leaves, on that call's operands, and every later call of
the shape takes the fastest, "never" unless an overlapped path is clearly faster (``cost.measured_choice``:
the same on every rank). The candidates are timed interleaved (``timing.interleaved_median_us``): each
warmed up, then round after round one timed call of each, begun after a barrier, and the median of each
one's calls counts, so that neither drift while they are timed (clocks, NCCL's first calls of a size,
host jitter) nor the skew one path leaves between the ranks decides between them."""
from __future__ import annotations

import functools
import time

import torch

from ..timing import call_after_barrier_us, interleaved_median_us
from .config import TPConfig
from .cost import candidate_paths, measured_choice

MEASURE_WARMUP = 1        # untimed calls of each candidate (the first compiles the Triton kernels)
MEASURE_ROUNDS = 7        # timed calls of each candidate, one a round: their median ignores 3 outliers, and
                          # the 24 calls at most (3 candidates) are paid once per shape, by its first call


class Autotuner:
    """The paths of one AsyncTP's calls. config.overlap: "auto" measures, another value is every call's path.

    choices: (op, M, K, N) -> {"path", "times_us": {path: median us on the slowest rank}, "first_call_ms":
    host time spent choosing}, filled by the first call of each shape under overlap="auto".
    time_us(fn) -> microseconds of one call of fn(): the clock of the timed calls, by default one call begun
    after a barrier of the group (tests fake it)."""

    def __init__(self, config: TPConfig, group, device: torch.device):
        self.config, self.group, self.device = config, group, device
        self.choices: dict[tuple, dict] = {}
        self.time_us = self._after_barrier

    def _after_barrier(self, fn) -> float:
        """Microseconds of one call of fn() (``timing.call_us``) begun on every rank together, after a
        barrier of the group: back to back, a call's time would hold the skew between the ranks that the
        call before it (another path) left, and the paths that wait in NCCL would pay for the others.
        RuntimeError off the GPU (``AsyncTP.simulated``): there, name a path."""
        if self.device.type != "cuda":
            raise RuntimeError("overlap='auto' times the paths with CUDA events on the GPU; on the CPU name a path")
        return call_after_barrier_us(fn, self.group)

    def path(self, op: str, m: int, k: int, n: int, run) -> str:
        """"never", "fused" or "chunked" for a call of `op` on [M, K] @ [K, N]. Under overlap="auto" the
        first call of a shape runs `run(path)` (the op on this call's operands, result dropped) for each
        candidate, (MEASURE_WARMUP + MEASURE_ROUNDS) times: collective, as every call."""
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
                mine = interleaved_median_us([functools.partial(run, p) for p in candidates], MEASURE_ROUNDS,
                                             MEASURE_WARMUP, self.time_us)
                path, times = measured_choice(candidates, mine, self.group, self.device)
            self.choices[key] = {"path": path, "times_us": times,
                                 "first_call_ms": (time.perf_counter() - start) * 1e3}
        return self.choices[key]["path"]
