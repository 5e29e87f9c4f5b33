"""The async-TP tile loop alone (``moe_ep.kernels.matmul``), every variant against torch: in the
Triton interpreter on CPU, compiled on a GPU (one is enough). Sums are fp32; the reference is
float64 (fp32 and fp16 cases) or fp32 (bf16 on the GPU, where the interpreter's bf16 dot is not usable).

The small-M path (``matmul_small_m``) in bf16 everywhere: in the interpreter through ``bf16_dots``, against
fp32 sums of the same bf16 operands, within a bound derived from K and bf16's rounding (``bf16_bound``).
"""
import numpy as np
import pytest
import torch
import triton.language as tl
from triton.runtime import interpreter

from moe_ep.kernels.matmul import (BUSY_SMS, FLOP_ROWS, FUSED_SMALL_M_ROWS, FUSED_VARIANTS, MIN_SPLIT_BLOCKS,
                                   SMALL_M_CANDIDATES, SMALL_M_ROWS, SMALL_M_TILES, VARIANTS, WAVE_SLACK,
                                   fused_tile_config, loads_through_descriptors, matmul, matmul_small_m, small_m_config,
                                   small_m_tile, tile_config)
from moe_ep.tp.config import MIN_TILE
from sm90 import run_without_interpreter

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROGRAMS = torch.cuda.get_device_properties(0).multi_processor_count if DEVICE == "cuda" else 3
on_gpu = pytest.mark.skipif(DEVICE == "cpu", reason="bfloat16 dots and large shapes: compiled, on a GPU")


