"""GEMM all-reduce: out[M, N] = sum over ranks of (a[M, K] @ w[K, N]), the whole sum on every rank.

    rank r holds a = its K-block of columns of the activations, w = its [K, N] block of rows
    (a row-parallel layer without sequence parallelism: decode, where M is small)

One persistent kernel, one-shot: no reduce-scatter then all-gather, every rank sums every tile.
A program computes a tile of this rank's partial, rounds it to the output dtype, stores it into
slot r of every rank's symmetric `partials` (its own by a local store, the peers' through NVLink)
and raises each peer's flag for (r, tile). Then it waits for the same tile's flag from every peer
and sums the W slots in fp32 in rank order, and stores the result: every rank performs the same
operations on the same values, so the ranks' outputs are bit-identical (a replicated activation
must not drift apart across ranks).

A program publishes a tile before it waits for the peers' copies of it, and the peers' programs
with the same id walk the same tiles in the same order: a wait only ever needs a tile that some
program has already published or is about to publish without waiting first, so no wait can close
a cycle while every program is resident (the grid is at most the SM count).

PUBLISH and REDUCE select the halves of each tile's work; on the GPU both run in one launch. The
CPU tests run every rank's PUBLISH half before any REDUCE half (the interpreter runs programs one
after the other, and a wait for a tile not yet published would spin until its timeout).

Reference: ``moe_ep.reference.gemm_ar`` (the same partials, rounded the same way, summed in fp32).
"""
import triton
import triton.language as tl

from ..shmem import signal_add
from .matmul import gemm_tile, sum_peer_tiles, tile_coords
from .status import TAG_AR_TILE



@triton.jit(do_not_specialize=["M", "rank", "world", "programs"])
def gemm_ar_kernel(a, w, out, partials, partial_peers, flags, flag_peers, state, status_addr, a_desc, w_desc,
                   M, N, K, rank, world, timeout_ns, stride_am, stride_wk, stride_wn, programs,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   EVEN_K: tl.constexpr, PUBLISH: tl.constexpr, REDUCE: tl.constexpr, TMA: tl.constexpr,
                   W_KMAJOR: tl.constexpr):
    """a [M, K] (row stride stride_am); w [K, N] (any strides); out [M, N]; partials [world, M, N]
    in out's dtype and flags [world, tiles] int64 are symmetric, partial_peers / flag_peers [world]
    int64 hold every rank's address of them; state [programs] int64 clock words; status int32[5].
    TMA: a and w loaded through a_desc and w_desc (``matmul.operand_descriptors``)."""
    pid = tl.program_id(0)
    status = status_addr.to(tl.pointer_type(tl.int32))
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tiles_m * tiles_n
    slab = M.to(tl.int64) * N                    # elements of one [M, N] partial
    failed = 0
    for t in range(pid, tiles, programs):
        pid_m, pid_n = tile_coords(t, tiles_m, tiles_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offsets = offs_m[:, None] * N + offs_n[None, :]        # inside one [M, N] slab: 32 bits
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        if PUBLISH:
            acc = gemm_tile(a, stride_am, a_desc, 0, w, stride_wk, stride_wn, w_desc, pid_m, pid_n, M, N, K,
                            BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, TMA, W_KMAJOR)
            part = acc.to(out.dtype.element_ty)
            tl.store(partials + rank * slab + offsets, part, mask=mask)
            for step in range(1, world):             # rank r+1 first, as every other exchange here
                dest = (rank + step) % world
                peer = tl.load(partial_peers + dest).to(tl.pointer_type(out.dtype.element_ty))
                tl.store(peer + rank * slab + offsets, part, mask=mask)
                peer_flags = tl.load(flag_peers + dest).to(tl.pointer_type(tl.int64))
                signal_add(peer_flags + rank * tiles + t, 1)
        if REDUCE:
            tl.debug_barrier()                       # this program's stores to its own slot, before its loads
            total, failed = sum_peer_tiles(tl.zeros((BLOCK_M, BLOCK_N), tl.float32), partials, slab, offsets, mask,
                                           flags, tiles, t, rank, world, timeout_ns, status, state + pid, failed,
                                           TAG_AR_TILE, True)
            tl.store(out + offsets, total.to(out.dtype.element_ty), mask=mask)
