"""GEMM all-reduce: out[M, N] = sum over ranks of (a[M, K] @ w[K, N]), the whole sum on every rank.

    rank r holds a = its K-block of columns of the activations, w = its [K, N] block of rows
    (a row-parallel layer without sequence parallelism: decode, where M is small)

One persistent kernel, two-shot: each tile of the output has an owner rank, which sums it and hands
the sum to the others (a reduce-scatter, then an all-gather, tile by tile). With the tiles spread
evenly over the owners (at least W of them), a GPU sends 2(W-1)/W of [M, N] over NVLink, where a
one-shot exchange (every rank sums every tile) sends W-1 of it.

A tile goes through three steps, on every rank in the program with the same id:

    publish  compute the tile of this rank's partial, round it to the output dtype and store it into
             slot r of the owner's symmetric `partials` (through NVLink, then raise the owner's flag for
             (r, tile)), or of its own where this rank owns the tile. No wait.
    reduce   (the owner) wait for every peer's copy, sum the W slots in fp32 in rank order, store the
             result into `out` and into slot r of every peer's `partials`, and raise their flags for
             (r, tile).
    gather   (the others) wait for the owner's flag, copy its sum from the owner's slot of this rank's
             `partials` into `out`.

A program walks its tiles in a pipeline: at step i + 1 it publishes its tile i, reduces tile i - 1 and
gathers tile i - 2, so that what a step waits for was sent a step earlier, while the peers computed
their next tile, and only the last tiles' sums and copies follow the last GEMM (three walks one after
the other left all of the reduce's and the gather's latency after it; benchmarks/NOTES.md). A program
with one tile (tiles <= programs) has nothing to hide them behind. Owners rotate along each program's
tiles, (program + i) mod W, so that every program does its share of the sums.

Step 0 is the call's barrier, per program and inside the kernel (``matmul.program_arrives``): the program
zeroes its tiles' flags and counts its call on every rank; its first publish waits, after its first tile's
GEMM, until the same program of every rank has (``matmul.program_barrier``). No reset kernel runs before
the call: one launch, and no program waits for another program's barrier.

The owner's sum reaches every rank bit for bit (a replicated activation must not drift apart across
ranks). Slot s of a rank's `partials` holds, tile by tile, either rank s's partial (tiles this rank owns)
or rank s's sum (tiles rank s owns): no tile's slot is written twice, and flag (s, tile) announces it.

Deadlock: the waits of step i are for what peers' programs with the same id send at their step i - 1
(an arrival or a publish, which wait for nothing before they send, or a sum, whose own waits are for the
publishes of step i - 2); by induction on i every wait ends while every program is resident (the grid is
at most the SM count). A program whose wait timed out sends nothing more: its peers time out too.

A launch runs the steps [step_begin, step_end) of every program; on the GPU that is all of them in one
launch. The CPU tests run each step on every rank before the next (the interpreter runs programs one after
the other, and a wait for something a peer sends later in the same launch would spin until its timeout),
so a schedule whose waits needed a step not yet run times out there.

Reference: ``moe_ep.reference.gemm_ar`` (the same partials, rounded the same way, summed in fp32).
"""
import triton
import triton.language as tl

from ..shmem import peer_address, signal_add, signal_add_to, wait_until_ge
from .matmul import pipelined_tile, program_arrives, program_tiles, sum_peer_tiles, tile_place
from .status import TAG_AR_SUM, TAG_AR_TILE


