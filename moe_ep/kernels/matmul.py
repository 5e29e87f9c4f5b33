"""What the async-TP GEMMs (``ag_gemm``, ``gemm_rs``, ``gemm_ar``) share: the tile loop, the tile
order inside a shard, the tile shapes, and the arrival flags (the per-call reset with its bounded
barrier, a bounded wait that a stream can be held on between two cuBLAS calls, and ``sum_peer_tiles``,
the reduce-scatter's and all-reduce's sum of the peers' tiles as their flags land). ``matmul`` is their GEMM alone, with
no communication: what benchmarks/bench_gemm.py and bench_tp.py hold against cuBLAS (the fused
paths can only win where it comes close).

A tile is computed one of two ways (``VARIANTS``):
  - pointer loads (``matmul_tile``): Triton pipelines them as cp.async copies into shared memory;
  - tensor descriptors (``matmul_tile_tma``): Hopper's TMA engine copies whole [BLOCK, BLOCK_K]
    boxes, zero-filling past the edges, with no address arithmetic in the registers the wgmma
    accumulator needs. The weight's descriptor is over w [K, N] when its rows are contiguous, or
    over w.T [N, K] (nn.Linear's weight, seen through .t()) whose [BLOCK_N, BLOCK_K] box is
    transposed in shared memory for the dot.
The fused kernels store output tiles with pointers: a shard's tiles go into row ranges of a larger
buffer, or into a peer's, where a descriptor's box would overwrite the next shard's rows. ``matmul``
alone can also flatten the tile loop and the K loop into one pipelined loop (the next tile's loads
start during this tile's last dots) and store its tiles through a descriptor of its output, in two
halves ("tma_flat_store", four stages): the fastest loop measured on an H200, within 2-4% of cuBLAS on
all but one of bench_gemm.py's shapes (benchmarks/NOTES.md). The fused kernels cannot flatten: the
all-gather GEMM waits for a shard's flag before its tiles load it, and a flattened loop would issue
those loads ahead of the wait. They take FUSED_VARIANTS; DEFAULT_VARIANT is "tma" (10-20% faster than
pointer loads on every shape measured), falling back to pointers for operands TMA cannot address
(``loads_through_descriptors``). (A warp-specialized loop, triton 3.6's ``tl.range(warp_specialize=True)``,
never returned from its first call on an H200: not offered.)

The kernels are persistent: `programs` programs walk the tiles of all shards in a fixed order
(``tile = pid, pid + programs, ...``), so a program never starts a tile of a later shard before
it has finished its tiles of an earlier one. Inside a shard the tiles go in groups of GROUP_M
row-blocks (the Triton matmul tutorial's L2-friendly order). Where the tiles are not a multiple of the
programs, the last wave keeps only some SMs busy. ``matmul``'s variant "tma_split_tail" runs the whole
waves as the loop does and deals the last wave's K steps out evenly over every program (``matmul_tail``:
the pieces of a tile summed in K order by whichever program finishes its last one). On an H200 it did not
pay where it was meant to (M = 128, 448 tiles of 128 x 64 for 132 SMs: 0.83x cuBLAS, as one program a
tile): there the bound was a's rows read again from L2 for every column block, which wider tiles removed
(SMALL_M_TILES). The fused kernels do not split.

The tile shapes depend only on the problem's sizes, dtype and program count, never on the rank: tile
ids are part of the protocol between ranks (GEMM-RS signals one flag per tile).

Up to SMALL_M_ROWS rows a GEMM is mostly a read of the weights, and 128 x 256 tiles leave most SMs idle
(M = 128, N = 7168: 28 tiles for 132 SMs). The fused kernels (up to FUSED_SMALL_M_ROWS rows) and
``matmul_small_m`` take the widest tiles of SMALL_M_TILES that still keep the SMs streaming their own strips
of the weights and fill the last wave about as well as narrower ones (``small_m_tile``);
``matmul_small_m`` runs one a program, and where even the narrowest tiles
are fewer than the SMs it splits K (``small_m_config``'s rule) and a second kernel sums the slices'
fp32 partials in a fixed order (``sum_splits_kernel``), so its results are deterministic. Its K loop is
the tile loop's over a range of K blocks (``gemm_slice``), loading either way.
"""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..launcher import cdiv
from ..shmem import signal_add_to, wait_all_ge, wait_until_ge
from .status import TAG_TP_BARRIER


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
def tile_place(t, tiles_m, tiles_n, rows, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Tile t's (pid_m, pid_n) (``tile_coords``), its elements' offsets inside one [rows, N] slab (32 bits) and
    their mask: where the fused kernels store a tile, and load it back."""
    pid_m, pid_n = tile_coords(t, tiles_m, tiles_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < rows)[:, None] & (offs_n < N)[None, :]
    return pid_m, pid_n, offs_m[:, None] * N + offs_n[None, :], mask


@triton.jit
def matmul_tile(a, stride_am, b, stride_bk, stride_bn, pid_m, pid_n, rows, N, K,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] tile (pid_m, pid_n) of a[:rows, :K] @ b[:K, :N] (``matmul_slice`` over all of K)."""
    return matmul_slice(a, stride_am, b, stride_bk, stride_bn, pid_m, pid_n, rows, N, K, 0, tl.cdiv(K, BLOCK_K),
                        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)


@triton.jit
def matmul_slice(a, stride_am, b, stride_bk, stride_bn, pid_m, pid_n, rows, N, K, k_first, k_last,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] tile (pid_m, pid_n) of a[:rows, k0:k1] @ b[k0:k1, :N] over the K blocks
    [k_first, k_last): k0 = k_first * BLOCK_K, k1 = min(k_last * BLOCK_K, K).

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
    first = k_first * BLOCK_K
    a_ptrs = a + offs_m[:, None] * stride_am + (first + offs_k)[None, :]
    b_ptrs = b + (first + offs_k)[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(k_first, k_last):
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
def matmul_tile_tma(a_desc, row, b_desc, col, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, B_KMAJOR: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] tile A[row:row + BLOCK_M, :K] @ B[:K, col:col + BLOCK_N] through tensor
    descriptors (``matmul_slice_tma`` over all of K)."""
    return matmul_slice_tma(a_desc, row, b_desc, col, 0, tl.cdiv(K, BLOCK_K), BLOCK_M, BLOCK_N, BLOCK_K, B_KMAJOR)


@triton.jit
def matmul_slice_tma(a_desc, row, b_desc, col, k_first, k_last, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, B_KMAJOR: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] tile A[row:row + BLOCK_M, k0:k1] @ B[k0:k1, col:col + BLOCK_N] over the K
    blocks [k_first, k_last) (k0 = k_first * BLOCK_K, k1 = k_last * BLOCK_K) through tensor descriptors:
    a_desc over A [*, K] with boxes [BLOCK_M, BLOCK_K]; b_desc over B [K, N] with boxes [BLOCK_K, BLOCK_N],
    or (B_KMAJOR) over B.T [N, K] with boxes [BLOCK_N, BLOCK_K]. Rows, columns and K past a descriptor's
    shape load as zeros."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(k_first, k_last):
        x = a_desc.load([row, k * BLOCK_K])
        if B_KMAJOR:
            y = b_desc.load([col, k * BLOCK_K]).T
        else:
            y = b_desc.load([k * BLOCK_K, col])
        acc = tl.dot(x, y, acc)
    return acc


@triton.jit
def reset_and_barrier_kernel(flags, count, arrivals, arrival_peers, rank, world, state, status_addr, timeout_ns,
                             BLOCK: tl.constexpr, WORLD_PAD: tl.constexpr):
    """Zero this rank's `count` int64 arrival flags, then a bounded barrier over all ranks (one program).

    arrivals [world] int64 (symmetric): word s counts the calls rank s has begun, on every rank;
    arrival_peers [world] int64: every rank's address of it. This rank counts its call in its own word and
    adds it to its word of every peer's (release: after the reset), then waits until every word has
    reached its own count, for at most timeout_ns (state: the program's int64 clock word; status: int32[5],
    where a timeout is reported under TAG_TP_BARRIER). The counts live on the device: a CUDA graph may hold
    the kernel. Peers write this call's flags and data only after the barrier, so they never race the
    reset, and never overwrite data the previous call (earlier on this stream) still reads. A rank that
    does not begin the call (it refused it, or stopped) leaves its peers with a timeout, not a hang; a
    peer whose barrier timed out still runs its call (its status reports the timeout, and its object
    raises from then on), so its writes may land in the rank that had not begun it, whose next call then
    pairs with that one, as EPAllToAll's calls pair with whichever call of the same number comes.
    """
    for start in range(0, count, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(flags + offs, tl.zeros((BLOCK,), tl.int64), mask=offs < count)
    peers = tl.arange(0, WORLD_PAD)
    signal_add_to(arrival_peers, rank, (peers < world) & (peers != rank), 1, WORLD_PAD)
    call = tl.atomic_add(arrivals + rank, 1, sem="relaxed", scope="cta") + 1
    wait_all_ge(arrivals, world, call, timeout_ns, status_addr.to(tl.pointer_type(tl.int32)), TAG_TP_BARRIER, state,
                WORLD_PAD)


@triton.jit
def program_arrives(flags, tiles, mine, programs, arrivals, arrival_peers, rank, world, WORLD_PAD: tl.constexpr):
    """The first half of a pipelined kernel's barrier, one per program (gemm_ar's, gemm_rs_rows'), in place of
    reset_and_barrier_kernel's launch: zero this rank's flags of the program's tiles (flags [world, tiles]:
    the program's `mine` tiles pid, pid + programs, ..., for every rank), then count the program's call in its
    word of every rank's arrivals [programs, world] (release: after the zeros). Program p of every rank runs
    the tiles of program p, and the grid depends on the call's shape only, so program p's calls are the same
    on every rank: their counts agree, and no reset is needed. Its peers store into this rank's buffers only
    after ``program_barrier``, so never before its zeros land, and never while its previous call (earlier on
    this stream: the whole kernel ended) still reads them."""
    pid = tl.program_id(0)
    ranks = tl.arange(0, WORLD_PAD)
    for i in range(0, mine):
        tl.store(flags + ranks * tiles + pid + i * programs, tl.zeros((WORLD_PAD,), tl.int64), mask=ranks < world)
    signal_add_to(arrival_peers, pid * world + rank, (ranks < world) & (ranks != rank), 1, WORLD_PAD)
    tl.atomic_add(arrivals + pid * world + rank, 1, sem="relaxed", scope="cta")


@triton.jit
def program_barrier(arrivals, rank, world, timeout_ns, status, state, WORLD_PAD: tl.constexpr):
    """The second half of ``program_arrives``' barrier, before the program's first store to a peer: wait until
    every rank's program with this id has counted as many calls as this one (bounded; a timeout is reported
    under TAG_TP_BARRIER). Returns True once they have. The program's own count is read back by an atomic
    behind a barrier (the CPU tests run the two halves in launches of their own, so it is not carried)."""
    pid = tl.program_id(0)
    tl.debug_barrier()
    call = tl.atomic_add(arrivals + pid * world + rank, 0, sem="relaxed", scope="cta")
    return wait_all_ge(arrivals + pid * world, world, call, timeout_ns, status, TAG_TP_BARRIER, state, WORLD_PAD)


@triton.jit
def program_tiles(M, N, programs, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tiles of [M, N] (tiles_m, tiles_n, tiles) and how many of them this program of a persistent grid of
    `programs` runs, `mine`: tiles pid, pid + programs, ... (gemm_ar's, gemm_rs_rows', matmul_kernel's)."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles = tiles_m * tiles_n
    return tiles_m, tiles_n, tiles, tl.cdiv(tiles - tl.program_id(0), programs)


@triton.jit
def pipelined_tile(i, a, stride_am, a_desc, w, stride_wk, stride_wn, w_desc, tiles_m, tiles_n, M, N, K, programs,
                   arrivals, rank, world, timeout_ns, status, state, failed, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
                   TMA: tl.constexpr, W_KMAJOR: tl.constexpr, WORLD_PAD: tl.constexpr):
    """The GEMM of tile i of this program in a pipelined kernel over all M rows (gemm_ar's, gemm_rs_rows'): its
    id t, place (``tile_place``) and fp32 tile; at the program's first tile, the call's barrier waited for
    behind the GEMM (``program_barrier``). Returns (t, pid_m, offsets, mask, acc, failed)."""
    t = tl.program_id(0) + i * programs
    pid_m, pid_n, offsets, mask = tile_place(t, tiles_m, tiles_n, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = gemm_tile(a, stride_am, a_desc, 0, w, stride_wk, stride_wn, w_desc, pid_m, pid_n, M, N, K, BLOCK_M, BLOCK_N,
                    BLOCK_K, EVEN_K, TMA, W_KMAJOR)
    if i == 0:
        passed = program_barrier(arrivals, rank, world, timeout_ns, status, state, WORLD_PAD)
        failed = tl.where(passed, 0, 1)
    return t, pid_m, offsets, mask, acc, failed


@triton.jit(do_not_specialize=["index", "peer"])
def wait_flag_kernel(flags, index, state, status_addr, timeout_ns, peer, TAG: tl.constexpr):
    """Hold the stream until flags[index] >= 1, for at most timeout_ns (one program, one warp).

    Launched between two GEMMs of the chunked paths: it occupies one SM slot while the stream
    has nothing else to run, and a timeout lands in the status like any other wait.
    """
    wait_until_ge(flags + index, 1, timeout_ns, status_addr.to(tl.pointer_type(tl.int32)), peer, TAG, state)


# How the tile loop loads and schedules (see the module docstring). TMA: tensor descriptors;
# FLATTEN: the option of tl.range on the tile loop; STORE_TMA: output tiles stored through a descriptor;
# SPLIT_TAIL: the last, partial wave of tiles dealt out by K blocks over every program (``matmul_tail``);
# launch options here replace tile_config's. "tma_flat_store": a fourth stage, which fits because the
# output tile is stored in halves.
VARIANTS = {
    "pointer": dict(TMA=False, FLATTEN=False, STORE_TMA=False, SPLIT_TAIL=False),
    "tma": dict(TMA=True, FLATTEN=False, STORE_TMA=False, SPLIT_TAIL=False),
    "tma_flat": dict(TMA=True, FLATTEN=True, STORE_TMA=False, SPLIT_TAIL=False),
    "tma_flat_store": dict(TMA=True, FLATTEN=True, STORE_TMA=True, SPLIT_TAIL=False, num_stages=4),
    "tma_split_tail": dict(TMA=True, FLATTEN=False, STORE_TMA=False, SPLIT_TAIL=True),
}
DEFAULT_VARIANT = "tma"
FUSED_VARIANTS = ("pointer", "tma")     # what the fused kernels' tile loops can run (AsyncTP's tile_loop)


GROUP_M = 8     # row tiles a group of the tile order walks before the next columns: w's strips stay in L2


def tile_count(rows: int, n: int, tile: dict, shards: int = 1) -> int:
    """The tiles of `shards` shards of `rows` x `n` outputs each in `tile`'s BLOCK_M x BLOCK_N."""
    return shards * cdiv(rows, tile["BLOCK_M"]) * cdiv(n, tile["BLOCK_N"])


def tile_config(rows: int, n: int, element_size: int) -> dict:
    """Tile shapes and launch options for a shard of `rows` x `n` outputs (same on every rank).

    128 x 256 x 64 bf16 tiles with 8 warps (two warpgroups of wgmma, 128 fp32 accumulator registers
    a thread) and 3 stages of 48 KB of operands; 4 stages (192 KB) also fit Hopper's 227 KB, and
    stay a variant (tma_s4) until benchmarks/bench_gemm.py shows they pay."""
    block_m = 128 if rows > 64 else 64
    block_n = 256 if n >= 2048 and element_size == 2 else 128
    block_k = 64 if element_size == 2 else 32
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=GROUP_M,
                num_warps=8 if block_m * block_n >= 128 * 256 else 4, num_stages=3)


