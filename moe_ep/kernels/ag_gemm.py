"""All-gather GEMM: out[M, N] = all_gather(a_shard)[M, K] @ w[K, N], the gather hidden behind the GEMM.

    rank r holds a_shard = rows [r*M/W, (r+1)*M/W) of A, and w, this rank's [K, N] block of columns

Each rank pushes its shard into every peer's symmetric `gathered` buffer with the copy engine
and then raises the peer's flag for that shard from the stream's front end (host code, in
``moe_ep.tp``): no SM takes part in moving data. Meanwhile this persistent kernel computes
the tiles of the local shard (read straight from a_shard), then the tiles of the shards in
the order they are pushed: rank r-1's first, then r-2's, ... Before a program touches a shard
it waits on that shard's flag, once; a tile never waits for a shard it does not read.

Output rows are in rank order, as all_gather's. Reference: ``moe_ep.reference.ag_gemm``.
"""
import triton
import triton.language as tl

from ..shmem import wait_until_ge
from .matmul import matmul_tile, matmul_tile_tma, tile_coords
from .status import TAG_AG_SHARD



@triton.jit(do_not_specialize=["rows", "rank", "world", "programs"])
def ag_gemm_kernel(a_local, gathered, w, out, flags, state, status_addr, a_desc, gathered_desc, w_desc,
                   rows, N, K, rank, world, timeout_ns, stride_wk, stride_wn, programs,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   EVEN_K: tl.constexpr, TMA: tl.constexpr, W_KMAJOR: tl.constexpr):
    """a_local [rows, K]; gathered [world * rows, K] (symmetric, rank r's shard at rows r*rows...);
    w [K, N] (strides stride_wk, stride_wn); out [world * rows, N]; flags [world] int64 (symmetric:
    flag s is 1 once shard s has landed); state [programs] int64 clock words; status: int32[5].
    TMA: operands loaded through a_desc, gathered_desc and w_desc (``matmul.operand_descriptors``;
    a box of a shard's last rows reaches into the next shard's, whose results are masked at the store)."""
    pid = tl.program_id(0)
    status = status_addr.to(tl.pointer_type(tl.int32))
    tiles_m = tl.cdiv(rows, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_shard = tiles_m * tiles_n
    failed = 0
    waited = -1                               # the last shard this program has seen land
    for tile in range(pid, world * per_shard, programs):
        step = tile // per_shard
        shard = (rank + world - step) % world     # own shard first, then in push order
        if step > 0:
            if (shard != waited) & (failed == 0):
                landed = wait_until_ge(flags + shard, 1, timeout_ns, status, shard, TAG_AG_SHARD, state + pid)
                failed = tl.where(landed, 0, 1)
                waited = shard
            a = gathered + shard.to(tl.int64) * rows * K
        else:
            a = a_local
        pid_m, pid_n = tile_coords(tile - step * per_shard, tiles_m, tiles_n, GROUP_M)
        if TMA:   # one call of the tile loop (two would each get their own pipeline buffers)
            a_rows = a_desc
            first_row = pid_m * BLOCK_M
            if step > 0:
                a_rows = gathered_desc
                first_row += shard * rows
            acc = matmul_tile_tma(a_rows, first_row, w_desc, pid_n * BLOCK_N, K, BLOCK_M, BLOCK_N, BLOCK_K, W_KMAJOR)
        else:
            acc = matmul_tile(a, K, w, stride_wk, stride_wn, pid_m, pid_n, rows, N, K,
                              BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out + shard.to(tl.int64) * rows * N + offs_m[:, None] * N + offs_n[None, :],
                 acc.to(out.dtype.element_ty), mask=(offs_m < rows)[:, None] & (offs_n < N)[None, :])
