"""The async-TP kernels, all ranks in one process, in the Triton interpreter (CPU).

Each simulated rank is an AsyncTP whose "symmetric" buffers are plain CPU tensors; its peer
views are the other ranks' tensors. A call is run in phases across the ranks, in an order that
never leaves a wait spinning: the flag resets (what each call's barrier kernel does on the GPU),
then every rank's pushes (all-gather) or sends (reduce-scatter), then every rank's GEMM or own tiles
(reductions); the all-reduce's pipeline one step at a time on every rank, so that a step waiting for
what a peer sends at that step or later times out here. Both overlapped paths run: "fused" (the
persistent Triton GEMMs, with each tile loop of FUSED_VARIANTS: pointer loads and tensor descriptors)
and "chunked" (one GEMM per shard, the bounded wait kernel and the reduction kernel between them).
Results are compared with torch in float64; the kernels sum in fp32.
"""
import os

import pytest
import torch

from moe_ep import AsyncTP, CommTimeoutError
from moe_ep.kernels.matmul import FUSED_VARIANTS, SMALL_M_CANDIDATES, fused_tile_config
from sm90 import run_without_interpreter

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs the kernels in the Triton interpreter, on CPU-only machines")


def simulated_group(world, max_rows, max_features, dtype, timeout_s=5.0, tile_loop="pointer"):
    return AsyncTP.simulated(world, max_rows, max_features, dtype, overlap="fused", timeout_s=timeout_s,
                             tile_loop=tile_loop, programs=3)


def ag_gemm_on(tp, path):
    """The all-gather GEMM of `path` alone, after the pushes: the fused kernel's, or the chunked GEMMs'."""
    if path == "fused":
        return tp.launches.ag_gemm

    def chunked(a_shard, w):
        out = tp.copies.ag_gemm_own(a_shard, w)
        tp.copies.ag_gemm_peers(a_shard, w, out)
        return out
    return chunked


def weights(world, k, n, dtype, transposed, seed):
    """Every rank's w [K, N]: contiguous, or an nn.Linear-style [N, K] weight seen through .t()."""
    g = torch.Generator().manual_seed(seed)
    if transposed:
        return [torch.randn(n, k, generator=g).to(dtype).t() for _ in range(world)]
    return [torch.randn(k, n, generator=g).to(dtype) for _ in range(world)]


# world, rows per rank, K, N, dtype, w transposed
AG_CASES = [
    (2, 150, 64, 300, torch.float32, False),    # two row tiles, three column tiles, K a multiple of BLOCK_K
    (3, 70, 40, 130, torch.float32, True),      # K not a multiple of BLOCK_K, w through .t()
    (2, 1, 48, 20, torch.float32, False),       # one row per rank
    (2, 33, 64, 96, torch.float16, True),       # (the interpreter computes bf16 dots wrongly; fp16 stands in)
]


# the overlapped paths, and the fused one with each tile loop
PATHS = [("fused", loop) for loop in FUSED_VARIANTS] + [("chunked", "pointer")]


@pytest.mark.parametrize("path,tile_loop", PATHS)
@pytest.mark.parametrize("case", range(len(AG_CASES)))
def test_all_gather_gemm(case, path, tile_loop):
    world, rows, k, n, dtype, transposed = AG_CASES[case]
    ranks = simulated_group(world, world * rows, max(k, n), dtype, tile_loop=tile_loop)
    for call in range(2):                                     # buffers and flags reused by a second call
        g = torch.Generator().manual_seed(call)
        shards = [torch.randn(rows, k, generator=g).to(dtype) for _ in range(world)]
        ws = weights(world, k, n, dtype, transposed, seed=10 + call)
        for tp in ranks:
            tp.buffers.shard_flags.zero_()
        for r, tp in enumerate(ranks):
            tp.copies.push_shard(shards[r], own_copy=True)
        outs = [ag_gemm_on(tp, path)(shards[r], ws[r]) for r, tp in enumerate(ranks)]
        full = torch.cat(shards).double()
        for r, tp in enumerate(ranks):
            assert torch.equal(tp.buffers.gathered[:world * rows * k].view(-1, k), torch.cat(shards))
            tol = 1e-4 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(outs[r].double(), full @ ws[r].double(), rtol=tol, atol=tol)
            assert tp.buffers.shard_flags.tolist() == [int(s != r) for s in range(world)]
            assert not tp._status.any()


