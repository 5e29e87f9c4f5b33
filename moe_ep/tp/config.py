"""What an ``AsyncTP`` is built for (``TPConfig``, checked when made) and its named symmetric buffers
(``TPBuffers``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .. import runtime
from ..kernels.matmul import FUSED_VARIANTS, SMALL_M_CANDIDATES

BACKENDS = ("nvshmem", "reference")
OVERLAP = ("auto", "fused", "chunked", "never")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The smallest BLOCK_M, BLOCK_N matmul.fused_tile_config hands out: its small-M tiles' (tile_config's are larger).
MIN_TILE = tuple(min(tile[name] for tile in SMALL_M_CANDIDATES) for name in ("BLOCK_M", "BLOCK_N"))


@dataclass
class TPConfig:
    """One process group's async-TP bounds and options; ValueError when made with one out of range.
    `overlap` and `tile_loop` may be changed between calls (the benchmarks compare the paths so)."""
    world: int
    rank: int
    max_rows: int              # M: most rows of any call (the gathered A, the un-scattered output)
    max_features: int          # F: most K of an ag_gemm call, most N of a gemm_rs or gemm_ar call
    dtype: torch.dtype         # of every operand and output
    backend: str               # BACKENDS
    overlap: str               # OVERLAP: "auto" measures, the others force a path
    timeout_s: float           # bound of every device-side wait
    tile_loop: str             # matmul.FUSED_VARIANTS: how the fused kernels load their operands

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.overlap not in OVERLAP:
            raise ValueError(f"overlap must be one of {OVERLAP}, got {self.overlap!r}")
        for name, value in (("max_rows", self.max_rows), ("max_features", self.max_features)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.max_rows * self.max_features >= 2**31:
            raise ValueError(f"max_rows * max_features = {self.max_rows * self.max_features} elements: the kernels "
                             "index buffers with 32-bit offsets, keep it under 2**31")
        if self.max_rows % self.world:
            raise ValueError(f"max_rows={self.max_rows} is not a multiple of the group size {self.world}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype}")
        runtime.check_timeout(self.timeout_s)
        if self.tile_loop not in FUSED_VARIANTS:
            raise ValueError(f"tile_loop must be one of {FUSED_VARIANTS}, got {self.tile_loop!r}")

    def check_bounds(self, op: str, m: int, name: str, features: int) -> None:
        """ValueError naming the bound that a call's M (rows, all ranks) or `name` = K (all-gather) /
        N (reduce-scatter, all-reduce) exceeds."""
        for what, value, bound in (("M", m, "max_rows"), (name, features, "max_features")):
            if value > getattr(self, bound):
                raise ValueError(f"{op}: {what}={value} exceeds this AsyncTP's {bound}={getattr(self, bound)}; "
                                 f"construct it with {bound} >= {value}")

    @property
    def timeout_ns(self) -> int:
        return int(self.timeout_s * 1e9)


@dataclass
class TPBuffers:
    """AsyncTP's symmetric buffers, one copy on every rank. W ranks, M = max_rows, F = max_features,
    T = tiles of the largest [M/W, F] shard at the smallest tile shape. Peers write into them
    (copy engine or NVLink stores) only after each call's barrier."""
    gathered: torch.Tensor     # [M * F] dtype: ag_gemm's A as [M, K], rank s's shard at rows s*M/W...; peers push
    shard_flags: torch.Tensor  # [W] i64: ag_gemm: 1 once rank s's shard has landed in `gathered`
    partials: torch.Tensor     # [M * F] dtype: gemm_rs: [W, M/W, N], rank s's partial rows for this rank;
                               # gemm_ar: [W, M', N] (M' <= M/W), slot s tile by tile rank s's partial (tiles
                               # this rank owns) or its sum (tiles rank s owns)
    tile_flags: torch.Tensor   # [W * T] i64: gemm_rs / gemm_ar: [W, tiles], 1 once rank s's tile t has landed
                               # (the chunked gemm_rs: [W], once all of rank s's partial rows have)
    arrivals: torch.Tensor     # [W] i64: the calls rank s has begun (each call's barrier counts them, bounded)
    program_arrivals: torch.Tensor   # [P, W] i64: the calls program p of rank s has begun, for the kernels that
                                     # hold their barrier per program (gemm_ar, gemm_rs over all rows)


def tp_buffers(config: TPConfig, symmetric_zeros, programs: int) -> TPBuffers:
    """TPBuffers for `config` and grids of at most `programs` programs from symmetric_zeros(shape, dtype)
    (collective)."""
    elements = config.max_rows * config.max_features
    tiles = triton.cdiv(config.max_rows // config.world, MIN_TILE[0]) * triton.cdiv(config.max_features, MIN_TILE[1])
    return TPBuffers(gathered=symmetric_zeros((elements,), config.dtype),
                     shard_flags=symmetric_zeros((config.world,), torch.int64),
                     partials=symmetric_zeros((elements,), config.dtype),
                     tile_flags=symmetric_zeros((config.world * tiles,), torch.int64),
                     arrivals=symmetric_zeros((config.world,), torch.int64),
                     program_arrivals=symmetric_zeros((programs * config.world,), torch.int64))
