"""GEMM reduce-scatter: out[M/W, N] = sum over ranks of (a[M, K] @ w[K, N]), rows scattered.

    rank r holds a = its K-block of columns of the activations, w = its [K, N] block of rows;
    rank d keeps rows [d*M/W, (d+1)*M/W) of the sum

One persistent kernel does the GEMM, the exchange and the reduction. Rows bound for rank d
form shard d. Programs compute the shards in the order they leave: rank r+1's first, then
r+2's, ..., their own last. A tile of a peer's shard is rounded to the output dtype and
stored straight into that peer's symmetric `partials[r]` (NVLink stores), and the peer's
flag for (r, tile) is raised. A tile of the own shard waits for the same tile from every
peer and sums the partials in fp32, its own first and then the peers' in rank order (with
two ranks, exactly the fp32 sum p_0 + p_1), then stores the result.

Own tiles come last in every program, after all the tiles it sends, so every tile a program
waits for comes earlier in some peer program's order: with every program resident (the grid
is at most the SM count) no wait can close a cycle.

``reduce_partials_kernel`` is the last step of the chunked variant (``moe_ep.tp``), where
cuBLAS computes the partials and the copy engine moves them: the same sums, in the same order.

Reference: ``moe_ep.reference.gemm_rs`` (the same partials, rounded the same way, summed in fp32;
its order of summation is NCCL's).
"""
import triton
import triton.language as tl

from ..shmem import peer_address, signal_add
from .matmul import gemm_tile, sum_peer_tiles, tile_place
from .status import TAG_RS_TILE



@triton.jit(do_not_specialize=["rows", "rank", "world", "step_begin", "step_end", "programs"])
def gemm_rs_kernel(a, w, out, partials, partial_peers, flags, flag_peers, state, status_addr, a_desc, w_desc,
                   rows, N, K, rank, world, step_begin, step_end, timeout_ns, stride_am, stride_wk, stride_wn,
                   programs, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr, W_KMAJOR: tl.constexpr):
    """a [world * rows, K] (row stride stride_am); w [K, N] (any strides); out [rows, N];
    partials [world, rows, N] in out's dtype and flags [world, tiles per shard] int64 are symmetric,
    partial_peers / flag_peers [world] int64 hold every rank's address of them; state [programs]
    int64 clock words; status int32[5].

    The launch covers the steps [step_begin, step_end) of the schedule (0: the first shard to
    leave, world - 1: the own shard); on the GPU that is all of them in one launch. TMA: a and w
    loaded through a_desc and w_desc (``matmul.operand_descriptors``).
    """
    pid = tl.program_id(0)
    status = status_addr.to(tl.pointer_type(tl.int32))
    tiles_m = tl.cdiv(rows, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_shard = tiles_m * tiles_n
    slab = rows.to(tl.int64) * N                 # elements of one [rows, N] partial
    failed = 0
    for tile in range(step_begin * per_shard + pid, step_end * per_shard, programs):
        step = tile // per_shard
        t = tile - step * per_shard
        dest = (rank + 1 + step) % world
        pid_m, pid_n, offsets, mask = tile_place(t, tiles_m, tiles_n, rows, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = gemm_tile(a + dest.to(tl.int64) * rows * stride_am, stride_am, a_desc, dest * rows, w, stride_wk,
                        stride_wn, w_desc, pid_m, pid_n, rows, N, K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, TMA, W_KMAJOR)
        part = acc.to(out.dtype.element_ty)
        if dest != rank:
            peer = peer_address(partial_peers, dest, out.dtype.element_ty)
            tl.store(peer + rank * slab + offsets, part, mask=mask)
            signal_add(peer_address(flag_peers, dest, tl.int64) + rank * per_shard + t, 1)
        else:
            total, failed = sum_peer_tiles(part.to(tl.float32), partials, slab, offsets, mask, flags, per_shard, t,
                                           rank, world, timeout_ns, status, state + pid, failed, TAG_RS_TILE, False)
            tl.store(out + offsets, total.to(out.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["rank", "world", "numel"])
def reduce_partials_kernel(own, partials, out, rank, world, numel, BLOCK: tl.constexpr):
    """out = own + sum over src != rank of partials[src], in fp32 (own first, then rank order).

    own, out: [numel] in the output dtype; partials: [world, numel] (symmetric, the peers' slots)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    total = tl.load(own + offs, mask=mask, other=0.0).to(tl.float32)
    for src in range(0, world):
        if src != rank:
            total += tl.load(partials + src * numel + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + offs, total.to(out.dtype.element_ty), mask=mask)
