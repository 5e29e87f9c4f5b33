"""Masked grouped GEMM over the expert-major layout that dispatch produces.

    out[e, r, :] = a[e, r, :] @ w[e].T        for r < counts[e], every local expert e

a is [E, R, K] (bf16/fp16/fp32, or FP8 e4m3 with per-row, per-`group`-column scales that are
applied as the tile is loaded), w is [E, N, K] (an expert's weights as nn.Linear stores them),
out is [E, R, N]. Rows at or past counts[e] are never read or computed and are left as they
were: the shapes stay static (CUDA graphs), the work follows the counts.

One program computes a BLOCK_M x BLOCK_N tile of one expert; programs whose rows all lie past
the expert's count return at once.
"""
import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["rows"])
def grouped_gemm_kernel(a_ptr, scale_ptr, w_ptr, out_ptr, counts_ptr, rows, K: tl.constexpr, N: tl.constexpr,
                        FP8: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    expert = tl.program_id(2)
    count = tl.load(counts_ptr + expert)
    if tl.program_id(0) * BLOCK_M < count:
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row = expert.to(tl.int64) * rows + m
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + row[:, None] * K + k[None, :], mask=(m < count)[:, None] & (k < K)[None, :],
                        other=0.0)
            if FP8:   # BLOCK_K divides GROUP: one scale per row for the whole tile
                scale = tl.load(scale_ptr + row * (K // GROUP) + k0 // GROUP, mask=m < count, other=0.0)
                a = (a.to(tl.float32) * scale[:, None]).to(w_ptr.dtype.element_ty)
            w = tl.load(w_ptr + expert.to(tl.int64) * N * K + n[None, :] * K + k[:, None],
                        mask=(n < N)[None, :] & (k < K)[:, None], other=0.0)
            acc = tl.dot(a, w, acc)
        tl.store(out_ptr + row[:, None] * N + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(m < count)[:, None] & (n < N)[None, :])


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, scales: torch.Tensor | None = None,
                 group: int = 128, out: torch.Tensor | None = None) -> torch.Tensor:
    """a [E, R, K], w [E, N, K], counts [E] int32 (on a's device), scales [E, R, K // group] f32 for FP8 a.

    Returns out [E, R, N] in w's dtype; rows past counts[e] keep whatever `out` held.
    """
    experts, rows, k = a.shape
    if w.dim() != 3 or w.shape[0] != experts or w.shape[2] != k:
        raise ValueError(f"w must be [{experts}, N, {k}], got {tuple(w.shape)}")
    if counts.shape != (experts,):
        raise ValueError(f"counts must be [{experts}], got {tuple(counts.shape)}")
    fp8 = a.dtype == torch.float8_e4m3fn
    if fp8 and (scales is None or scales.shape != (experts, rows, k // group)):
        raise ValueError(f"FP8 input needs scales [{experts}, {rows}, {k // group}]")
    n = w.shape[1]
    if out is None:
        out = torch.empty((experts, rows, n), dtype=w.dtype, device=a.device)
    block_k = min(64, group) if fp8 else 64
    grid = (triton.cdiv(rows, 64), triton.cdiv(n, 64), experts)
    grouped_gemm_kernel[grid](a, scales if fp8 else a, w, out, counts, rows, K=k, N=n, FP8=fp8, GROUP=group,
                              BLOCK_M=64, BLOCK_N=64, BLOCK_K=block_k)
    return out
