"""What the async-TP GEMMs (``ag_gemm``, ``gemm_rs``, ``gemm_ar``) share: the tile loop, the tile
order inside a shard, the tile shapes, and the arrival flags (the per-call reset, and a bounded
wait that a stream can be held on between two cuBLAS calls). ``matmul`` is their GEMM alone, with
no communication: what benchmarks/bench_tp.py holds against cuBLAS (the fused paths can only win
where it comes close).

The kernels are persistent: `programs` programs walk the tiles of all shards in a fixed order
(``tile = pid, pid + programs, ...``), so a program never starts a tile of a later shard before
it has finished its tiles of an earlier one. Inside a shard the tiles go in groups of GROUP_M
row-blocks (the Triton matmul tutorial's L2-friendly order).

The tile shapes depend only on the problem's sizes and dtype, never on the rank: tile ids are
part of the protocol between ranks (GEMM-RS signals one flag per tile).
"""
import torch
import triton
import triton.language as tl

from .. import shmem
from ..shmem import wait_until_ge


@triton.jit
def tile_coords(t, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Row-block and column-block of tile `t` of a shard with tiles_m x tiles_n tiles."""
    per_group = GROUP_M * tiles_n
    first_m = (t // per_group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (t % per_group) % size_m
    pid_n = (t % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def matmul_tile(a, stride_am, b, stride_bk, stride_bn, pid_m, pid_n, rows, N, K,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] tile (pid_m, pid_n) of a[:rows, :K] @ b[:K, :N].

    a is row-major with row stride stride_am; b may have any strides (nn.Linear's weight.t() too).
    Rows past `rows` and columns past N are computed from row 0 / column 0 (always readable);
    the caller masks them at the store. Offsets are 32-bit (the host keeps every operand under
    2**31 elements): 64-bit offsets per element cost registers the epilogues need.
    """
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.max_contiguous(tl.multiple_of(tl.where(offs_m < rows, offs_m, 0), BLOCK_M), BLOCK_M)
    offs_n = tl.max_contiguous(tl.multiple_of(tl.where(offs_n < N, offs_n, 0), BLOCK_N), BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            x = tl.load(a_ptrs)
            y = tl.load(b_ptrs)
        else:
            left = K - k * BLOCK_K
            x = tl.load(a_ptrs, mask=offs_k[None, :] < left, other=0.0)
            y = tl.load(b_ptrs, mask=offs_k[:, None] < left, other=0.0)
        acc = tl.dot(x, y, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def reset_and_barrier_kernel(flags, count, BLOCK: tl.constexpr):
    """Zero this rank's `count` int64 arrival flags, then a barrier over all ranks (one program).

    Peers write this call's flags and data only after the barrier, so they never race the
    reset, and never overwrite data the previous call (earlier on this stream) still reads.
    """
    for start in range(0, count, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(flags + offs, tl.zeros((BLOCK,), tl.int64), mask=offs < count)
    shmem.barrier_all_block()


@triton.jit(do_not_specialize=["index", "peer"])
def wait_flag_kernel(flags, index, state, status_addr, timeout_ns, peer, TAG: tl.constexpr):
    """Hold the stream until flags[index] >= 1, for at most timeout_ns (one program, one warp).

    Launched between two GEMMs of the chunked paths: it occupies one SM slot while the stream
    has nothing else to run, and a timeout lands in the status like any other wait.
    """
    wait_until_ge(flags + index, 1, timeout_ns, status_addr.to(tl.pointer_type(tl.int32)), peer, TAG, state)


def tile_config(rows: int, n: int, element_size: int) -> dict:
    """Tile shapes and launch options for a shard of `rows` x `n` outputs (same on every rank)."""
    block_m = 128 if rows > 64 else 64
    block_n = 256 if n >= 2048 and element_size == 2 else 128
    block_k = 64 if element_size == 2 else 32
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
                num_warps=8 if block_m * block_n >= 128 * 256 else 4, num_stages=3)


@triton.jit(do_not_specialize=["M", "programs"])
def matmul_kernel(a, w, out, M, N, K, stride_am, stride_wk, stride_wn, programs,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  EVEN_K: tl.constexpr):
    """out [M, N] = a [M, K] @ w [K, N] (any strides), the persistent tile loop of the fused kernels."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    for t in range(tl.program_id(0), tiles_m * tiles_n, programs):
        pid_m, pid_n = tile_coords(t, tiles_m, tiles_n, GROUP_M)
        acc = matmul_tile(a, stride_am, w, stride_wk, stride_wn, pid_m, pid_n, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K,
                          EVEN_K)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out + offs_m[:, None] * N + offs_n[None, :], acc.to(out.dtype.element_ty),
                 mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def matmul(a: torch.Tensor, w: torch.Tensor, programs: int, config: dict | None = None) -> torch.Tensor:
    """a [M, K] (row-major) @ w [K, N] -> [M, N] in a's dtype, on `programs` programs, with the tile
    shapes the fused kernels use for M rows (or `config`, a tile_config of another row count)."""
    (m, k), n = a.shape, w.shape[1]
    config = config or tile_config(m, n, a.element_size())
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    grid = min(programs, triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"]))
    matmul_kernel[(max(grid, 1),)](a, w, out, m, n, k, a.stride(0), w.stride(0), w.stride(1), grid,
                                   EVEN_K=k % config["BLOCK_K"] == 0, **config)
    return out