@triton.jit
def gemm_tile(a, stride_am, a_desc, first_row, w, stride_wk, stride_wn, w_desc, pid_m, pid_n, rows, N, K,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
              TMA: tl.constexpr, W_KMAJOR: tl.constexpr):
    """fp32 tile (pid_m, pid_n) of A[:rows, :K] @ w [K, N] (``gemm_slice`` over all of K)."""
    return gemm_slice(a, stride_am, a_desc, first_row, w, stride_wk, stride_wn, w_desc, pid_m, pid_n, rows, N, K, 0,
                      tl.cdiv(K, BLOCK_K), BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, TMA, W_KMAJOR)


@triton.jit
def gemm_slice(a, stride_am, a_desc, first_row, w, stride_wk, stride_wn, w_desc, pid_m, pid_n, rows, N, K, k_first,
               k_last, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
               TMA: tl.constexpr, W_KMAJOR: tl.constexpr):
    """fp32 tile (pid_m, pid_n) of A[:rows, K blocks k_first..k_last-1] @ w [those rows of K, N] for a block
    of `rows` rows of A that starts at pointer `a` (row stride stride_am; ``matmul_slice``, w any strides)
    or, TMA, at row first_row of a_desc (``matmul_slice_tma`` with w_desc)."""
    if TMA:
        acc = matmul_slice_tma(a_desc, first_row + pid_m * BLOCK_M, w_desc, pid_n * BLOCK_N, k_first, k_last,
                               BLOCK_M, BLOCK_N, BLOCK_K, W_KMAJOR)
    else:
        acc = matmul_slice(a, stride_am, w, stride_wk, stride_wn, pid_m, pid_n, rows, N, K, k_first, k_last,
                           BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    return acc


@triton.jit
def store_tile_tma(out_desc, row, col, acc, BLOCK_N: tl.constexpr):
    """Store the [BLOCK_M, BLOCK_N] tile acc at (row, col) of out_desc (boxes [BLOCK_M, BLOCK_N / 2], in
    out_desc's dtype) as two half tiles: each half's registers are free for the next tile sooner, and
    the TMA engine clips rows and columns past out_desc's shape."""
    halves = tl.permute(tl.reshape(acc.to(out_desc.dtype), (acc.shape[0], 2, BLOCK_N // 2)), (0, 2, 1))
    left, right = tl.split(halves)
    out_desc.store([row, col], left)
    out_desc.store([row, col + BLOCK_N // 2], right)


@triton.jit
def store_tile(out, out_desc, pid_m, pid_n, acc, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               STORE_TMA: tl.constexpr):
    """Tile (pid_m, pid_n) of out [M, N] = acc, through out_desc (``store_tile_tma``) or with pointers."""
    if STORE_TMA:
        store_tile_tma(out_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, acc, BLOCK_N)
    else:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out + offs_m[:, None] * N + offs_n[None, :], acc.to(out.dtype.element_ty),
                 mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@triton.jit
def share_start(p, work, deal):
    """The first K step of program p's share of a split tail (``matmul_tail``): `work` steps dealt over `deal`
    programs, program p taking [share_start(p), share_start(p + 1))."""
    return p * work // deal


@triton.jit
def tail_program(step, work, deal):
    """The program whose share of a split tail holds K step `step` (``share_start``): the last p whose share
    starts at or before it."""
    return ((step + 1) * deal - 1) // work


@triton.jit
def matmul_tail(a, a_desc, w, w_desc, out, out_desc, partials, counts, M, N, K, stride_am, stride_wk, stride_wn,
                programs, tiles_m, tiles_n, first, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
                W_KMAJOR: tl.constexpr, STORE_TMA: tl.constexpr, MIN_PIECE: tl.constexpr):
    """Tiles `first` .. tiles - 1 of out = a @ w, fewer than the programs: the partial last wave of the tile
    loop, which would leave the other programs idle for a whole tile's time. Their K steps (BLOCK_K each,
    tile after tile: `work` of them) are dealt out evenly over `deal` programs: as many as give each at least
    MIN_PIECE steps (a piece's pipeline fills once; and a tile in many pieces would leave one program to add
    them all), at most all of them, at least one a tile. So a program's share is no longer than a tile's K and
    spans at most two tiles. A piece that is a whole tile is stored as the loop stores tiles. Each other piece's
    fp32 sum goes into its program's slot of `partials` [programs * 2, BLOCK_M * BLOCK_N] (slot 2p + j: program
    p's j-th piece) and is counted in its tile's word of `counts` [tiles - first] int32 (zeros at launch); the
    program that counts a tile's last piece, whichever it is, adds the tile's pieces in K order (the same bits
    on every call and GPU of the same program count) and stores the tile. Nothing waits for another program."""
    steps = tl.cdiv(K, BLOCK_K)
    tail = tiles_m * tiles_n - first
    work = tail * steps
    deal = tl.maximum(tail, tl.minimum(programs, work // MIN_PIECE))
    pid = tl.program_id(0)
    start = share_start(pid, work, deal)
    end = tl.where(pid < deal, share_start(pid + 1, work, deal), start)
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    for j in range(0, 2):
        if start < end:
            u = start // steps
            stop = tl.minimum(end, (u + 1) * steps)
            pid_m, pid_n = tile_coords(first + u, tiles_m, tiles_n, GROUP_M)
            acc = gemm_slice(a, stride_am, a_desc, 0, w, stride_wk, stride_wn, w_desc, pid_m, pid_n, M, N, K,
                             start - u * steps, stop - u * steps, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, TMA, W_KMAJOR)
            q_first = tail_program(u * steps, work, deal)
            q_last = tail_program((u + 1) * steps - 1, work, deal)
            if q_first == q_last:
                store_tile(out, out_desc, pid_m, pid_n, acc, M, N, BLOCK_M, BLOCK_N, STORE_TMA)
            else:
                tl.store(partials + (pid * 2 + j) * (BLOCK_M * BLOCK_N) + offs, acc)
                tl.debug_barrier()               # every thread's piece stored before the count releases it
                if tl.atomic_add(counts + u, 1, sem="acq_rel", scope="gpu") == q_last - q_first:
                    total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
                    for q in range(q_first, q_last + 1):  # a tile is program q's second piece where q began before it
                        slot = q * 2 + (share_start(q, work, deal) < u * steps).to(tl.int32)
                        total += tl.load(partials + slot * (BLOCK_M * BLOCK_N) + offs, cache_modifier=".cg")
                    store_tile(out, out_desc, pid_m, pid_n, total, M, N, BLOCK_M, BLOCK_N, STORE_TMA)
            start = stop


@triton.jit(do_not_specialize=["M", "programs"])
def matmul_kernel(a, a_desc, w, w_desc, out, out_desc, partials, counts, M, N, K, stride_am, stride_wk, stride_wn,
                  programs, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr, W_KMAJOR: tl.constexpr,
                  FLATTEN: tl.constexpr, STORE_TMA: tl.constexpr, SPLIT_TAIL: tl.constexpr,
                  MIN_PIECE: tl.constexpr):
    """out [M, N] = a [M, K] @ w [K, N] (a row-major, w any strides), the persistent tile loop of the
    fused kernels. TMA: a_desc over a in [BLOCK_M, BLOCK_K] boxes, w_desc over w in [BLOCK_K, BLOCK_N]
    boxes or, W_KMAJOR, over w.T [N, K] in [BLOCK_N, BLOCK_K] boxes (else both None). STORE_TMA: out
    stored through out_desc (``store_tile_tma``), else with pointers. SPLIT_TAIL: the loop runs the whole
    waves of tiles, one a program, and ``matmul_tail`` the rest in pieces of at least MIN_PIECE K steps
    (partials and counts are its buffers)."""
    tiles_m, tiles_n, tiles, _ = program_tiles(M, N, programs, BLOCK_M, BLOCK_N)
    whole = tiles - tiles % programs if SPLIT_TAIL else tiles
    for t in tl.range(tl.program_id(0), whole, programs, flatten=FLATTEN):
        pid_m, pid_n = tile_coords(t, tiles_m, tiles_n, GROUP_M)
        acc = gemm_tile(a, stride_am, a_desc, 0, w, stride_wk, stride_wn, w_desc, pid_m, pid_n, M, N, K, BLOCK_M,
                        BLOCK_N, BLOCK_K, EVEN_K, TMA, W_KMAJOR)
        store_tile(out, out_desc, pid_m, pid_n, acc, M, N, BLOCK_M, BLOCK_N, STORE_TMA)
    if SPLIT_TAIL:
        if whole < tiles:
            matmul_tail(a, a_desc, w, w_desc, out, out_desc, partials, counts, M, N, K, stride_am, stride_wk,
                        stride_wn, programs, tiles_m, tiles_n, whole, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EVEN_K,
                        TMA, W_KMAJOR, STORE_TMA, MIN_PIECE)


def describable(t: torch.Tensor) -> bool:
    """Whether TMA can address the 2-D t: non-empty, contiguous rows, start and row stride multiples
    of 16 bytes."""
    return t.stride(1) == 1 and t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 and t.numel() > 0


def descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A tensor descriptor of the 2-D t in boxes `block`; ValueError where TMA cannot address t
    (``describable``)."""
    if not describable(t):
        raise ValueError(f"a tensor descriptor needs a non-empty tensor with contiguous rows, 16-byte aligned "
                         f"in start and row stride: got {tuple(t.shape)} with strides {t.stride()}")
    return TensorDescriptor.from_tensor(t, block)


def weight_rows(w: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The view of w [K, N] a descriptor spans, with contiguous rows: w itself, or w.T [N, K] when w's
    columns are contiguous (nn.Linear's weight [N, K] seen through .t()); and whether it is w.T (W_KMAJOR)."""
    kmajor = w.stride(1) != 1
    return (w.t() if kmajor else w), kmajor


def loads_through_descriptors(variant: str, a: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a fused kernel whose tile loop is `variant` (of FUSED_VARIANTS) loads a [M, K] and w [K, N]
    through tensor descriptors: "tma", where TMA can address both (``describable``, w as ``weight_rows``).
    Pointers otherwise."""
    return variant != "pointer" and describable(a) and describable(weight_rows(w)[0])


def operand_descriptors(a: torch.Tensor, w: torch.Tensor, config: dict) -> dict:
    """The descriptor arguments of gemm_tile for a [*, K] and w [K, N] with config's tile shapes:
    a_desc, w_desc over ``weight_rows(w)``, and W_KMAJOR, whether that is w.T."""
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    rows, kmajor = weight_rows(w)
    w_desc = descriptor(rows, [bn, bk] if kmajor else [bk, bn])
    return dict(a_desc=descriptor(a, [bm, bk]), w_desc=w_desc, W_KMAJOR=kmajor)


def matmul(a: torch.Tensor, w: torch.Tensor, programs: int, config: dict | None = None,
           variant: str = DEFAULT_VARIANT) -> torch.Tensor:
    """a [M, K] (row-major) @ w [K, N] -> [M, N] in a's dtype, on `programs` programs, with
    ``tile_config``'s tile shapes for M rows (or `config`: another row count's, or ``fused_tile_config``'s),
    the tile loop of VARIANTS[variant]. The descriptor variants need 16-byte aligned rows (K and N
    multiples of 8 in bf16) and w with contiguous rows or columns."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {tuple(VARIANTS)}, got {variant!r}")
    options = VARIANTS[variant]
    (m, k), n = a.shape, w.shape[1]
    config = config or tile_config(m, n, a.element_size())
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if 0 in (m, n, k):
        return out.zero_()
    descriptors = operand_descriptors(a, w, config) if options["TMA"] else dict(a_desc=None, w_desc=None,
                                                                                W_KMAJOR=False)
    out_desc = descriptor(out, [config["BLOCK_M"], config["BLOCK_N"] // 2]) if options["STORE_TMA"] else None
    tiles = tile_count(m, n, config)
    options = dict(options, SPLIT_TAIL=options["SPLIT_TAIL"] and tiles % programs > 0)   # else the loop alone
    grid = programs if options["SPLIT_TAIL"] else min(programs, tiles)
    partials = counts = out                    # read only by a split tail
    if options["SPLIT_TAIL"]:
        partials = torch.empty((2 * grid, config["BLOCK_M"] * config["BLOCK_N"]), dtype=torch.float32,
                               device=a.device)
        counts = torch.zeros(tiles % grid, dtype=torch.int32, device=a.device)
    matmul_kernel[(grid,)](a=a, w=w, out=out, out_desc=out_desc, partials=partials, counts=counts, M=m, N=n, K=k,
                           stride_am=a.stride(0), stride_wk=w.stride(0), stride_wn=w.stride(1), programs=grid,
                           EVEN_K=k % config["BLOCK_K"] == 0, MIN_PIECE=MIN_SPLIT_BLOCKS, **descriptors,
                           **{**config, **options})
    return out


# ---------------------------------------------------------------------------------------------- small M

SMALL_M_ROWS = 256         # rows up to which matmul_small_m serves: at 512 rows, bench_gemm.py --small_m (H200, ca451b4),
                           # the tile loop's 128 x 256 tiles reach 0.91-0.97x cuBLAS, matmul_small_m 0.74-0.81x (where
                           # the tile loop has fewer tiles than SMs, N = 3584 at 512 rows, 0.52 against 0.86)
MIN_SPLIT_BLOCKS = 8       # BLOCK_K steps a K slice keeps at least: its pipeline (3-6 stages) fills in 2-5
SUM_BLOCK = 1024           # elements per program of sum_splits_kernel: 4 warps, 8 a thread


def small_tile(bm: int, bn: int, bk: int, warps: int, stages: int) -> dict:
    """A tile of SMALL_M_TILES: BLOCK_M x BLOCK_N x BLOCK_K (bf16 columns), its warps and pipeline stages."""
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)


# Tiles of the small-M GEMMs by rows: (most rows, candidates from the widest), BLOCK_K in bf16 columns (other
# dtypes keep its bytes). Up to SMALL_M_ROWS rows a GEMM is mostly a read of the weights, and a's rows come again
# from L2 for every column block: M / BLOCK_N times the weights' bytes, twice them at 128 x 64 tiles. So the widest
# tile pays while there are enough of them for the SMs to stream the weights; ``small_m_tile`` takes the first
# candidate with at least BUSY_SMS of the programs' worth of tiles, else the last (the most tiles). Measured on an
# H200 (132 SMs), the tile loop on every SM in CUDA graphs against cuBLAS, x cuBLAS (benchmarks/NOTES.md, "Wider
# tiles at decode sizes"), the chosen first:
# - 32 rows: 32 x 128 at N 14336 (112 tiles) 1.03, where 16 x 64 gave 0.67; 16 x 128 (two row blocks) at N 7168
#   (112 tiles) 1.00, where 32 x 128 (56 tiles) gave 0.87 and 16 x 64 0.70. Up to 16 rows one 16-row block.
# - 64 rows: 64 x 128 at N 14336 1.08 (64 x 64: 0.94); 64 x 64 at N 7168 0.98 (64 x 128, 56 tiles: 0.94).
# - 128 rows: 128 x 128 x 64 with 8 warps and 5 stages at N 14336 1.00, N 28672 (224 tiles, K 2048 / 4096)
#   0.96 / 1.01, where 128 x 64 gave 0.86 and 0.84 / 0.87; 128 x 64 at N 7168 0.91 (128 x 128, 56 tiles: 0.73).
# - more rows: 128 x 256 x 64 with 4 stages at N 14336 / 28672, 256 rows, 0.99 / 0.96 (3 stages: 0.94 / 0.93; 128
#   x 128 x 128: 0.81 / 0.84), 512 rows, N 14336 0.99 (3 stages 0.98); 128 x 128 x 64 at N 7168 0.90 (128 x 256, 56
#   tiles: 0.55) and, by the waves (below), at 512 rows and N 28672 0.89 (128 x 256: 0.81).
SMALL_M_TILES = (
    (16, (small_tile(16, 128, 128, 4, 6), small_tile(16, 64, 128, 4, 6))),
    (32, (small_tile(32, 128, 128, 4, 4), small_tile(16, 128, 128, 4, 6), small_tile(16, 64, 128, 4, 6))),
    (64, (small_tile(64, 128, 128, 4, 4), small_tile(64, 64, 128, 4, 4))),
    (128, (small_tile(128, 128, 64, 8, 5), small_tile(128, 64, 128, 4, 4))),
    (None, (small_tile(128, 256, 64, 8, 4), small_tile(128, 128, 64, 8, 5))),
)
# Every distinct candidate (what the compile tests build, what the TP buffers' smallest tile is taken over).
SMALL_M_CANDIDATES = tuple({tuple(t.items()): t for _, tiles in SMALL_M_TILES for t in tiles}.values())
BUSY_SMS = 0.75     # of the programs: a tile count below leaves SMs without weights to stream (56 of 132: 0.55-0.94x)
FLOP_ROWS = 128     # rows beyond which a GEMM's FLOPs bound it more than its weights' bytes (2 FLOPs a row for
                    # each weight of 2 bytes: an H200's 989 TFLOP/s over its 4.8 TB/s meet at about 200 rows), so that
                    # how well the tiles fill the last wave counts; below, the wider tiles win even where narrower ones
                    # fill it better (32 rows, N 28672: 32 x 128 tiles 0.98x cuBLAS, 16 x 64 0.76)
WAVE_SLACK = 1.1    # beyond FLOP_ROWS a narrower candidate is taken where it fills the programs' waves this much better:
                    # at 512 rows, N 28672, 448 tiles of 128 x 256 fill 4 waves of 132 to 85%, 896 of 128 x 128 fill 7
                    # to 97%, and the narrower ran 1.09x faster; where the fills are equal the wider ran 3-12% faster
FUSED_SMALL_M_ROWS = 512    # rows up to which the fused kernels take small_m_tile's tiles (tile_config's beyond)


def wave_fill(tiles: int, programs: int) -> float:
    """The share of `programs` programs' time a persistent loop over `tiles` equal tiles keeps busy."""
    return tiles / (cdiv(tiles, programs) * programs)


def small_m_tile(rows: int, n: int, element_size: int, programs: int, shards: int = 1) -> dict:
    """SMALL_M_TILES' tile and launch options for `shards` shards of `rows` x `n` outputs on `programs`
    programs. Of the candidates for the rows with at least BUSY_SMS * programs tiles (or else the narrowest), the
    widest; beyond FLOP_ROWS rows, the widest whose tiles fill the programs' waves (``wave_fill``) within
    WAVE_SLACK of the best of them."""
    candidates = next(tiles for most, tiles in SMALL_M_TILES if most is None or rows <= most)
    busy = [t for t in candidates if tile_count(rows, n, t, shards) >= BUSY_SMS * programs] or [candidates[-1]]
    tile = busy[0]
    if rows > FLOP_ROWS:
        fill = [wave_fill(tile_count(rows, n, t, shards), programs) for t in busy]
        tile = next(t for t, f in zip(busy, fill) if f * WAVE_SLACK >= max(fill))
    return dict(tile, BLOCK_K=tile["BLOCK_K"] * 2 // element_size)


def fused_tile_config(rows: int, n: int, element_size: int, programs: int, shards: int = 1) -> dict:
    """The tiles of a fused kernel (ag_gemm, gemm_rs, gemm_ar) for `shards` shards of `rows` x `n` outputs
    (ag_gemm's and gemm_rs' per-rank tiles: one a rank) on `programs` programs: in 2-byte dtypes up to
    FUSED_SMALL_M_ROWS rows, ``small_m_tile``'s, else ``tile_config``'s. The fused kernels walk all of K, so never
    a split. Depends on the sizes and the program count only, the same on every rank."""
    if rows > FUSED_SMALL_M_ROWS or element_size != 2:
        return tile_config(rows, n, element_size)
    return dict(small_m_tile(rows, n, element_size, programs, shards), GROUP_M=GROUP_M)


@triton.jit(do_not_specialize=["M", "blocks_per_split"])
def matmul_split_k_kernel(a, a_desc, w, w_desc, partials, M, N, K, stride_am, stride_wk, stride_wn, blocks_per_split,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                          TMA: tl.constexpr, W_KMAJOR: tl.constexpr):
    """partials[s] [M, N] = a[:, K_s] @ w[K_s, :], K_s the K blocks [s * blocks_per_split, (s + 1) *
    blocks_per_split) of split s; a [M, K] row-major, w [K, N] any strides (TMA: loaded through a_desc and
    w_desc, ``operand_descriptors``). partials [splits, M, N] is fp32 where sum_splits_kernel sums the
    splits, or out itself in its dtype where there is one split.

    Grid (tiles_m, splits, tiles_n), one tile of one split a program: the row blocks of one weight slice
    are launched next to each other, so the slice comes from HBM once and from L2 for the others."""
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    pid_n = tl.program_id(2)
    k_first = split * blocks_per_split
    k_last = tl.minimum(k_first + blocks_per_split, tl.cdiv(K, BLOCK_K))
    acc = gemm_slice(a, stride_am, a_desc, 0, w, stride_wk, stride_wn, w_desc, pid_m, pid_n, M, N, K, k_first, k_last,
                     BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, TMA, W_KMAJOR)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    slab = partials + split.to(tl.int64) * M * N          # 64 bits once, 32-bit offsets inside the [M, N] slab
    tl.store(slab + offs_m[:, None] * N + offs_n[None, :], acc.to(partials.dtype.element_ty),
             mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@triton.jit(do_not_specialize=["numel", "splits"])
def sum_splits_kernel(partials, out, numel, splits, BLOCK: tl.constexpr):
    """out [numel] = partials[0] + partials[1] + ... + partials[splits - 1], fp32 partials [splits, numel]
    summed in that order (the same bits on every call), rounded once to out's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    total = tl.load(partials + offs, mask=mask, other=0.0)
    for s in range(1, splits):
        total += tl.load(partials + s * numel + offs, mask=mask, other=0.0)
    tl.store(out + offs, total.to(out.dtype.element_ty), mask=mask)


def small_m_config(m: int, n: int, k: int, element_size: int, sms: int) -> dict:
    """Tile shapes, launch options and `splits` (K slices) of matmul_small_m for a [m, k] @ [k, n] with
    `element_size`-byte operands on a GPU of `sms` SMs.

    The tile is ``small_m_tile``'s for m rows on sms programs. Then the split rule: with tiles = cdiv(m, BLOCK_M)
    * cdiv(n, BLOCK_N) and blocks = cdiv(k, BLOCK_K),
        splits = max(1, min(sms // tiles, blocks // MIN_SPLIT_BLOCKS))
    slices of equal whole BLOCK_K steps (the last one shorter): as many as still fit one program an SM,
    each long enough to keep its pipeline full. A split costs splits * m * n fp32 written and read back and
    a second launch (on an H200, 60 -> 75 us at m = 256, n = 7168, k = 8192 in 2 slices), which only more SMs
    at work repay: at n = 3584 (tensor parallelism 8 of 28672) and 128 rows, 56 tiles, 2 slices ran at 0.85x
    cuBLAS, one at 0.72x; where small_m_tile finds BUSY_SMS of the SMs' worth of tiles, one slice."""
    tiles = small_m_tile(m, n, element_size, sms)
    count = tile_count(m, n, tiles)
    blocks = cdiv(k, tiles["BLOCK_K"])
    return dict(tiles, splits=max(1, min(sms // max(count, 1), blocks // MIN_SPLIT_BLOCKS)))


def matmul_small_m(a: torch.Tensor, w: torch.Tensor, sms: int, config: dict | None = None,
                   variant: str = DEFAULT_VARIANT) -> torch.Tensor:
    """a [M, K] (row-major) @ w [K, N] (any strides) -> a new [M, N] tensor in a's dtype, the GEMM for M up to
    SMALL_M_ROWS: the widest tiles that still give most SMs one, K split where even the narrowest are too few
    (``small_m_config`` for a GPU of `sms` SMs, or `config`, one of its results), operands loaded as
    VARIANTS[variant] does (one of FUSED_VARIANTS: there is no tile loop to flatten; "tma" needs what
    `matmul`'s does, 16-byte aligned rows and w with contiguous rows or columns, and raises ValueError
    otherwise). The K slices' fp32 partial sums [splits, M, N] are added in slice order by a second kernel
    (sum_splits_kernel) and rounded once, so the result depends on the operands and the config alone; one
    slice stores its tiles straight into the result."""
    if variant not in FUSED_VARIANTS:
        raise ValueError(f"variant must be one of {FUSED_VARIANTS}, got {variant!r}")
    (m, k), n = a.shape, w.shape[1]
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if 0 in (m, n, k):
        return out.zero_()
    config = dict(config or small_m_config(m, n, k, a.element_size(), sms))
    splits = config.pop("splits")
    blocks = cdiv(k, config["BLOCK_K"])
    blocks_per_split = cdiv(blocks, splits)
    splits = cdiv(blocks, blocks_per_split)    # no empty slice when `splits` does not divide the blocks
    partials = out if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=a.device)
    descriptors = (operand_descriptors(a, w, config) if VARIANTS[variant]["TMA"]
                   else dict(a_desc=None, w_desc=None, W_KMAJOR=False))
    grid = (cdiv(m, config["BLOCK_M"]), splits, cdiv(n, config["BLOCK_N"]))
    matmul_split_k_kernel[grid](a=a, w=w, partials=partials, M=m, N=n, K=k, stride_am=a.stride(0),
                                stride_wk=w.stride(0), stride_wn=w.stride(1), blocks_per_split=blocks_per_split,
                                EVEN_K=k % config["BLOCK_K"] == 0, TMA=VARIANTS[variant]["TMA"], **descriptors,
                                **config)
    if splits > 1:
        sum_splits_kernel[(cdiv(m * n, SUM_BLOCK),)](partials=partials, out=out, numel=m * n, splits=splits,
                                                     BLOCK=SUM_BLOCK, num_warps=4)
    return out


@triton.jit
def sum_peer_tiles(total, partials, slab, offsets, mask, flags, tiles, t, rank, world, timeout_ns, status,
                   state, failed, TAG: tl.constexpr, WITH_OWN: tl.constexpr):
    """total [BLOCK_M, BLOCK_N] fp32 + the same tile of every rank's slot of `partials`, in rank order,
    each peer's once its flag has landed; the own slot too when WITH_OWN (it is in `partials` then).

    partials [world, slab] (this rank's symmetric copy; `offsets`/`mask` pick the tile in a slab);
    flags [world, tiles] int64, flag (src, t) is 1 once rank src's tile t has landed. `failed` is 1
    once a wait of this program has timed out: later waits are skipped, as the status already holds
    the error. Returns (total, failed). Used by GEMM reduce-scatter and GEMM all-reduce."""
    for src in range(0, world):
        if src != rank:
            if failed == 0:
                landed = wait_until_ge(flags + src * tiles + t, 1, timeout_ns, status, src, TAG, state)
                failed = tl.where(landed, 0, 1)
        if WITH_OWN or src != rank:
            total += tl.load(partials + src * slab + offsets, mask=mask, other=0.0).to(tl.float32)
    return total, failed
