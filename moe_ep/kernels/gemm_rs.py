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

At small M a shard's rows are fewer than a tile's (M = 128 at 4 ranks: 32 rows a shard, where the
small-M tiles take 128), and tiles over one shard read the weights once per shard: W times in all.
``gemm_rs_rows_kernel`` takes tiles over all M rows instead, reading the weights once, and stores each
rank's rows of a tile into that rank's `partials[r]`. A program runs its tiles as a pipeline, as the
GEMM all-reduce's (its barrier too, per program, in the kernel): at step i + 1 it publishes tile i
(every rank's rows of it, its own into its own slot) and sums its own rows of tile i - 1, whose peer
rows were sent at the peers' step i while they computed tile i. Every wait of a step is for what a
peer's program sends at its step before, before that step's own wait, so by induction every wait
ends while every program is resident. The sum takes the W slots in rank order.

``reduce_partials_kernel`` is the last step of the chunked variant (``moe_ep.tp``), where
cuBLAS computes the partials and the copy engine moves them: the same sums, in the same order.

Reference: ``moe_ep.reference.gemm_rs`` (the same partials, rounded the same way, summed in fp32;
its order of summation is NCCL's).
"""
import triton
import triton.language as tl

from ..shmem import peer_address, signal_add
from .matmul import gemm_tile, pipelined_tile, program_arrives, program_tiles, sum_peer_tiles, tile_place
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


@triton.jit(do_not_specialize=["M", "rank", "world", "step_begin", "step_end", "programs"])
def gemm_rs_rows_kernel(a, w, out, partials, partial_peers, flags, flag_peers, arrivals, arrival_peers, state,
                        status_addr, a_desc, w_desc, M, N, K, rank, world, step_begin, step_end, timeout_ns, stride_am,
                        stride_wk, stride_wn, programs, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
                        W_KMAJOR: tl.constexpr, WORLD_PAD: tl.constexpr):
    """gemm_rs_kernel's result with tiles over all M rows of a [M, K] (row stride stride_am), whose rows may
    belong to several ranks; w [K, N] (any strides); out [M / world, N]; partials [world, M / world, N] in
    out's dtype, flags [world, tiles] int64 (tiles: of [M, N]) and arrivals [programs, world] int64 are
    symmetric, partial_peers / flag_peers / arrival_peers [world] int64 hold every rank's address of them;
    state [programs] int64 clock words; status int32[5].

    The launch covers the steps [step_begin, step_end) of the pipeline (the barrier's arrival, a program's
    tiles, one more); on the GPU that is all of them in one launch. TMA: a and w loaded through a_desc and
    w_desc. WORLD_PAD: world rounded up to a power of 2."""
    pid = tl.program_id(0)
    status = status_addr.to(tl.pointer_type(tl.int32))
    tiles_m, tiles_n, tiles, mine = program_tiles(M, N, programs, BLOCK_M, BLOCK_N)
    rows = M // world                            # a rank's rows
    slab = rows.to(tl.int64) * N                 # elements of one [rows, N] partial
    dtype = out.dtype.element_ty
    failed = 0
    for step in range(step_begin, tl.minimum(step_end, mine + 2)):
        if step == 0:                            # the call's barrier, its first half (as gemm_ar_kernel's)
            program_arrives(flags, tiles, mine, programs, arrivals, arrival_peers, rank, world, WORLD_PAD)
        i = step - 1
        if (i >= 0) & (i < mine):                # publish tile i: rank d's rows into slot `rank` of d's partials
            t, pid_m, offsets, mask, acc, failed = pipelined_tile(
                i, a, stride_am, a_desc, w, stride_wk, stride_wn, w_desc, tiles_m, tiles_n, M, N, K, programs,
                arrivals, rank, world, timeout_ns, status, state + pid, failed, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                EVEN_K, TMA, W_KMAJOR, WORLD_PAD)
            if failed == 0:
                part = acc.to(dtype)
                owner = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) // rows
                last = (tl.minimum(pid_m * BLOCK_M + BLOCK_M, M) - 1) // rows
                for dest in range(pid_m * BLOCK_M // rows, last + 1):
                    slot = partials if dest == rank else peer_address(partial_peers, dest, dtype)
                    place = slot + rank * slab + offsets - dest * rows * N
                    tl.store(place, part, mask=mask & (owner == dest)[:, None])
                    if dest != rank:
                        signal_add(peer_address(flag_peers, dest, tl.int64) + rank * tiles + t, 1)
        if i >= 1:                               # sum this rank's rows of tile i - 1, if it has any
            t = pid + (i - 1) * programs
            pid_m, pid_n, offsets, mask = tile_place(t, tiles_m, tiles_n, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            first = pid_m * BLOCK_M
            if (first < rank * rows + rows) & (tl.minimum(first + BLOCK_M, M) > rank * rows):
                offs_m = first + tl.arange(0, BLOCK_M)
                own = mask & ((offs_m >= rank * rows) & (offs_m < rank * rows + rows))[:, None]
                here = offsets - rank * rows * N     # the tile's place in out and in a [rows, N] slab
                tl.debug_barrier()                   # this program's store to its own slot, before its loads
                total, failed = sum_peer_tiles(tl.zeros((BLOCK_M, BLOCK_N), tl.float32), partials, slab, here, own,
                                               flags, tiles, t, rank, world, timeout_ns, status, state + pid, failed,
                                               TAG_RS_TILE, True)
                tl.store(out + here, total.to(dtype), mask=own)


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