def operands(m, k, n, dtype, transposed, seed):
    """a [M, K]; w [K, N] contiguous, or an nn.Linear-style [N, K] weight seen through .t()."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).t() if transposed else torch.randn(k, n, generator=g)
    return a.to(DEVICE), (w * k ** -0.5).to(dtype).to(DEVICE)


# M, K, N, dtype, w transposed
CASES = [
    (150, 64, 300, torch.float32, False),       # two row tiles, three column tiles
    (70, 40, 136, torch.float32, True),         # K not a multiple of BLOCK_K, w through .t()
    (1, 48, 20, torch.float32, False),          # one row
    (33, 64, 96, torch.float16, True),          # (the interpreter computes bf16 dots wrongly; fp16 stands in)
    (0, 64, 96, torch.float32, False),          # no rows
    (20, 1024, 40, torch.float32, False),       # one tile for 3 programs: tma_split_tail's 3 pieces of its K
    (150, 512, 400, torch.float32, True),       # 8 tiles: 2 whole waves, then 2 tiles in 3 pieces, 2 in program 1
    (150, 96, 400, torch.float32, True),        # the same with K too short to split: the 2 tiles whole
    pytest.param(1000, 1024, 3000, torch.bfloat16, True, marks=on_gpu),      # edges in M and N, 128 x 256 tiles
    pytest.param(2048, 4096, 7168, torch.bfloat16, True, marks=on_gpu),      # bench_gemm.py's d tp2 AG
    pytest.param(16384, 8192, 4096, torch.bfloat16, True, marks=on_gpu),     # its largest M (c tp2 AG)
    pytest.param(512, 1024, 2048, torch.bfloat16, False, marks=on_gpu),      # w row-major
]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("m,k,n,dtype,transposed", CASES)
def test_matches_torch(m, k, n, dtype, transposed, variant):
    a, w = operands(m, k, n, dtype, transposed, seed=m + k + n)
    out = matmul(a, w, PROGRAMS, variant=variant)
    if dtype == torch.bfloat16:
        expected, tol = a.float() @ w.float(), 2e-2                  # bf16 output: 2**-8 relative, k terms in fp32
        torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)
    else:
        tol = 1e-4 if dtype == torch.float32 and DEVICE == "cpu" else 1e-2   # GPU fp32 dots run in tf32
        torch.testing.assert_close(out.double(), a.double() @ w.double(), rtol=tol, atol=tol)


def test_descriptors_refuse_what_tma_cannot_address():
    a, w = operands(8, 40, 130, torch.float32, False, seed=0)   # out's rows: 130 * 4 bytes, not a multiple of 16
    torch.testing.assert_close(matmul(a, w, PROGRAMS, variant="pointer"), a @ w, rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="16-byte aligned"):
        matmul(a, w, PROGRAMS, variant="tma")
    assert not loads_through_descriptors("tma", a, w)                 # the fused kernels fall back to pointers
    with pytest.raises(ValueError, match="variant"):
        matmul(a, w, PROGRAMS, variant="cublas")


# ---------------------------------------------------------------------------------------------- small M

SMS = 132      # an H200's: the split rule sees a GPU's SM count (the interpreter runs any grid)


@pytest.fixture
def bf16_dots(monkeypatch):
    """In the interpreter, tl.dot of bf16 operands as the tensor cores do it: widened to fp32 (exactly), products
    summed in fp32. The interpreter itself multiplies their storage, uint16 words (numpy has no bf16)."""
    if DEVICE == "cuda":
        return
    create_dot = interpreter.InterpreterBuilder.create_dot

    def widened(x):
        if x.dtype != tl.bfloat16:
            return x
        return interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot",
                        lambda self, a, b, d, *args: create_dot(self, widened(a), widened(b), d, *args))


def bf16_bound(a, w):
    """Bound on |out - a.float() @ w.float()| per element, out the bf16 result of fp32 sums of the K products
    of bf16 a and w (exact in fp32): its rounding to bf16, less than one unit in the last place, 2**-7 of
    |a @ w| (the interpreter truncates; a GPU rounds to nearest, half that), and the two fp32 sums' rounding
    (ours, in any order of K slices and tiles, and the reference's), K * 2**-24 of (|a| @ |w|) each, once more
    for the first term's |a @ w| being off by as much (float64 sums stand in for exact ones)."""
    k = a.shape[1]
    a, w = a.double(), w.double()
    return 2**-7 * (a @ w).abs() + 3 * k * 2**-24 * (a.abs() @ w.abs())


SLICED = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=2)   # 7 blocks of K = 200
# M, K, N, w transposed, config (None: small_m_config's for SMS SMs)
SMALL_M_CASES = [
    (1, 640, 200, True, None),                  # one row; N not a multiple of BLOCK_N (64)
    (7, 1000, 136, False, None),                # K not a multiple of BLOCK_K (128), w row-major
    (16, 2048, 96, True, None),                 # 2 tiles: the rule splits K in 2 (16 blocks, 8 each)
    (100, 640, 300, True, None),                # 128-row tiles, 100 of 128 rows
    (0, 640, 96, True, None),                   # no rows
    (7, 200, 136, True, dict(SLICED, splits=3)),    # K in slices of 3, 3 and 1 blocks of 32 (the last 8 long)
    (7, 200, 136, False, dict(SLICED, splits=4)),   # 2, 2, 2 and 1 blocks
    pytest.param(1, 8192, 7168, True, None, marks=on_gpu),      # bench_gemm.py's small-M shapes
    pytest.param(64, 8192, 3584, True, None, marks=on_gpu),     # 56 tiles: 2 slices
    pytest.param(100, 2048, 3000, True, None, marks=on_gpu),
    pytest.param(256, 7168, 8192, False, None, marks=on_gpu),
]


@pytest.mark.parametrize("variant", FUSED_VARIANTS)
@pytest.mark.parametrize("m,k,n,transposed,config", SMALL_M_CASES)
def test_small_m_matches_torch(m, k, n, transposed, config, variant, bf16_dots):
    a, w = operands(m, k, n, torch.bfloat16, transposed, seed=m + k + n)
    out = matmul_small_m(a, w, SMS, config, variant=variant)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    error = (out.double() - (a.float() @ w.float()).double()).abs()
    assert (error <= bf16_bound(a, w)).all(), error.max()
    assert torch.equal(out, matmul_small_m(a, w, SMS, config, variant=variant))    # the slices summed in one order


@pytest.mark.parametrize("m,k,n", [(1, 8192, 7168), (16, 7168, 8192), (64, 2048, 8192), (128, 8192, 8192),
                                   (256, 8192, 7168), (64, 8192, 3584), (1, 8192, 1024), (3, 1000, 64), (300, 512, 64)])
