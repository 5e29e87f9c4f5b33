"""AsyncTP's choice of path per shape under overlap="auto", one for eager calls and one for calls captured into
a CUDA graph: the first call of each shape (op, M, K, N), eager, times the candidates ``cost.candidate_paths``
leaves, on that call's operands, both as eager calls and as replays of CUDA graphs of GRAPH_CALLS calls each;
every later call of the shape takes the fastest of its mode (an eager call the eager times' choice, a call
made while its stream is being captured the graphs'), "never" unless an overlapped path is clearly faster
(``cost.measured_choice``: the same on every rank). The two differ where host time decides: eager calls hold
the host work of their launches, which a graph's replay does not. The eager candidates are timed as models make
their calls, GRAPH_CALLS of them back to back, so that a call's host time counts where the GPU waits for it
and not where the host runs ahead (a call timed alone pays all of it first: on 4 x H200 the fused all-gather
GEMM at M = 4096 took 866 us alone and 738 a call in a row, where NCCL and cuBLAS took 878 and 904; bench_tp's
burst columns). The candidates are timed interleaved (``timing.interleaved_median_us``): each warmed up, then
round after round one timed burst (or replay) of each, begun after a barrier, and the median of each one's
counts, so that neither drift while they are timed (clocks, NCCL's first calls of a size, host jitter) nor the
skew one path leaves between the ranks decides between them. A candidate whose graph could not be captured on
some rank is left out of the graphs' choice on every rank; "never" stays in it, untimed where its own capture
failed (and then taken)."""
from __future__ import annotations

import functools
import time

import torch
import torch.distributed as dist

from ..graphs import capturing
from ..timing import (GRAPH_CALLS, call_after_barrier_us, capture, failed_on_any_rank, failure, in_a_row,
                      interleaved_median_us)
from .config import TPConfig
from .cost import candidate_paths, measured_choice

MEASURE_WARMUP = 1        # untimed calls of each candidate (the first compiles the Triton kernels), and
                          # untimed replays of each candidate's graph
MEASURE_ROUNDS = 7        # timed bursts of each candidate (GRAPH_CALLS calls each), one a round: their median
                          # ignores 3 outliers, and the 24 bursts at most (3 candidates) are paid once per shape,
                          # by its first call; as many timed replays of each graph (as many calls each) after them


