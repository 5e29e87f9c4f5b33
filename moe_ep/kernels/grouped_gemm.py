"""Masked grouped GEMMs over the expert-major rows that dispatch produces; the work follows the counts.

    out[e, r] = a[e, r] @ w[e].T          for r < counts[e], every local expert e

w is [E, N, K] (nn.Linear's layout). a is bf16/fp16/fp32, or FP8 e4m3 with per-row, per-`group`-column
fp32 scales. ``gated_mlp`` runs an MoE layer's experts on them: the gate_up GEMM (w13: the gate rows
first, then the up rows, as transformers stores ``gate_up_proj``), act(gate) * up in a kernel of its
own (``gated_activation``), the down GEMM. ``GatedMLP`` makes gated_mlp's checks, tile choices and
operand descriptors once for operands that stay (an MoE layer's weights and receive buffers), so that
each of its calls is three launches.

With weights in the dtype of the rows the GEMM runs in that dtype, and FP8 rows are dequantized
as a tile is loaded. With FP8 weights (``quant.quantize_weights_fp8``: one scale per
WEIGHT_BLOCK x WEIGHT_BLOCK tile) it runs on FP8 tensor cores: rows that are not FP8 already are
quantized as they are loaded, per row and BLOCK_K columns with the rows' formula
(``quant.fp8_quantize_groups``), and every BLOCK_K step adds dot(a_q, w_q) * a_scale * w_scale
to the fp32 accumulator (the scales of one step are constant along K). That scaling waits for
each step's dot: the tensor cores cannot run ahead into the next step, which bounds FP8 at about
the speed of bf16 at prefill sizes (benchmarks/NOTES.md). ``gated_mlp`` therefore hands the down
GEMM rows quantized once, by ``gated_activation``, rather than on every tile's load.

Rows come in one of two layouts, for a and for out independently:
    capacity  [E, R, C]: expert e's rows at [e, 0:counts[e]] (what dispatch delivers, combine reads)
    packed    [P, C]:    expert e's rows at [s_e, s_e + counts[e]), s_e = counts[:e].sum()
The gate_up GEMM of an MoE layer writes packed rows, so its intermediate is as large as the rows a
rank can receive (W * T_max * min(K, E_loc)), not E_loc times the per-expert capacity.

Tile scheduler: the grid is a fixed number of persistent programs (the same every call, so CUDA
graphs can capture it). Each program loads the counts, computes on the device how many
BLOCK_M x BLOCK_N tiles every expert has (cdiv(counts[e], BLOCK_M) * cdiv(N, BLOCK_N)) and
takes tiles pid, pid + programs, ... of that list. An empty expert has no tiles, rows past a
count are never read or written, and a program past the last tile exits at once: no host sync.
Inside an expert the row-blocks of one column-block are consecutive, so programs running at the
same time share the weight tile they read (L2).

Operands are loaded one of two ways (``VARIANTS``): pointer loads (cp.async), or, "tma", through
tensor descriptors (``matmul.descriptor``) over a as [rows of all experts, K] and w as [E * N, K]:
a box may then reach into the next expert's rows (their outputs are masked at the store, and row r
of a dot depends on row r of a only) or past the end (zeros). Outputs are stored with pointers
either way: rows past a count must keep what out held, which a descriptor's box cannot skip.
Descriptors are the default (DEFAULT_VARIANTS): on an H200 they were faster than pointer loads at
every measured shape but one (benchmarks/NOTES.md); "pointer" serves operands a descriptor cannot
take.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..launcher import cdiv, next_power_of_2, shared_kernel
from .matmul import describable, descriptor
from .quant import (cast_rn, dequantize_rows_fp8, dequantize_weights_fp8, fp8_quantize_groups,
                    quantize_rows_fp8, to_fp8)

# The activations of the gated MLP (``gated_mlp``), by name, and what each means in torch.
ACTIVATIONS = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu}

# Tile shapes per shape class on Hopper (wgmma: 64 rows per warpgroup), measured on an H200
# (benchmarks/NOTES.md). The class is picked on the host from the expected rows per expert (no sync).
# decode: a handful of rows per expert, the GEMM reads each weight once and is bound by HBM
# bandwidth: 64-row tiles waste least, narrow column blocks give enough programs to keep the memory
# system busy, and 3 stages of 64x128 + 128x64 bf16 (96 KB) let two programs share an SM. prefill:
# 128 x 256 tiles with 8 warps, 4 stages of 48 KB, one program an SM, on the flattened loop
# (Qwen3-30B-A3B's shape, 512 rows: 1.05x torch._grouped_mm in three runs, against 0.99-1.01x
# unflattened; DeepSeek-V3's, 256 rows: 0.95-1.03x, against 1.00-1.01x unflattened). FP8 weights,
# both classes: 64 x 128 x 128 with 4 warps, 4 stages of 24 KB with FP8 rows, two programs an SM,
# one scaling its dot while the other's wgmma runs (decode: 4.3 TB/s at DeepSeek-V3's shape against
# 4.1 with 64 x 64 and 6 stages; prefill: 730 TFLOP/s against 640 with 128 x 128 and 8 warps).
TILE_CONFIGS = {
    "decode": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3, programs_per_sm=2),
    "prefill": dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4, programs_per_sm=1),
    "fp8_weights": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4, programs_per_sm=2),
}
# Candidates timed by `benchmarks/bench_gemm.py --grouped --full` against the table (one enters it only
# once measured): name -> (entry, the precisions of the weights it is for). Each fits 227 KB of shared
# memory and 255 registers a thread (ptxas for sm_90, triton 3.6). FP8 keeps each step's dot beside
# the accumulator to scale it (255 registers at 128 x 128 with 8 warps), hence the narrower tiles.
TILE_CANDIDATES = {
    "128x256, 3 stages": (dict(TILE_CONFIGS["prefill"], num_stages=3), ("bf16",)),
    "128x128, 8 warps": (dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_warps=8, num_stages=3, programs_per_sm=1),
                         ("fp8",)),
    "64x256": (dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=128, num_warps=8, num_stages=3, programs_per_sm=1), ("fp8",)),
}
WEIGHT_BLOCK = tl.constexpr(128)   # FP8 weights: one scale per 128 x 128 tile (DeepSeek-V3's); BLOCK_K is 128 then
DECODE_ROWS = 64          # expected rows per expert up to which one 64-row tile covers an expert
# Shared memory for the pipeline's stages: an H100/H200 block gets 227 KB. With fp32 operands the
# epilogue's layout conversion takes the fp32 output tile besides (seen on an H200: 128 x 256 tiles
# asked for 2 x 96 KB of stages + 128 KB), so their stages get STAGE_MEMORY less that tile.
STAGE_MEMORY = 192 * 1024
ACTIVATION_ROWS = 16      # rows a program of gated_activation_kernel takes (16 x 128 columns: 4 KB of gate)
INTERPRETER_PROGRAMS = 4  # the interpreter runs programs one after another: any small number will do
# The arguments that change between launches (``launcher.shared_kernel``; the rest are compile-time);
# the descriptors only on the TMA variants, which take them.
GEMM_VARYING = ("a_ptr", "scale_ptr", "w_ptr", "w_scale_ptr", "out_ptr", "counts_ptr", "rows", "packed_rows",
                "experts")
OUT, A_DESC = GEMM_VARYING.index("out_ptr"), len(GEMM_VARYING)   # out's place and a_desc's (TMA) in a launch's values
DESCRIPTORS = ("a_desc", "w_desc")
ACTIVATION_VARYING = ("gate_up_ptr", "out_ptr", "scale_ptr", "counts_ptr", "rows", "packed_rows", "experts")
# How operands are loaded (see the module docstring); FLATTEN: the tile loop and the K loop pipelined as
# one (the next tile's loads start during this tile's last steps). The defaults, by the weights' dtype:
# flattened for bf16 (see TILE_CONFIGS), not for FP8 weights (15-40% slower flattened).
VARIANTS = {"pointer": dict(TMA=False, FLATTEN=False), "tma": dict(TMA=True, FLATTEN=False),
            "tma_flat": dict(TMA=True, FLATTEN=True)}
DEFAULT_VARIANTS = {"bf16": "tma_flat", "fp8": "tma"}


@triton.jit
def _activation(x, ACTIVATION: tl.constexpr):
    if ACTIVATION == "silu":
        y = x * tl.sigmoid(x)
    else:   # "gelu", the exact (erf) form
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    return y


@triton.jit
def _add3(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def _weight_tile(w_tile, k, w_desc, row, k0, TMA: tl.constexpr):
    """[BLOCK_K, BLOCK_N] of an expert's w.T: columns k of the weight rows at w_tile (pointers), or
    the [BLOCK_N, BLOCK_K] box of w_desc at (row, k0), transposed (TMA)."""
    if TMA:
        tile = w_desc.load([row, k0]).T
    else:
        tile = tl.load(w_tile + k[:, None])
    return tile


@triton.jit(do_not_specialize=["rows", "packed_rows", "experts"])
def grouped_gemm_kernel(a_ptr, scale_ptr, w_ptr, w_scale_ptr, out_ptr, counts_ptr, a_desc, w_desc, rows, packed_rows,
                        experts, K: tl.constexpr, N: tl.constexpr, FP8: tl.constexpr, W_FP8: tl.constexpr,
                        GROUP: tl.constexpr, A_PACKED: tl.constexpr, OUT_PACKED: tl.constexpr, E_PAD: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                        TMA: tl.constexpr, FLATTEN: tl.constexpr):
    """a: [E * rows, K] or packed [packed_rows, K]; scale: [same rows, K // GROUP] f32 (FP8 a only);
    w: [E, N, K]; w_scale: [E, N / WEIGHT_BLOCK, K / WEIGHT_BLOCK] f32 (FP8 w only);
    out: [E * rows, N] or packed [packed_rows, N].
    TMA: a_desc over a as [*, K] in [BLOCK_M, BLOCK_K] boxes, w_desc over w as [E * N, K] in
    [BLOCK_N, BLOCK_K] boxes (else both None). Rows and columns past the edges compute from row /
    column 0 (pointers) or from whatever the box holds there (TMA) and are masked at the store."""
    e = tl.arange(0, E_PAD)
    counts = tl.minimum(tl.maximum(tl.load(counts_ptr + e, mask=e < experts, other=0), 0), rows)
    tiles = tl.cdiv(counts, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    tile_end = tl.cumsum(tiles, 0)
    for t in tl.range(tl.program_id(0), tl.sum(tiles), tl.num_programs(0), flatten=FLATTEN):
        # The experts whose tiles all come before t are the ones before t's expert (tile_end never
        # decreases): one reduction gives the expert, its first packed row s_e and its first tile.
        before = tile_end <= t
        expert, start, first_tile = tl.reduce((before.to(tl.int32), tl.where(before, counts, 0),
                                               tl.where(before, tiles, 0)), 0, _add3)
        count = tl.minimum(tl.maximum(tl.load(counts_ptr + expert), 0), rows)
        local = t - first_tile
        tiles_m = tl.cdiv(count, BLOCK_M)
        m0 = (local % tiles_m) * BLOCK_M
        n0 = (local // tiles_m) * BLOCK_N
        m = m0 + tl.arange(0, BLOCK_M)
        n = n0 + tl.arange(0, BLOCK_N)
        valid = (m < count) & (start + m < packed_rows)               # packed rows past the buffer: never
        m_in = tl.where(valid, m, 0)                                   # row 0 exists: count > 0 here
        n_in = tl.where(n < N, n, 0)
        a_first = expert.to(tl.int64) * rows                           # capacity layout
        if A_PACKED:
            a_first = start.to(tl.int64)
        out_first = expert.to(tl.int64) * rows
        if OUT_PACKED:
            out_first = start.to(tl.int64)
        a_tile = a_ptr + a_first * K + m_in[:, None] * K               # 64-bit base, 32-bit offsets
        w_tile = w_ptr + expert.to(tl.int64) * N * K + n_in[None, :] * K
        a_row = (a_first + m0).to(tl.int32)                            # TMA coordinates are 32-bit
        w_row = expert * N + n0
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            if TMA:   # zeros past K in both
                a = a_desc.load([a_row, k0])
            elif EVEN_K:
                a = tl.load(a_tile + k[None, :])
            else:   # zeros past K in a; w reads column 0 there instead (readable, multiplied by zero)
                a = tl.load(a_tile + k[None, :], mask=(k < K)[None, :], other=0.0)
                k = tl.where(k < K, k, 0)
            if FP8:   # BLOCK_K divides GROUP: one scale per row for the whole tile
                scale = tl.load(scale_ptr + (a_first + m_in) * (K // GROUP) + k0 // GROUP)
            w = _weight_tile(w_tile, k, w_desc, w_row, k0, TMA)
            if W_FP8:
                if not FP8:
                    a, scale = fp8_quantize_groups(a.to(tl.float32))
                    a = to_fp8(a)
                w_scale = tl.load(w_scale_ptr + expert.to(tl.int64) * (N // WEIGHT_BLOCK) * (K // WEIGHT_BLOCK)
                                  + (n_in // WEIGHT_BLOCK) * (K // WEIGHT_BLOCK) + k0 // WEIGHT_BLOCK)
                acc += tl.dot(a, w) * (scale[:, None] * w_scale[None, :])
            else:
                if FP8:
                    a = (a.to(tl.float32) * scale[:, None]).to(w_ptr.dtype.element_ty)
                acc = tl.dot(a, w, acc)
        tl.store(out_ptr + out_first * N + m[:, None] * N + n[None, :],
                 cast_rn(acc, out_ptr.dtype.element_ty), mask=valid[:, None] & (n < N)[None, :])


@triton.jit(do_not_specialize=["rows", "packed_rows", "experts"])
def gated_activation_kernel(gate_up_ptr, out_ptr, scale_ptr, counts_ptr, rows, packed_rows, experts,
                            I: tl.constexpr, ACTIVATION: tl.constexpr, QUANTIZE: tl.constexpr, E_PAD: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """out[r, c] = act(gate_up[r, c]) * gate_up[r, I + c] in fp32, for the packed rows r < sum(counts).

    gate_up: [packed_rows, 2I]; out: [packed_rows, I] in its dtype or, QUANTIZE, FP8 with scale
    [packed_rows, I / BLOCK_C] f32 (``fp8_quantize_groups``: BLOCK_C is the group). Counts are clamped
    to [0, rows] as the GEMMs clamp them; a program whose rows all lie past them does nothing. Program p
    takes rows BLOCK_R * (p // cdiv(I, BLOCK_C)) on and columns BLOCK_C * (p % cdiv(I, BLOCK_C)) on."""
    e = tl.arange(0, E_PAD)
    total = tl.minimum(tl.sum(tl.minimum(tl.maximum(tl.load(counts_ptr + e, mask=e < experts, other=0), 0), rows)),
                       packed_rows)
    column_blocks: tl.constexpr = (I + BLOCK_C - 1) // BLOCK_C
    row_block, column_block = tl.program_id(0) // column_blocks, tl.program_id(0) % column_blocks
    r = row_block * BLOCK_R + tl.arange(0, BLOCK_R)
    if row_block * BLOCK_R < total:
        c = column_block * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (r < total)[:, None] & (c < I)[None, :]
        row = r.to(tl.int64)[:, None] * (2 * I)
        gate = tl.load(gate_up_ptr + row + c[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + row + I + c[None, :], mask=mask, other=0.0).to(tl.float32)
        h = _activation(gate, ACTIVATION) * up
        if QUANTIZE:
            h, scale = fp8_quantize_groups(h)
            tl.store(scale_ptr + r.to(tl.int64) * (I // BLOCK_C) + column_block, scale, mask=r < total)
            h = to_fp8(h)
        else:
            h = cast_rn(h, out_ptr.dtype.element_ty)
        tl.store(out_ptr + r.to(tl.int64)[:, None] * I + c[None, :], h, mask=mask)


def tile_config(rows_per_expert: float, fp8_group: int | None = None, fp8_weights: bool = False,
                a_bytes: int = 2, w_bytes: int = 2) -> dict:
    """The TILE_CONFIGS entry for `rows_per_expert` expected rows (and FP8 weights or not); BLOCK_K =
    WEIGHT_BLOCK for FP8 weights (the rows' quantization group then), capped at the group of FP8 rows;
    as many stages as fit STAGE_MEMORY with a's and w's element sizes (fp32 operands fit half as many
    as bf16, less their output tile)."""
    shape_class = "fp8_weights" if fp8_weights else "decode" if rows_per_expert <= DECODE_ROWS else "prefill"
    config = dict(TILE_CONFIGS[shape_class])
    if fp8_weights:
        config["BLOCK_K"] = WEIGHT_BLOCK.value
    if fp8_group:
        config["BLOCK_K"] = min(config["BLOCK_K"], fp8_group)
    stage = config["BLOCK_K"] * (config["BLOCK_M"] * a_bytes + config["BLOCK_N"] * w_bytes)
    budget = STAGE_MEMORY - (config["BLOCK_M"] * config["BLOCK_N"] * 4 if max(a_bytes, w_bytes) == 4 else 0)
    config["num_stages"] = max(1, min(config["num_stages"], budget // stage))
    return config


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, scales: torch.Tensor | None = None,
                 group: int = 128, out: torch.Tensor | None = None, packed_rows: int | None = None,
                 rows_per_expert: float | None = None, w_scales: torch.Tensor | None = None,
                 tiles: dict | None = None, variant: str | None = None) -> torch.Tensor:
    """a [E, R, K] or packed [P, K]; w [E, N, K]; counts [E] int32 on a's device; scales like a with
    K // group columns, f32, for FP8 a. FP8 w (``quant.quantize_weights_fp8``) needs w_scales
    [E, N / 128, K / 128] f32; out is bf16 then. tiles: an entry like TILE_CONFIGS' to use as it is
    instead of the table's (for tuning; BLOCK_K must divide the FP8 groups). variant: one of VARIANTS;
    None takes DEFAULT_VARIANTS' where it can (``matmul.describable``: descriptors need a and w
    non-empty and 16-byte aligned), else "pointer".

    out: [E, R, N] or packed [P, N]; made if not given: packed [packed_rows, N] when packed_rows is
    given, else in a's layout. rows_per_expert: the expected rows per expert, which picks the tile
    shapes (default: the capacity R). Returns out; rows past the counts keep what out held. A packed
    side must hold sum(counts) rows (rows past its end are skipped).
    """
    kernel, values = _gemm_launch(a, w, counts, scales, group, out, packed_rows, rows_per_expert, w_scales, tiles,
                                  variant)
    kernel(*values)
    return values[OUT]


def _gemm_launch(a, w, counts, scales=None, group=128, out=None, packed_rows=None, rows_per_expert=None,
                 w_scales=None, tiles=None, variant=None):
    """grouped_gemm's checks (ValueError) and choices for these operands: its kernel (a shared BoundKernel)
    and the values it launches with, GEMM_VARYING's then the descriptors (out, made if not given, at OUT)."""
    experts = w.shape[0] if w.dim() == 3 else None
    if experts is None or w.shape[2] != a.shape[-1]:
        raise ValueError(f"w must be [E, N, {a.shape[-1]}], got {tuple(w.shape)}")
    if a.dim() not in (2, 3) or (a.dim() == 3 and a.shape[0] != experts):
        raise ValueError(f"a must be [{experts}, R, K] or packed [P, K], got {tuple(a.shape)}")
    if counts.shape != (experts,) or counts.dtype != torch.int32 or counts.device != a.device:
        raise ValueError(f"counts must be int32 [{experts}] on {a.device}, got {counts.dtype} "
                         f"{tuple(counts.shape)} on {counts.device}")
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"variant must be one of {tuple(VARIANTS)}, got {variant!r}")
    k, n = a.shape[-1], w.shape[1]
    fp8 = a.dtype == torch.float8_e4m3fn
    if fp8 and (k % group or scales is None or scales.shape != (*a.shape[:-1], k // group)):
        raise ValueError(f"FP8 input needs K a multiple of group and scales {(*a.shape[:-1], k // group)}")
    fp8_weights = w.dtype == torch.float8_e4m3fn
    block = WEIGHT_BLOCK.value
    if fp8_weights and (n % block or k % block or w_scales is None
                        or w_scales.shape != (experts, n // block, k // block)):
        raise ValueError(f"FP8 weights need N and K multiples of {block} and w_scales "
                         f"{(experts, n // block, k // block)}")
    out_dtype = torch.bfloat16 if fp8_weights else w.dtype
    if out is None:
        shape = (packed_rows, n) if packed_rows is not None else (*a.shape[:-1], n)
        out = torch.empty(shape, dtype=out_dtype, device=a.device)
    if out.shape[-1] != n or out.dim() not in (2, 3) or (out.dim() == 3 and out.shape[0] != experts):
        raise ValueError(f"out must be [{experts}, R, {n}] or packed [P, {n}], got {tuple(out.shape)}")
    capacity = [t.shape[1] for t in (a, out) if t.dim() == 3]
    packed = [t.shape[0] for t in (a, out) if t.dim() == 2]
    if len(set(capacity)) > 1 or len(set(packed)) > 1:
        raise ValueError(f"a {tuple(a.shape)} and out {tuple(out.shape)} disagree on the rows")
    if not (a.is_contiguous() and w.is_contiguous() and out.is_contiguous()):
        raise ValueError("a, w and out must be contiguous")
    rows = capacity[0] if capacity else packed[0]       # the most rows any one expert can have
    packed_rows = packed[0] if packed else 2**31 - 1
    config = dict(tiles) if tiles is not None else tile_config(
        rows if rows_per_expert is None else rows_per_expert, group if fp8 else None, fp8_weights=fp8_weights,
        a_bytes=a.element_size(), w_bytes=w.element_size())
    if (fp8 and group % config["BLOCK_K"]) or (fp8_weights and WEIGHT_BLOCK.value % config["BLOCK_K"]):
        raise ValueError(f"BLOCK_K={config['BLOCK_K']} must divide the FP8 groups")
    programs_per_sm = config.pop("programs_per_sm")
    tiles = experts * cdiv(rows, config["BLOCK_M"]) * cdiv(n, config["BLOCK_N"])
    programs = programs_per_sm * _sm_count(a.device.index) if a.is_cuda else INTERPRETER_PROGRAMS
    grid = max(1, min(programs, tiles))
    a_rows, w_rows = a.view(-1, k), w.view(-1, k)
    if variant is None:
        variant = DEFAULT_VARIANTS["fp8" if fp8_weights else "bf16"]
        if not (describable(a_rows) and describable(w_rows)):
            variant = "pointer"
    descriptors = ()
    if VARIANTS[variant]["TMA"]:
        descriptors = (descriptor(a_rows, [config["BLOCK_M"], config["BLOCK_K"]]),
                       descriptor(w_rows, [config["BLOCK_N"], config["BLOCK_K"]]))
    kernel = shared_kernel(grouped_gemm_kernel, grid, GEMM_VARYING + DESCRIPTORS[:len(descriptors)],
                           **dict.fromkeys(DESCRIPTORS[len(descriptors):]), K=k, N=n, FP8=fp8, W_FP8=fp8_weights,
                           GROUP=group, A_PACKED=a.dim() == 2, OUT_PACKED=out.dim() == 2, E_PAD=_e_pad(experts),
                           EVEN_K=k % config["BLOCK_K"] == 0, **VARIANTS[variant], **config)
    return kernel, [a, scales if fp8 else a, w, w_scales if fp8_weights else w, out, counts, rows, packed_rows,
                    experts, *descriptors]


def gated_activation(gate_up: torch.Tensor, counts: torch.Tensor, rows: int, activation: str,
                     out_dtype: torch.dtype | None = None, group: int = 128):
    """h = act(gate) * up of the packed rows gate_up [P, 2I] (the first sum(counts) rows, counts
    clamped to [0, rows] as the grouped GEMM clamps them), computed in fp32: [P, I] in out_dtype
    (default gate_up's) or, out_dtype FP8 e4m3, (h [P, I] FP8, scales [P, I / group] f32) quantized
    per row and `group` columns with dispatch's formula. Rows past sum(counts) are left unwritten."""
    kernel, values = _activation_launch(gate_up, counts, rows, activation, out_dtype, group)
    if kernel is not None:
        kernel(*values)
    h, scales = values[1:3]
    return (h, scales) if out_dtype == torch.float8_e4m3fn else h


def _activation_launch(gate_up, counts, rows, activation, out_dtype, group):
    """gated_activation's checks (ValueError) and its launch: the kernel (None where there is nothing to
    compute) and its ACTIVATION_VARYING values, h and its scales made here."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
    packed_rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    quantize = out_dtype == torch.float8_e4m3fn
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or (quantize and inter % group) or not gate_up.is_contiguous():
        raise ValueError(f"gate_up must be contiguous [P, 2I] (I a multiple of {group} for FP8), "
                         f"got {tuple(gate_up.shape)}")
    h = torch.empty((packed_rows, inter), dtype=out_dtype or gate_up.dtype, device=gate_up.device)
    scales = torch.empty((packed_rows, inter // group if quantize else 0), dtype=torch.float32,
                         device=gate_up.device)
    block_c = group if quantize else min(128, next_power_of_2(inter))
    kernel = None
    if packed_rows and inter:
        grid = cdiv(packed_rows, ACTIVATION_ROWS) * cdiv(inter, block_c)
        kernel = shared_kernel(gated_activation_kernel, grid, ACTIVATION_VARYING, I=inter, ACTIVATION=activation,
                               QUANTIZE=quantize, E_PAD=_e_pad(len(counts)), BLOCK_R=ACTIVATION_ROWS, BLOCK_C=block_c)
    return kernel, [gate_up, h, scales, counts, rows, packed_rows, len(counts)]


def _e_pad(experts: int) -> int:
    return max(2, next_power_of_2(experts))


@functools.cache
def _sm_count(device_index: int | None) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def grouped_gemm_reference(a: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, scales: torch.Tensor | None = None,
                           group: int = 128, activation=None, w_scales: torch.Tensor | None = None,
                           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """What grouped_gemm computes, in plain torch, capacity layout in and out: each expert's counted
    rows (dequantized if FP8) times its weights (dequantized if FP8) in fp32, for a gated form
    act(gate) * up of the fp32 results, cast once to out_dtype (default: w's, bf16 for FP8 weights).
    With FP8 weights, rows that are not FP8 are first quantized per WEIGHT_BLOCK columns, as the
    kernel does on load. activation: None, a name of ACTIVATIONS, or a callable on fp32 tensors.
    Rows past the counts are zero."""
    out_dtype = out_dtype or (torch.bfloat16 if w_scales is not None else w.dtype)
    if w_scales is not None:
        w = dequantize_weights_fp8(w, w_scales, WEIGHT_BLOCK.value)
        if scales is None:
            a, scales = quantize_rows_fp8(a, WEIGHT_BLOCK.value)
            group = WEIGHT_BLOCK.value
    act = ACTIVATIONS.get(activation, activation)
    n_out = w.shape[1] // 2 if activation is not None else w.shape[1]
    out = torch.zeros((*a.shape[:2], n_out), dtype=out_dtype, device=a.device)
    for e, count in enumerate(counts.tolist()):
        rows = a[e, :count]
        rows = dequantize_rows_fp8(rows, scales[e, :count], group) if scales is not None else rows.float()
        y = rows @ w[e].float().t()
        if activation is None:
            y = y.to(w.dtype)          # without an activation the GEMM rounds to the weights' dtype first
        else:
            gate, up = y.chunk(2, dim=-1)
            y = act(gate) * up
        out[e, :count] = y.to(out_dtype)
    return out


def gated_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor,
              scales: torch.Tensor | None = None, group: int = 128, activation="silu",
              w13_scales: torch.Tensor | None = None, w2_scales: torch.Tensor | None = None,
              out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None, packed_rows: int | None = None,
              rows_per_expert: float | None = None, kernels: bool | None = None) -> torch.Tensor:
    """Every expert's gated MLP on the rows dispatch delivers: act(x @ gate.T) * (x @ up.T) @ w2[e].T
    for the first counts[e] rows of expert e.

    x [E, R, H] (FP8 with scales [E, R, H / group], or bf16/fp16/fp32); w13 [E, 2I, H] (gate rows, then
    up), w2 [E, H, I]: in x's dtype, or FP8 with w13_scales / w2_scales (``quant.quantize_weights_fp8``);
    activation: a name of ACTIVATIONS (``gated_activation``'s kernel) or a callable (applied in torch).
    Returns out [E, R, H] (made in out_dtype if not given: default w13's dtype, bf16 for FP8 weights).

    kernels (default: x on CUDA; the Triton interpreter runs them on CPU tensors): the gate_up GEMM into
    packed rows (packed_rows of them: default E * R, as many as could be counted; fewer where the
    caller knows a bound), act(gate) * up (quantized per row and 128 columns when w2 is FP8, so that
    the second GEMM runs FP8 dots on FP8 rows), the down GEMM; rows past the counts left as out held
    them; rows_per_expert picks the tile shapes. Otherwise grouped_gemm_reference in fp32, rows past
    the counts zero.
    """
    if out is not None:
        out_dtype = out.dtype
    if not (x.is_cuda if kernels is None else kernels):
        h = grouped_gemm_reference(x, w13, counts, scales, group, activation, w13_scales, out_dtype)
        y = grouped_gemm_reference(h, w2, counts, w_scales=w2_scales, out_dtype=out_dtype)
        return y if out is None else out.copy_(y)
    experts, rows, _ = x.shape
    dtype = out_dtype or (torch.bfloat16 if w13.dtype == torch.float8_e4m3fn else w13.dtype)
    gemm = dict(counts=counts, rows_per_expert=rows_per_expert)
    packed_rows = experts * rows if packed_rows is None else packed_rows
    gate_up = torch.empty((packed_rows, w13.shape[1]), dtype=dtype, device=x.device)
    grouped_gemm(x, w13, scales=scales, group=group, out=gate_up, w_scales=w13_scales, **gemm)
    h_scales = None
    if not isinstance(activation, str):
        gate, up = gate_up.chunk(2, dim=-1)
        h = activation(gate) * up
    elif w2.dtype == torch.float8_e4m3fn:   # FP8 rows for the second GEMM's FP8 dots, quantized once
        h, h_scales = gated_activation(gate_up, counts, rows, activation, torch.float8_e4m3fn, WEIGHT_BLOCK.value)
    else:
        h = gated_activation(gate_up, counts, rows, activation)
    if out is None:
        out = torch.empty((experts, rows, w2.shape[1]), dtype=dtype, device=x.device)
    return grouped_gemm(h, w2, scales=h_scales, group=WEIGHT_BLOCK.value, out=out, w_scales=w2_scales, **gemm)


class GatedMLP:
    """gated_mlp with kernels on operands that stay: an MoE layer's weights and one slot of its all-to-all's
    receive buffers. The checks, tile choices and kernels of its three launches, and the descriptors of x
    and the weights, are made once, here; a call makes the intermediates and the output and launches:

        experts = GatedMLP(x, w13, w2, counts, scales, rows_per_expert=8)   # ValueError for bad operands
        out = experts()          # gated_mlp(x, w13, w2, counts, scales, ..., kernels=True), for the
        out = experts()          # counts and rows x holds at each call

    The arguments are gated_mlp's (activation by name only: a callable runs in torch). At decode sizes a
    call's host time is the layer's eager time (benchmarks/NOTES.md), and gated_mlp spends most of it
    checking and describing operands that did not change. An object holds x, the weights, their scales and
    counts (not the intermediates or the output): drop it with the buffers it was made on."""

    def __init__(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor,
                 scales: torch.Tensor | None = None, group: int = 128, activation: str = "silu",
                 w13_scales: torch.Tensor | None = None, w2_scales: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None, packed_rows: int | None = None,
                 rows_per_expert: float | None = None):
        if x.dim() != 3:
            raise ValueError(f"x must be [E, R, H], got {tuple(x.shape)}")
        experts, rows, _ = x.shape
        self.device = x.device
        dtype = out_dtype or (torch.bfloat16 if w13.dtype == torch.float8_e4m3fn else w13.dtype)
        packed_rows = experts * rows if packed_rows is None else packed_rows
        gate_up = torch.empty((packed_rows, w13.shape[1]), dtype=dtype, device=x.device)
        self._up = _gemm_launch(x, w13, counts, scales, group, out=gate_up, rows_per_expert=rows_per_expert,
                                w_scales=w13_scales)
        fp8_rows = w2.dtype == torch.float8_e4m3fn        # the down GEMM's FP8 dots take FP8 rows
        self._act = _activation_launch(gate_up, counts, rows, activation, torch.float8_e4m3fn if fp8_rows else None,
                                       WEIGHT_BLOCK.value)
        h, h_scales = self._act[1][1:3]
        out = torch.empty((experts, rows, w2.shape[1]), dtype=dtype, device=x.device)
        self._down = _gemm_launch(h, w2, counts, h_scales if fp8_rows else None, WEIGHT_BLOCK.value, out=out,
                                  rows_per_expert=rows_per_expert, w_scales=w2_scales)
        # (shape, dtype) of what a call writes: gate_up [P, 2I], h [P, I], h's scales (FP8 h) or a stand-in,
        # out [E, R, H], P the packed rows; made new at every call, or carved from a replay's scratch
        self.made = tuple((t.shape, t.dtype) for t in (gate_up, h, h_scales, out))
        self._fp8_rows = fp8_rows
        tma = len(self._down[1]) > A_DESC
        self._h_block = self._down[1][A_DESC].block_shape if tma else None
        for values, made in ((self._up[1], (OUT,)), (self._act[1], (0, 1, 2)),
                             (self._down[1], (0, 1, OUT, A_DESC) if tma else (0, 1, OUT))):
            for i in made:
                values[i] = None               # made at every call: no memory kept between calls

    def __call__(self) -> torch.Tensor:
        """The experts' output [E, R, H] (rows past the counts unwritten), from what x and counts hold now."""
        return self.launch(*(torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in self.made))

    def launch(self, gate_up: torch.Tensor, h: torch.Tensor, h_scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The three launches into these buffers (``made``'s shapes and dtypes; any memory, a CUDA graph's
        capture reads and writes them where they are): out, from what x and counts hold now."""
        up_kernel, up = self._up
        up = up.copy()
        up[OUT] = gate_up
        up_kernel(*up)
        act_kernel, act = self._act
        if act_kernel is not None:
            act_kernel(gate_up, h, h_scales, *act[3:])
        down_kernel, down = self._down
        down = down.copy()
        down[0], down[1], down[OUT] = h, h_scales if self._fp8_rows else h, out
        if self._h_block is not None:
            down[A_DESC] = descriptor(h, self._h_block)
        down_kernel(*down)
        return out