def test_split_rule(m, k, n):
    """small_m_config's rule: the most K slices that still fit one program an SM, each of at least
    MIN_SPLIT_BLOCKS BLOCK_K steps, one slice where there is no such split; small_m_tile's tile."""
    config = small_m_config(m, n, k, 2, SMS)
    assert {key: config[key] for key in config if key != "splits"} == small_m_tile(m, n, 2, SMS)
    tiles = -(-m // config["BLOCK_M"]) * -(-n // config["BLOCK_N"])
    blocks, splits = -(-k // config["BLOCK_K"]), config["splits"]

    def fits(s):
        return tiles * s <= SMS and blocks // s >= MIN_SPLIT_BLOCKS
    assert splits == 1 or fits(splits)
    assert not fits(splits + 1)
    if (m, k, n) == (64, 8192, 3584):
        assert splits == 2


@pytest.mark.parametrize("rows,n,shards,tile", [
    (128, 14336, 1, (128, 128, 64)), (128, 28672, 1, (128, 128, 64)), (128, 7168, 1, (128, 64, 128)),
    (64, 14336, 1, (64, 128, 128)), (64, 7168, 1, (64, 64, 128)), (64, 7168, 2, (64, 128, 128)),
    (32, 14336, 1, (32, 128, 128)), (32, 7168, 1, (16, 128, 128)), (1, 7168, 1, (16, 64, 128)),
    (256, 14336, 1, (128, 256, 64)), (256, 7168, 1, (128, 128, 64)), (128, 3584, 1, (128, 64, 128)),
    (128, 12672, 1, (128, 128, 64)), (128, 12544, 1, (128, 64, 128)),      # 99 tiles of 128 x 128: 3/4 of 132; 98
    (256, 28672, 1, (128, 256, 64)), (384, 28672, 1, (128, 256, 64)), (512, 14336, 1, (128, 256, 64)),
    (512, 7168, 1, (128, 256, 64)), (256, 14336, 2, (128, 256, 64)),
    (512, 28672, 1, (128, 128, 64)),     # 448 tiles of 128 x 256 fill 4 waves to 85%, 896 of 128 x 128 7 to 97%
    (32, 28672, 1, (32, 128, 128))])     # the same fills, but the weights' bytes bound 32 rows: the widest
def test_small_m_tile_picks_the_widest_that_keeps_the_sms_busy(rows, n, shards, tile):
    """small_m_tile on an H200's 132 SMs at decode shapes (tensor parallelism 1-8 of 28672 and 8192 x 28672,
    1-512 rows), with the tiles measured best there (SMALL_M_TILES' comment), and at the thresholds; the rule
    behind them: of the candidates with BUSY_SMS of the programs' worth of tiles (else the last), the first, beyond
    FLOP_ROWS rows the first whose waves are filled within WAVE_SLACK of the best."""
    config = small_m_tile(rows, n, 2, SMS, shards)
    assert (config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]) == tile
    candidates = next(tiles for most, tiles in SMALL_M_TILES if most is None or rows <= most)
    count = [shards * -(-rows // t["BLOCK_M"]) * -(-n // t["BLOCK_N"]) for t in candidates]
    busy = [i for i, c in enumerate(count) if c >= BUSY_SMS * SMS] or [len(candidates) - 1]
    fill = {i: count[i] / (-(-count[i] // SMS) * SMS) if rows > FLOP_ROWS else 1 for i in busy}
    assert config == candidates[next(i for i in busy if fill[i] * WAVE_SLACK >= max(fill.values()))]
    assert small_m_tile(rows, n, 4, SMS, shards)["BLOCK_K"] == tile[2] // 2      # the same bytes of a row


@pytest.mark.parametrize("element_size", [2, 4])
def test_fused_tiles(element_size):
    """The fused kernels' tiles: small_m_tile's for 2-byte operands up to FUSED_SMALL_M_ROWS rows (small_m_config's
    without its split), tile_config's otherwise, at every row count up to 600 and widths on both sides of
    tile_config's 2048; never smaller than the TP buffers' MIN_TILE, by which their flags are counted."""
    for rows in range(1, 601):
        for n in (64, 2047, 2048, 7168, 28672):
            config = fused_tile_config(rows, n, element_size, SMS)
            if rows <= FUSED_SMALL_M_ROWS and element_size == 2:
                small = small_m_tile(rows, n, element_size, SMS)
                assert {k: config[k] for k in small} == small, (rows, n)
                if rows <= SMALL_M_ROWS:
                    assert small.items() <= small_m_config(rows, n, 8192, element_size, SMS).items(), (rows, n)
            else:
                assert config == tile_config(rows, n, element_size), (rows, n)
            assert config["BLOCK_M"] >= MIN_TILE[0] and config["BLOCK_N"] >= MIN_TILE[1], (rows, n, config)
            assert "GROUP_M" in config


def test_small_m_refuses_what_it_cannot_run():
    a, w = operands(8, 40, 130, torch.float32, False, seed=0)   # w's rows: 130 * 4 bytes, not a multiple of 16
    with pytest.raises(ValueError, match="16-byte aligned"):
        matmul_small_m(a, w, SMS, variant="tma")
    with pytest.raises(ValueError, match="variant"):
        matmul_small_m(a, w, SMS, variant="tma_flat")        # no tile loop to flatten


COMPILE_FOR_SM90 = r"""
from moe_ep.kernels.matmul import SMALL_M_CANDIDATES, matmul_split_k_kernel, sum_splits_kernel
from sm90 import compile_for_sm90

for config in SMALL_M_CANDIDATES:
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    for tma in (False, True):
        descriptors = (dict(a_desc=f"tensordesc<bf16[{bm}, {bk}]>", w_desc=f"tensordesc<bf16[{bn}, {bk}]>") if tma
                       else {})
        constants = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=True, TMA=tma, W_KMAJOR=True,
                         **({} if tma else dict(a_desc=None, w_desc=None)))
        compile_for_sm90(matmul_split_k_kernel, dict(a="*bf16", w="*bf16", partials="*fp32", **descriptors),
                         constants, num_warps=config["num_warps"], num_stages=config["num_stages"])
        print(bm, bn, "tma" if tma else "pointer")
compile_for_sm90(sum_splits_kernel, dict(partials="*fp32", out="*bf16"), dict(BLOCK=1024), num_warps=4)
print("sum_splits_kernel")
"""


def test_small_m_kernels_compile_for_sm90():
    """matmul_split_k_kernel with every tile of SMALL_M_TILES, both ways of loading, and sum_splits_kernel
    compile to cubins for sm_90 (Triton's PTX and ptxas; no GPU needed), outside the interpreter."""
    lines = run_without_interpreter(COMPILE_FOR_SM90, timeout=600).splitlines()
    assert len(lines) == 2 * len(SMALL_M_CANDIDATES) + 1 and lines[-1] == "sum_splits_kernel"


COMPILE_TILE_LOOP_FOR_SM90 = r"""
from moe_ep.kernels.matmul import MIN_SPLIT_BLOCKS, fused_tile_config, matmul_kernel
from sm90 import compile_for_sm90

for rows in (128, 256):                     # decode rows: 128 x 128 tiles (512 rows too), then 128 x 256
    config = fused_tile_config(rows, 28672, 2, 132)
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    for split in (False, True):
        constants = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config["GROUP_M"], EVEN_K=True, TMA=True,
                         W_KMAJOR=True, FLATTEN=False, STORE_TMA=False, SPLIT_TAIL=split, MIN_PIECE=MIN_SPLIT_BLOCKS,
                         out_desc=None)
        types = dict(a="*bf16", w="*bf16", out="*bf16", partials="*fp32", counts="*i32",
                     a_desc=f"tensordesc<bf16[{bm}, {bk}]>", w_desc=f"tensordesc<bf16[{bn}, {bk}]>")
        compiled = compile_for_sm90(matmul_kernel, types, constants, num_warps=config["num_warps"],
                                    num_stages=config["num_stages"])
        print(bm, bn, split, compiled.metadata.shared)
"""


def test_tile_loop_compiles_for_sm90():
    """matmul_kernel on TMA, with and without its split tail, at bench_tp's decode tiles, compiles to cubins for
    sm_90 outside the interpreter; the tail's buffers take no shared memory of the tile loop's."""
    lines = [line.split() for line in run_without_interpreter(COMPILE_TILE_LOOP_FOR_SM90, timeout=600).splitlines()]
    assert [line[:3] for line in lines] == [["128", "128", "False"], ["128", "128", "True"], ["128", "256", "False"],
                                            ["128", "256", "True"]], lines
    assert lines[0][3] == lines[1][3] and lines[2][3] == lines[3][3], lines
