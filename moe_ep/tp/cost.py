"""How ``AsyncTP``'s overlap="auto" picks a path for a shape: a cost model orders the paths and rules
out the hopeless ones (``predicted_us``, ``candidate_paths``); the choice itself is measured
(``autotune``: interleaved, a median per candidate) and made the same on every rank (``measured_choice``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import collectives

# Cost model of overlap="auto" (H200, 2 GPUs over NVLink): it orders the paths and rules out the
# hopeless ones; the choice itself is measured (``autotune``) and decided by measured_choice.
CUBLAS_TFLOPS = 750.0     # dense bf16 GEMM
GEMM_GBPS = 3000.0        # bytes per second a GEMM reads and writes where that, not its FLOPs, bounds it (a few
                          # rows against large weights: cuBLAS streamed 2.6-3.0 TB/s of weights on an H200 at
                          # K = 8192 and M <= 128, benchmarks/NOTES.md "The tile loop at small M")
TRITON_SPEED = 0.85       # the persistent Triton GEMM's speed relative to cuBLAS
LINK_GBPS = 350.0         # bytes a GPU receives per second over NVLink, per direction
HBM_GBPS = 3500.0         # bytes per second of an elementwise pass (reads + writes)
OVERHEAD_US = 20.0        # barrier launch, flags and the extra launches of one overlapped call

HOPELESS = 1.5            # a path predicted this much slower than the best prediction is not timed: wide
                          # enough for unmeasured constants, narrow enough that the launches and the
                          # barrier of an overlapped call rule it out on small shapes
MARGIN = 0.97             # an overlapped path is taken only where it measured at most this fraction of
                          # "never"'s time: a median of 7 calls moves by a few percent between runs, and a
                          # win smaller than that is noise that may well be a loss (the layers must never
                          # be slower than the plain path they replace)


def predicted_us(op: str, m: int, k: int, n: int, world: int, element_size: int = 2) -> dict[str, float]:
    """Predicted microseconds of each path for out = [M, K] @ [K, N] on every rank (op "ag_gemm":
    the M rows are gathered first; "gemm_rs": the [M, N] result is reduced and scattered; "gemm_ar":
    it is all-reduced, which has no chunked path).

        never    gemm + link                           one after the other
                 (gemm: its FLOPs at CUBLAS_TFLOPS or its operands' bytes at GEMM_GBPS, the longer)
        fused    max(gemm / TRITON_SPEED, link)        the slower of the two hides the other
        chunked  gemm + max(0, link - gemm / W)        the first shard's GEMM hides the transfers
                 (+ one elementwise pass over the W partials for gemm_rs)

    link is what a GPU receives: (W-1)/W of the gathered or scattered rows; for gemm_ar 2(W-1)/W of
    [M, N], through NCCL's ring as through the fused kernel's two shots (the peers' partials of the tiles it
    owns, then the sums of the others' tiles).
    """
    gemm = max(2 * m * k * n / (CUBLAS_TFLOPS * 1e6), (m * k + k * n + m * n) * element_size / (GEMM_GBPS * 1e3))
    row_bytes = (k if op == "ag_gemm" else n) * element_size
    link = (world - 1) / world * m * row_bytes / (LINK_GBPS * 1e3)
    if op == "gemm_ar":
        return {"never": gemm + 2 * link, "fused": max(gemm / TRITON_SPEED, 2 * link) + OVERHEAD_US}
    reduce = (world + 1) * m // world * n * element_size / (HBM_GBPS * 1e3) if op == "gemm_rs" else 0.0
    return {"never": gemm + link, "fused": max(gemm / TRITON_SPEED, link) + OVERHEAD_US,
            "chunked": gemm + max(0.0, link - gemm / world) + reduce + OVERHEAD_US}


def candidate_paths(op: str, m: int, k: int, n: int, world: int, element_size: int = 2) -> list[str]:
    """The paths overlap="auto" times for this shape, fastest predicted first: "never" always, an
    overlapped path where predicted_us puts it within HOPELESS of the best prediction."""
    times = predicted_us(op, m, k, n, world, element_size)
    best = min(times.values())
    return sorted((path for path, t in times.items() if path == "never" or t <= HOPELESS * best), key=times.get)


def measured_choice(candidates: list[str], times_us: list[float], group, device) -> tuple[str, dict[str, float]]:
    """The path `candidates`' times on their slowest rank choose: (path, {path: us}), the same on every
    rank. The fastest overlapped path where it takes at most MARGIN of "never"'s time, else "never".
    times_us: this rank's microseconds of each candidate, in the order of `candidates` ("never" among them;
    the medians ``autotune.Autotuner`` measured); collective: every rank passes the same candidates in the
    same order, and each candidate's times are all-reduced with MAX."""
    times = torch.tensor(times_us, dtype=torch.float64, device=device)
    collectives.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    slowest = dict(zip(candidates, times.tolist()))
    best = min(candidates, key=slowest.get)
    return (best if slowest[best] <= MARGIN * slowest["never"] else "never"), slowest