@triton.jit(do_not_specialize=["M", "rank", "world", "step_begin", "step_end", "programs"])
def gemm_ar_kernel(a, w, out, partials, partial_peers, flags, flag_peers, arrivals, arrival_peers, state, status_addr,
                   a_desc, w_desc, M, N, K, rank, world, step_begin, step_end, timeout_ns, stride_am, stride_wk,
                   stride_wn, programs, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr, W_KMAJOR: tl.constexpr,
                   WORLD_PAD: tl.constexpr):
    """a [M, K] (row stride stride_am); w [K, N] (any strides); out [M, N]; partials [world, M, N]
    in out's dtype, flags [world, tiles] int64 and arrivals [programs, world] int64 are symmetric,
    partial_peers / flag_peers / arrival_peers [world] int64 hold every rank's address of them; state
    [programs] int64 clock words; status int32[5]. TMA: a and w loaded through a_desc and w_desc
    (``matmul.operand_descriptors``). WORLD_PAD: world rounded up to a power of 2."""
    pid = tl.program_id(0)
    status = status_addr.to(tl.pointer_type(tl.int32))
    tiles_m, tiles_n, tiles, mine = program_tiles(M, N, programs, BLOCK_M, BLOCK_N)
    slab = M.to(tl.int64) * N                    # elements of one [M, N] partial
    dtype = out.dtype.element_ty
    failed = 0
    for step in range(step_begin, tl.minimum(step_end, mine + 3)):
        if step == 0:                            # the call's barrier, its first half: the flags of its tiles zeroed
            program_arrives(flags, tiles, mine, programs, arrivals, arrival_peers, rank, world, WORLD_PAD)
        i = step - 1
        if (i >= 0) & (i < mine):                # publish tile i (its second half of the barrier at i = 0)
            t, _, offsets, mask, acc, failed = pipelined_tile(
                i, a, stride_am, a_desc, w, stride_wk, stride_wn, w_desc, tiles_m, tiles_n, M, N, K, programs,
                arrivals, rank, world, timeout_ns, status, state + pid, failed, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                EVEN_K, TMA, W_KMAJOR, WORLD_PAD)
            owner = (pid + i) % world
            if failed == 0:
                slot = partials if owner == rank else peer_address(partial_peers, owner, dtype)
                tl.store(slot + rank * slab + offsets, acc.to(dtype), mask=mask)
                if owner != rank:
                    signal_add(peer_address(flag_peers, owner, tl.int64) + rank * tiles + t, 1)
        if (i >= 1) & (i <= mine):               # reduce tile i - 1, where this rank owns it
            owner = (pid + i - 1) % world
            if owner == rank:
                t = pid + (i - 1) * programs
                _, _, offsets, mask = tile_place(t, tiles_m, tiles_n, M, N, BLOCK_M, BLOCK_N, GROUP_M)
                tl.debug_barrier()               # this program's store to its own slot, before its loads
                total, failed = sum_peer_tiles(tl.zeros((BLOCK_M, BLOCK_N), tl.float32), partials, slab, offsets,
                                               mask, flags, tiles, t, rank, world, timeout_ns, status, state + pid,
                                               failed, TAG_AR_TILE, True)
                result = total.to(dtype)
                tl.store(out + offsets, result, mask=mask)
                if failed == 0:                  # a program whose wait timed out sends nothing: its peers time out
                    for hop in range(1, world):
                        peer = peer_address(partial_peers, (rank + hop) % world, dtype)
                        tl.store(peer + rank * slab + offsets, result, mask=mask)
                    ranks = tl.arange(0, WORLD_PAD)
                    signal_add_to(flag_peers, rank * tiles + t, (ranks < world) & (ranks != rank), 1, WORLD_PAD)
        if i >= 2:                               # gather tile i - 2, where another rank owns it
            owner = (pid + i - 2) % world
            if owner != rank:
                t = pid + (i - 2) * programs
                _, _, offsets, mask = tile_place(t, tiles_m, tiles_n, M, N, BLOCK_M, BLOCK_N, GROUP_M)
                if failed == 0:
                    landed = wait_until_ge(flags + owner * tiles + t, 1, timeout_ns, status, owner, TAG_AR_SUM,
                                           state + pid)
                    failed = tl.where(landed, 0, 1)
                tl.store(out + offsets, tl.load(partials + owner * slab + offsets, mask=mask), mask=mask)