RS_CASES = [
    (2, 150, 64, 300, torch.float32, False),
    (3, 70, 40, 130, torch.float32, True),
    (2, 1, 48, 20, torch.float32, False),
    (2, 33, 64, 96, torch.float16, True),       # (the interpreter computes bf16 dots wrongly; fp16 stands in)
]


def run_gemm_rs(ranks, a, ws, path):
    """The GEMM reduce-scatter of `path` on every rank: the fused kernel over all M rows (where its tiles are
    taller than a rank's rows) one pipeline step at a time on every rank, or the per-rank-rows kernel (fused)
    and the chunked path's sends then every rank's own rows."""
    world, (m, _), n = len(ranks), a[0].shape, ws[0].shape[1]
    launches = ranks[0].launches
    all_rows = launches.rs_rows(m, n, a[0].element_size())
    config = fused_tile_config(m // world, n, a[0].element_size(), launches.programs, world)
    outs = [torch.empty((m // world, n), dtype=a[0].dtype) for _ in ranks]
    if path == "fused" and all_rows is not None:      # its barrier in the kernel: no reset
        for step in range(launches.steps(launches.all_rows_tiles(m, n, all_rows), 2)):
            for r, tp in enumerate(ranks):
                tp.launches.gemm_rs_rows(a[r], ws[r], outs[r], all_rows, step, step + 1)
        return outs
    for tp in ranks:
        tp.buffers.tile_flags.zero_()
    for r, tp in enumerate(ranks):                       # every partial bound for a peer
        if path == "fused":
            tp.launches.gemm_rs(a[r], ws[r], outs[r], config, 0, world - 1)
        else:
            tp.copies.rs_send(a[r], ws[r])
    for r, tp in enumerate(ranks):                       # then the own rows, which wait for the peers'
        if path == "fused":
            tp.launches.gemm_rs(a[r], ws[r], outs[r], config, world - 1, world)
        else:
            tp.copies.rs_reduce(a[r], ws[r], outs[r])
    return outs


@pytest.mark.parametrize("path,tile_loop", PATHS)
@pytest.mark.parametrize("case", range(len(RS_CASES)))
def test_gemm_reduce_scatter(case, path, tile_loop):
    world, rows, k, n, dtype, transposed = RS_CASES[case]
    m = world * rows
    ranks = simulated_group(world, m, n, dtype, tile_loop=tile_loop)
    for call in range(2):
        g = torch.Generator().manual_seed(call)
        a = [torch.randn(m, k, generator=g).to(dtype) for _ in range(world)]
        ws = weights(world, k, n, dtype, transposed, seed=20 + call)
        outs = run_gemm_rs(ranks, a, ws, path)
        # the partials in the operands' dtype, summed in fp32 (tolerance: the kernel adds its own first)
        partials = [(a[r].double() @ ws[r].double()).to(dtype).float() for r in range(world)]
        total = sum(partials[1:], partials[0])
        for r, tp in enumerate(ranks):
            tol = 1e-4 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(outs[r].double(), total[r * rows:(r + 1) * rows].double(), rtol=tol, atol=tol)
            assert not tp._status.any()


@pytest.mark.parametrize("path", ["fused", "chunked"])
def test_a_shard_that_never_lands_times_out_naming_rank_and_peer(path):
    ranks = simulated_group(2, 8, 16, torch.float32, timeout_s=0.2)
    shards = [torch.randn(4, 16) for _ in ranks]
    w = torch.randn(16, 8)
    for tp in ranks:
        tp.buffers.shard_flags.zero_()
    ranks[0].copies.push_shard(shards[0], own_copy=False)             # rank 1 never pushes
    ag_gemm_on(ranks[0], path)(shards[0], w)
    with pytest.raises(CommTimeoutError, match=r"rank 0: all-gather GEMM .* waiting for rank 1"):
        ranks[0].check()
    with pytest.raises(CommTimeoutError):                     # the object stays unusable
        ranks[0].ag_gemm(shards[0], w)
    ag_gemm_on(ranks[1], path)(shards[1], w)           # rank 0's shard did land: no timeout
    ranks[1].check()


def test_partials_that_never_land_time_out():
    ranks = simulated_group(2, 8, 16, torch.float32, timeout_s=0.2)
    a, w = torch.randn(8, 16), torch.randn(16, 8)
    ranks[0].buffers.tile_flags.zero_()
    ranks[0].copies.rs_reduce(a, w, torch.empty(4, 8))      # rank 1 never sent its partials
    with pytest.raises(CommTimeoutError, match=r"rank 0: GEMM reduce-scatter .* waiting for rank 1"):
        ranks[0].check()


def test_rows_that_never_land_time_out():
    """The reduce-scatter over all M rows (a tile taller than a rank's rows): rank 1 begins the call (its
    barrier's arrival, step 0) but never sends its rows of the tiles, and rank 0's sum of its own rows times
    out naming rank 1."""
    ranks = simulated_group(2, 8, 16, torch.float32, timeout_s=0.2)
    a, w = torch.randn(8, 16), torch.randn(16, 8)
    config = ranks[0].launches.rs_rows(8, 8, 4)
    assert config is not None
    ranks[1].launches.gemm_rs_rows(a, w, torch.empty(4, 8), config, 0, 1)
    ranks[0].launches.gemm_rs_rows(a, w, torch.empty(4, 8), config)
    with pytest.raises(CommTimeoutError, match=r"rank 0: GEMM reduce-scatter .* waiting for rank 1"):
        ranks[0].check()


def run_gemm_ar(ranks, a, ws):
    """The fused GEMM all-reduce of every rank in `ranks` (a, ws: theirs, in order), its pipeline run step by
    step: each step on every rank before the next, so a wait for what a peer sends at a later step times out."""
    m, n = a[0].shape[0], ws[0].shape[1]
    launches = ranks[0].launches
    config = fused_tile_config(m, n, a[0].element_size(), launches.programs)
    outs = [torch.empty((m, n), dtype=a[0].dtype) for _ in ranks]
    for step in range(launches.steps(launches.all_rows_tiles(m, n, config), 3)):
        for r, tp in enumerate(ranks):
            tp.launches.gemm_ar(a[r], ws[r], outs[r], config, step, step + 1)
    return outs


# world, M (all rows, on every rank), K, N, dtype, w transposed
AR_CASES = [
    (2, 150, 64, 300, torch.float32, False),
    (3, 70, 40, 130, torch.float32, True),
    (2, 1, 48, 20, torch.float32, False),       # one token
    (2, 33, 64, 96, torch.float16, True),       # (the interpreter computes bf16 dots wrongly; fp16 stands in)
]


@pytest.mark.parametrize("tile_loop", FUSED_VARIANTS)
@pytest.mark.parametrize("case", range(len(AR_CASES)))
def test_gemm_all_reduce(case, tile_loop):
    world, m, k, n, dtype, transposed = AR_CASES[case]
    ranks = simulated_group(world, world * m, n, dtype, tile_loop=tile_loop)   # "fused" takes M <= max_rows / W
    for call in range(2):
        g = torch.Generator().manual_seed(call)
        a = [torch.randn(m, k, generator=g).to(dtype) for _ in range(world)]
        ws = weights(world, k, n, dtype, transposed, seed=30 + call)
        outs = run_gemm_ar(ranks, a, ws)
        partials = [(a[r].double() @ ws[r].double()).to(dtype).float() for r in range(world)]
        total = sum(partials[1:], partials[0])
        tol = 1e-4 if dtype == torch.float32 else 1e-2
        for r, tp in enumerate(ranks):
            torch.testing.assert_close(outs[r].double(), total.double(), rtol=tol, atol=tol)
            assert torch.equal(outs[r], outs[0]), "every rank holds the same sum, bit for bit"
            assert not tp._status.any()


def test_all_reduce_partials_that_never_land_time_out():
    ranks = simulated_group(2, 8, 16, torch.float32, timeout_s=0.2)
    a, w = torch.randn(4, 16), torch.randn(16, 8)
    config = fused_tile_config(4, 8, 4, ranks[0].launches.programs)
    ranks[1].launches.gemm_ar(a, w, torch.empty(4, 8), config, 0, 1)   # rank 1 begins the call, then idles
    ranks[0].launches.gemm_ar(a, w, torch.empty(4, 8), config)
    with pytest.raises(CommTimeoutError, match=r"rank 0: GEMM all-reduce .* waiting for rank 1"):
        ranks[0].check()


def test_a_sum_that_times_out_is_not_sent():
    """Three ranks, one tile, owned by rank 0; rank 2 begins the call (its barrier's arrival) and does no
    more. Rank 0's sum times out naming rank 2 and sends nothing, so rank 1, waiting for that sum, times out
    too (naming rank 0) rather than copy a sum that lacks rank 2's partial."""
    ranks = simulated_group(3, 12, 16, torch.float32, timeout_s=0.2)
    a, w = torch.randn(4, 16), torch.randn(16, 8)
    config = fused_tile_config(4, 8, 4, ranks[2].launches.programs)
    ranks[2].launches.gemm_ar(a, w, torch.empty(4, 8), config, 0, 1)   # its arrival only
    run_gemm_ar(ranks[:2], [a, a], [w, w])
    with pytest.raises(CommTimeoutError, match=r"rank 0: GEMM all-reduce \(waiting for a peer's partials\) .* "
                                               r"waiting for rank 2"):
        ranks[0].check()
    with pytest.raises(CommTimeoutError, match=r"rank 1: GEMM all-reduce \(waiting for a tile's sum from the rank "
                                               r"that owns it\) .* waiting for rank 0"):
        ranks[1].check()


def test_the_barrier_waits_for_every_rank_to_begin_the_call():
    """Each overlapped call's barrier (the reset kernel) holds a rank until every rank has begun the call,
    for at most timeout_s: rank 0, alone at it, times out naming rank 1; rank 1, second, passes at once."""
    ranks = simulated_group(2, 8, 16, torch.float32, timeout_s=0.2)
    for tp in ranks:
        tp.buffers.shard_flags.fill_(1)
    ranks[0].launches.reset("shard_flags", 2)
    with pytest.raises(CommTimeoutError, match=r"^rank 0: async-TP call's barrier \(waiting for a peer to begin the "
                                               r"call\) timed out after 0.2s waiting for rank 1 \(signal count 0, "
                                               r"expected 1\)$"):
        ranks[0].check()
    ranks[1].launches.reset("shard_flags", 2)
    ranks[1].check()
    for tp in ranks:                                   # every rank's flags zeroed, every call counted on both
        assert tp.buffers.shard_flags.tolist() == [0, 0] and tp.buffers.arrivals.tolist() == [1, 1]


def test_pipelined_and_reset_calls_of_several_shapes_in_turn():
    """One group makes calls of different kernels and shapes in turn on the same flags and partials, the
    pipelined ones (their barrier inside, grids of other sizes) between those the reset kernel begins: each
    call's result is right, and every program's calls are counted alike on both ranks."""
    world = 2
    ranks = simulated_group(world, 300, 300, torch.float32)
    g = torch.Generator().manual_seed(5)
    for op, m, k, n in (("gemm_ar", 8, 48, 40), ("gemm_rs", 8, 32, 300), ("gemm_rs", 300, 64, 300),
                        ("gemm_ar", 70, 40, 130), ("gemm_rs", 6, 16, 20)):
        a = [torch.randn(m, k, generator=g) for _ in range(world)]
        ws = [torch.randn(k, n, generator=g) for _ in range(world)]
        outs = run_gemm_ar(ranks, a, ws) if op == "gemm_ar" else run_gemm_rs(ranks, a, ws, "fused")
        total = sum(a[r].double() @ ws[r].double() for r in range(world))
        for r, tp in enumerate(ranks):
            expected = total if op == "gemm_ar" else total[r * m // world:(r + 1) * m // world]
            torch.testing.assert_close(outs[r].double(), expected, rtol=1e-4, atol=1e-4)
            assert not tp._status.any()
    assert torch.equal(ranks[0].buffers.program_arrivals, ranks[1].buffers.program_arrivals)
    assert ranks[0].buffers.program_arrivals.sum() > 0


def pipelined_8x8(tp, op):
    """The tile config and a new output of the pipelined kernel `op` ("gemm_ar" or "gemm_rs_rows") for
    [8, 16] @ [16, 8] in fp32 on a group of two."""
    if op == "gemm_rs_rows":
        return tp.launches.rs_rows(8, 8, 4), torch.empty(4, 8)
    return fused_tile_config(8, 8, 4, tp.launches.programs), torch.empty(8, 8)


@pytest.mark.parametrize("op", ["gemm_ar", "gemm_rs_rows"])
def test_a_pipelined_kernel_s_barrier_waits_for_every_rank(op):
    """The pipelined kernels' barrier, per program inside the kernel: rank 0 alone times out in it naming
    rank 1 and sends nothing into rank 1's buffers; rank 1's call, made late, passes the barrier (rank 0 had
    arrived) and times out waiting for what rank 0 never sent; every program's call is counted once on both."""
    ranks = simulated_group(2, 8, 16, torch.float32, timeout_s=0.2)
    a, w = torch.randn(8, 16), torch.randn(16, 8)
    config, out = pipelined_8x8(ranks[0], op)
    getattr(ranks[0].launches, op)(a, w, out, config)
    with pytest.raises(CommTimeoutError, match=r"^rank 0: async-TP call's barrier \(waiting for a peer to begin the "
                                               r"call\) timed out after 0.2s waiting for rank 1"):
        ranks[0].check()
    assert not ranks[1].buffers.tile_flags.any() and not ranks[1].buffers.partials.any()
    getattr(ranks[1].launches, op)(a, w, out, config)
    with pytest.raises(CommTimeoutError, match=r"^rank 1: GEMM .* waiting for rank 0"):
        ranks[1].check()
    programs = ranks[0].launches.grid(ranks[0].launches.all_rows_tiles(8, 8, config))
    for tp in ranks:
        assert tp.buffers.program_arrivals[:2 * programs].tolist() == [1] * (2 * programs)


@pytest.mark.parametrize("op", ["gemm_ar", "gemm_rs_rows"])
def test_a_pipelined_kernel_zeroes_its_flags_before_its_barrier(op):
    """Flags left raised by an earlier call do not count for this one: both ranks begin the call (step 0:
    the flags zeroed, the barrier's arrival), then rank 1 runs on alone and times out waiting for rank 0,
    which sent nothing, instead of summing what the stale flags announce."""
    ranks = simulated_group(2, 8, 16, torch.float32, timeout_s=0.2)
    a, w = torch.randn(8, 16), torch.randn(16, 8)
    config, out = pipelined_8x8(ranks[0], op)
    for tp in ranks:
        tp.buffers.tile_flags.fill_(1)
        getattr(tp.launches, op)(a, w, out, config, 0, 1)
    getattr(ranks[1].launches, op)(a, w, out, config, 1)
    with pytest.raises(CommTimeoutError, match=r"^rank 1: GEMM .* waiting for rank 0"):
        ranks[1].check()


def test_tile_loop_must_be_one_the_fused_kernels_run():
    with pytest.raises(ValueError, match="tile_loop must be one of"):
        simulated_group(2, 8, 16, torch.float32, tile_loop="tma_flat")   # matmul's alone: its loop has no waits


COMPILE_PIPELINED = r"""
import re
from moe_ep.kernels.gemm_ar import gemm_ar_kernel
from moe_ep.kernels.gemm_rs import gemm_rs_rows_kernel
from moe_ep.kernels.matmul import fused_tile_config
from sm90 import compile_for_sm90

aligned = ("a", "w", "out", "partials", "partial_peers", "flags", "flag_peers", "arrivals", "arrival_peers", "state",
           "N", "K", "stride_am", "stride_wn")          # what a call with weight.t() of a layer passes
for rows in (128, 1024):                       # small_m_tile's (512 rows take them too), tile_config's
    config = fused_tile_config(rows, 28672, 2, 132)
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    for tma in (False, True):
        descriptors = (dict(a_desc=f"tensordesc<bf16[{bm}, {bk}]>", w_desc=f"tensordesc<bf16[{bn}, {bk}]>") if tma
                       else {})
        types = dict(a="*bf16", w="*bf16", out="*bf16", partials="*bf16", partial_peers="*i64", flags="*i64",
                     flag_peers="*i64", arrivals="*i64", arrival_peers="*i64", state="*i64", status_addr="i64",
                     timeout_ns="i64", **descriptors)
        constants = dict(EVEN_K=True, TMA=tma, W_KMAJOR=True, WORLD_PAD=4, stride_wk=1,
                         **{k: v for k, v in config.items() if k not in ("num_warps", "num_stages")},
                         **({} if tma else dict(a_desc=None, w_desc=None)))
        for kernel in (gemm_ar_kernel, gemm_rs_rows_kernel):
            compiled = compile_for_sm90(kernel, types, constants, aligned, num_warps=config["num_warps"],
                                        num_stages=config["num_stages"])
            stores = sorted(set(re.findall(r"st\.global\.[a-z0-9.]+", compiled.asm["ptx"])))
            print(kernel.fn.__name__, rows, "tma" if tma else "pointer", *stores)
"""


def test_pipelined_kernels_compile_for_sm90():
    """gemm_ar_kernel and gemm_rs_rows_kernel compile to cubins for sm_90 (Triton's PTX and ptxas, outside the
    interpreter) with both tile shapes and both ways of loading, and store their tiles 16 bytes at a time,
    through the peers' addresses too (``shmem.peer_address``): the only narrower stores are the 4-byte words
    of a timeout report and the 8-byte zeros of the barrier's flags."""
    lines = run_without_interpreter(COMPILE_PIPELINED, timeout=900).splitlines()
    assert lines == [f"{name} {rows} {loop} st.global.b32 st.global.b64 st.global.v4.b32" for rows in (128, 1024)
                     for loop in ("pointer", "tma") for name in ("gemm_ar_kernel", "gemm_rs_rows_kernel")]


COMPILE_FUSED_TILES = r"""
from moe_ep.kernels.ag_gemm import ag_gemm_kernel
from moe_ep.kernels.gemm_ar import gemm_ar_kernel
from moe_ep.kernels.gemm_rs import gemm_rs_kernel, gemm_rs_rows_kernel
from moe_ep.kernels.matmul import GROUP_M, SMALL_M_CANDIDATES
from sm90 import compile_for_sm90

for tile in SMALL_M_CANDIDATES:
    bm, bn, bk = tile["BLOCK_M"], tile["BLOCK_N"], tile["BLOCK_K"]
    types = dict(a="*bf16", a_local="*bf16", gathered="*bf16", w="*bf16", out="*bf16", partials="*bf16",
                 partial_peers="*i64", flags="*i64", flag_peers="*i64", arrivals="*i64", arrival_peers="*i64",
                 state="*i64", status_addr="i64", timeout_ns="i64", a_desc=f"tensordesc<bf16[{bm}, {bk}]>",
                 gathered_desc=f"tensordesc<bf16[{bm}, {bk}]>", w_desc=f"tensordesc<bf16[{bn}, {bk}]>")
    constants = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=GROUP_M, EVEN_K=True, TMA=True, W_KMAJOR=True,
                     WORLD_PAD=4)
    for kernel in (ag_gemm_kernel, gemm_rs_kernel, gemm_rs_rows_kernel, gemm_ar_kernel):
        names = {p.name for p in kernel.params}
        compiled = compile_for_sm90(kernel, types, {k: v for k, v in constants.items() if k in names},
                                    num_warps=tile["num_warps"], num_stages=tile["num_stages"])
        print(kernel.fn.__name__, bm, bn, bk, compiled.metadata.shared)
"""
SM90_SHARED_BYTES = 232448     # what a block may take on an H100 / H200 (227 KB)


def test_fused_kernels_fit_every_small_m_tile_on_sm90():
    """Every fused kernel with every tile small_m_tile may hand it (TMA loads) compiles for sm_90 within a
    block's shared memory: a tile that does not fit fails only at launch, on a GPU."""
    lines = [line.split() for line in run_without_interpreter(COMPILE_FUSED_TILES, timeout=600).splitlines()]
    assert len(lines) == 4 * len(SMALL_M_CANDIDATES), lines
    assert all(0 < int(line[-1]) <= SM90_SHARED_BYTES for line in lines), lines