class Autotuner:
    """The paths of one AsyncTP's calls. config.overlap: "auto" measures, another value is every call's path.

    choices: (op, M, K, N) -> {"path": eager calls' path, "times_us": {path: median us of an eager call on
    the slowest rank}, "graph_path": the path of calls captured into a CUDA graph, "graph_times_us": {path:
    median us of a call in a replayed graph on the slowest rank}, "graph_failed": {path: why its capture
    failed (on which rank)}, "first_call_ms": host time spent choosing}, filled by the first call of each
    shape under overlap="auto".
    time_us(fn) -> microseconds of one call of fn(): the clock of the timed bursts and replays, by default one
    call begun after a barrier of the group; capture(fn) -> replay: a CUDA graph of GRAPH_CALLS back-to-back
    calls of fn() captured, replay() running it, raising where the capture fails (tests fake both)."""

    def __init__(self, config: TPConfig, group, device: torch.device):
        self.config, self.group, self.device = config, group, device
        self.cuda = device.type == "cuda"       # whether a call may be captured (``graphs.capturing``)
        self.choices: dict[tuple, dict] = {}
        self.time_us = self._after_barrier
        self.capture = self._capture

    def _after_barrier(self, fn) -> float:
        """Microseconds of one call of fn() (``timing.call_us``) begun on every rank together, after a
        barrier of the group: with no barrier, a burst's time would hold the skew between the ranks that the
        burst before it (another path) left, and the paths that wait in NCCL would pay for the others.
        RuntimeError off the GPU (``AsyncTP.simulated``): there, name a path."""
        if not self.cuda:
            raise RuntimeError("overlap='auto' times the paths with CUDA events on the GPU; on the CPU name a path")
        return call_after_barrier_us(fn, self.group)

    @staticmethod
    def _capture(fn):
        """The replay of a CUDA graph of GRAPH_CALLS back-to-back calls of fn() (``timing.capture``)."""
        return capture(fn, GRAPH_CALLS).replay

    def path(self, op: str, m: int, k: int, n: int, run) -> str:
        """"never", "fused" or "chunked" for a call of `op` on [M, K] @ [K, N]. Under overlap="auto" the
        first call of a shape runs `run(path)` (the op on this call's operands, result dropped) for each
        candidate, (MEASURE_WARMUP + MEASURE_ROUNDS) bursts of GRAPH_CALLS calls, then captures GRAPH_CALLS
        calls of it into a graph: collective, as every call. A call made while its stream is being captured takes
        the graphs' choice; RuntimeError if it is the first of a shape with candidates to time (make one eager
        call first).
        Whether the stream is being captured (a CUDA call) is asked at a shape's first call, then only where its
        two choices differ."""
        if m == 0 or n == 0:
            return "never"
        c = self.config
        if c.overlap != "auto":
            return c.overlap
        key = (op, m, k, n)
        choice = self.choices.get(key)
        if choice is None:
            choice = self.choices[key] = self._choose(op, m, k, n, run, capturing(self.cuda))
        eager, graph = choice["path"], choice["graph_path"]
        return eager if eager == graph or not capturing(self.cuda) else graph

    def _choose(self, op: str, m: int, k: int, n: int, run, captured: bool) -> dict:
        """The choices entry of a shape: its candidates timed eagerly and in graphs (``path``)."""
        start = time.perf_counter()
        c = self.config
        candidates = candidate_paths(op, m, k, n, c.world, c.dtype.itemsize)
        choice = {"path": "never", "times_us": {}, "graph_path": "never", "graph_times_us": {}, "graph_failed": {}}
        if len(candidates) > 1:
            if captured:
                raise RuntimeError(f"overlap='auto' times the paths of {op} at M={m}, K={k}, N={n} at its first call, "
                                   "which cannot run while a CUDA graph is being captured: make one eager call of "
                                   "this shape first")
            runs = [functools.partial(run, p) for p in candidates]
            mine = interleaved_median_us([functools.partial(in_a_row, fn) for fn in runs], MEASURE_ROUNDS,
                                         MEASURE_WARMUP, self.time_us)
            choice["path"], choice["times_us"] = measured_choice(candidates, [t / GRAPH_CALLS for t in mine],
                                                                 self.group, self.device)
            self._choose_in_graphs(candidates, runs, choice)
        choice["first_call_ms"] = (time.perf_counter() - start) * 1e3
        return choice

    def _choose_in_graphs(self, candidates: list[str], runs: list, choice: dict) -> None:
        """choice's "graph_path", "graph_times_us" and "graph_failed": a graph of each of `runs` (the candidates'
        calls, made eagerly already: no kernel compiles or loads inside a capture) captured on every rank in the
        same order, a barrier after each; those captured on every rank timed by their replays (interleaved, as the
        eager calls), each over GRAPH_CALLS, and chosen among as the eager calls are. Where "never"'s own capture
        failed there is nothing to weigh the others against: "never" is the choice, untimed."""
        replays, failed = {}, {}
        for path, fn in zip(candidates, runs):
            try:
                replays[path] = self.capture(fn)
            except Exception as e:            # a path that cannot be captured is left out, not fatal
                failed[path] = failure(e)
            dist.barrier(group=self.group)    # every rank after every capture: the collectives stay in step
        choice["graph_failed"] = failed = failed_on_any_rank(failed, self.group)
        kept = [path for path in candidates if path not in failed]
        if "never" in kept:
            mine = interleaved_median_us([replays[path] for path in kept], MEASURE_ROUNDS, MEASURE_WARMUP,
                                         self.time_us)
            choice["graph_path"], choice["graph_times_us"] = measured_choice(
                kept, [t / GRAPH_CALLS for t in mine], self.group, self.device)
