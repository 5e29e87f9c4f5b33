"""AsyncTP's kernel launches, each through a ``launcher.BoundKernel``: the fused GEMMs (``ag_gemm``,
``gemm_rs``, ``gemm_ar``), the per-call flag reset with its barrier, the wait that holds a stream on a
flag, and the chunked reduce-scatter's sum.

What never changes for an object (its buffers, peer tables, clock and status words, rank, timeout) is
bound once; a fused GEMM's tile shapes, grid and flags (``fused_tile_config``, the tile count, TMA) are
bound once per combination, kept in `bound`; the operands, their sizes and strides (and their tensor
descriptors, with TMA) are what a call passes.
"""
from __future__ import annotations

import torch

from ..kernels.ag_gemm import ag_gemm_kernel
from ..kernels.gemm_ar import gemm_ar_kernel
from ..kernels.gemm_rs import gemm_rs_kernel, gemm_rs_rows_kernel, reduce_partials_kernel
from ..kernels.matmul import (descriptor, fused_tile_config, loads_through_descriptors, operand_descriptors,
                              reset_and_barrier_kernel, tile_count, wait_flag_kernel, weight_rows)
from ..kernels.status import TAG_AG_SHARD, TAG_RS_TILE
from ..launcher import BoundKernel, cdiv, next_power_of_2
from .config import TPBuffers, TPConfig

REDUCE_BLOCK = 4096       # elements per program of the chunked reduce-scatter's sum: 8 warps, 16 a thread
RESET_BLOCK = 1024        # flags zeroed per step of the reset kernel's loop
DESCRIPTORS = {ag_gemm_kernel: ("a_desc", "gathered_desc", "w_desc"), gemm_rs_kernel: ("a_desc", "w_desc"),
               gemm_rs_rows_kernel: ("a_desc", "w_desc"), gemm_ar_kernel: ("a_desc", "w_desc")}
# what a call of each fused kernel passes (with TMA, the descriptors too)
VARYING = {ag_gemm_kernel: ("a_local", "w", "out", "rows", "N", "K", "stride_wk", "stride_wn"),
           gemm_rs_kernel: ("a", "w", "out", "rows", "N", "K", "step_begin", "step_end", "stride_am", "stride_wk",
                            "stride_wn"),
           **dict.fromkeys((gemm_rs_rows_kernel, gemm_ar_kernel),
                           ("a", "w", "out", "M", "N", "K", "step_begin", "step_end", "stride_am", "stride_wk",
                            "stride_wn"))}


class Launches:
    """The launches of one AsyncTP, on `programs` programs at most (the same on every rank).

    state: [programs] int64 clock words of the bounded waits; status: the int32 status words;
    peers: name -> int64 [W] every rank's address of that TPBuffers field."""

    def __init__(self, config: TPConfig, buffers: TPBuffers, peers: dict[str, torch.Tensor], state: torch.Tensor,
                 status: torch.Tensor, programs: int):
        self.config, self.buffers, self.programs = config, buffers, programs
        waits = dict(state=state, status_addr=status.data_ptr(), timeout_ns=config.timeout_ns)
        pipelined = dict(partials=buffers.partials, partial_peers=peers["partials"], flags=buffers.tile_flags,
                         flag_peers=peers["tile_flags"], arrivals=buffers.program_arrivals,
                         arrival_peers=peers["program_arrivals"], WORLD_PAD=next_power_of_2(config.world), **waits)
        self._fixed = {
            ag_gemm_kernel: dict(gathered=buffers.gathered, flags=buffers.shard_flags, **waits),
            gemm_rs_kernel: dict(partials=buffers.partials, partial_peers=peers["partials"],
                                 flags=buffers.tile_flags, flag_peers=peers["tile_flags"], **waits),
            gemm_rs_rows_kernel: pipelined,
            gemm_ar_kernel: pipelined}
        for fixed in self._fixed.values():
            fixed.update(rank=config.rank, world=config.world)
        self._wait = {name: BoundKernel(wait_flag_kernel, 1, ("index", "peer"), flags=getattr(buffers, name), TAG=tag,
                                        num_warps=1, **waits)
                      for name, tag in (("shard_flags", TAG_AG_SHARD), ("tile_flags", TAG_RS_TILE))}
        self._reset = {name: BoundKernel(reset_and_barrier_kernel, 1, ("count",), flags=getattr(buffers, name),
                                         arrivals=buffers.arrivals, arrival_peers=peers["arrivals"], rank=config.rank,
                                         world=config.world, BLOCK=RESET_BLOCK,
                                         WORLD_PAD=next_power_of_2(config.world), num_warps=4, **waits)
                       for name in ("shard_flags", "tile_flags")}
        self.bound: dict[tuple, BoundKernel] = {}
        self._descriptors: dict[tuple, object] = {}       # (rows, K, BLOCK_M, BLOCK_K) -> the gathered A's

    # ------------------------------------------------------------------------------------ fused GEMMs

    def ag_gemm(self, a_shard: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """out [W * rows, N] = the gathered A @ w, A's shards read as their flags rise (``ag_gemm_kernel``)."""
        c = self.config
        rows, k = a_shard.shape
        n = w.shape[1]
        out = torch.empty((rows * c.world, n), dtype=c.dtype, device=a_shard.device)
        config = fused_tile_config(rows, n, a_shard.element_size(), self.programs, c.world)
        tiles = tile_count(rows, n, config, c.world)
        tma, descriptors = self._loads(a_shard, w, config)
        if tma:                     # the gathered A's between a's and w's
            descriptors = (descriptors[0], self._gathered_descriptor(rows, k, config), descriptors[1])
        self._kernel(ag_gemm_kernel, tiles, config, k, w, tma)(a_shard, w, out, rows, n, k, w.stride(0),
                                                                w.stride(1), *descriptors)
        return out

    def _gathered_descriptor(self, rows: int, k: int, config: dict):
        """The tensor descriptor of the gathered A [W * rows, K] in the tiles' boxes, made once per shape: it
        spans a buffer of this object, and two tensor views and a descriptor cost an eager call tens of us on
        the GPU hosts' cold caches."""
        key = (rows, k, config["BLOCK_M"], config["BLOCK_K"])
        made = self._descriptors.get(key)
        if made is None:
            gathered = self.buffers.gathered[:self.config.world * rows * k].view(self.config.world * rows, k)
            made = self._descriptors[key] = descriptor(gathered, [config["BLOCK_M"], config["BLOCK_K"]])
        return made

    def gemm_rs(self, a, w, out, config: dict, step_begin: int, step_end: int) -> None:
        """The GEMM reduce-scatter kernel over steps [step_begin, step_end) of its schedule (all of them
        on the GPU) into out [M/W, N]."""
        (m, k), n, world = a.shape, w.shape[1], self.config.world
        tiles = world * self.rs_tiles(m, n, config)
        tma, descriptors = self._loads(a, w, config)
        self._kernel(gemm_rs_kernel, tiles, config, k, w, tma)(a, w, out, m // world, n, k, step_begin, step_end,
                                                                a.stride(0), w.stride(0), w.stride(1), *descriptors)

    def gemm_rs_rows(self, a, w, out, config: dict, step_begin: int = 0, step_end: int | None = None) -> None:
        """The GEMM reduce-scatter kernel with tiles over all M rows (``rs_rows``' tiles) into out [M/W, N] over
        steps [step_begin, step_end) of its pipeline (None: to the end; all of them on the GPU:
        ``gemm_rs_rows_kernel``)."""
        self._pipelined(gemm_rs_rows_kernel, a, w, out, config, step_begin, step_end, 2)

    def gemm_ar(self, a, w, out, config: dict, step_begin: int = 0, step_end: int | None = None) -> None:
        """The GEMM all-reduce kernel into out [M, N] over steps [step_begin, step_end) of its pipeline (None:
        to the end; all of them on the GPU: ``gemm_ar_kernel``)."""
        self._pipelined(gemm_ar_kernel, a, w, out, config, step_begin, step_end, 3)

    def _pipelined(self, fn, a, w, out, config: dict, step_begin: int, step_end: int | None, more: int) -> None:
        """A pipelined kernel over all M rows (gemm_ar's, gemm_rs_rows'), steps [step_begin, step_end): its
        barrier's arrival, then a step per tile of a program, `more` - 1 after them. No reset kernel before
        it: it holds its barrier per program (``matmul.program_arrives``)."""
        (m, k), n = a.shape, w.shape[1]
        tma, descriptors = self._loads(a, w, config)
        tiles = self.all_rows_tiles(m, n, config)
        if step_end is None:
            step_end = self.steps(tiles, more)
        kernel = self._kernel(fn, tiles, config, k, w, tma)
        kernel(a, w, out, m, n, k, step_begin, step_end, a.stride(0), w.stride(0), w.stride(1), *descriptors)

    def rs_rows(self, m: int, n: int, element_size: int) -> dict | None:
        """The tiles of gemm_rs over all M rows (``gemm_rs_rows``): fused_tile_config's for M rows, where a
        tile is taller than a rank's M / W rows (tiles over one rank's rows would read the weights once per
        rank) and their flags fit in tile_flags; None where gemm_rs takes tiles over each rank's rows."""
        config, world = fused_tile_config(m, n, element_size, self.programs), self.config.world
        flags = world * self.all_rows_tiles(m, n, config)
        return config if config["BLOCK_M"] > m // world and flags <= self.buffers.tile_flags.numel() else None

    def rs_tiles(self, m: int, n: int, config: dict) -> int:
        """The tiles of one rank's M / W rows of gemm_rs' [M, N] (``gemm_rs``)."""
        return tile_count(m // self.config.world, n, config)

    def all_rows_tiles(self, m: int, n: int, config: dict) -> int:
        """The tiles of [M, N] (gemm_ar's, gemm_rs_rows')."""
        return tile_count(m, n, config)

    def steps(self, tiles: int, more: int) -> int:
        """The steps of a pipeline over `tiles` tiles: its programs' most tiles, plus `more` (gemm_ar: 3, the
        barrier's arrival and the last tiles' sums and gathers; gemm_rs_rows: 2, the arrival and the last sums)."""
        return cdiv(tiles, self.grid(tiles)) + more

    def grid(self, tiles: int) -> int:
        """The programs of a fused GEMM over `tiles` tiles: one a tile, at most `programs`."""
        return min(self.programs, tiles)

    def _kernel(self, fn, tiles: int, config: dict, k: int, w: torch.Tensor, tma: bool) -> BoundKernel:
        """`fn` bound for this call's grid (tiles, at most `programs`), tile shapes, loads (tma: through
        descriptors, ``matmul.loads_through_descriptors``)."""
        programs = self.grid(tiles)
        kmajor = tma and weight_rows(w)[1]
        even_k = k % config["BLOCK_K"] == 0
        key = (fn, programs, even_k, tma, kmajor, *config.values())
        kernel = self.bound.get(key)
        if kernel is None:
            descriptors = DESCRIPTORS[fn]
            kernel = self.bound[key] = BoundKernel(
                fn, programs, VARYING[fn] + (descriptors if tma else ()), programs=programs, EVEN_K=even_k, TMA=tma,
                W_KMAJOR=kmajor, **({} if tma else dict.fromkeys(descriptors)), **config, **self._fixed[fn])
        return kernel

    def _loads(self, a: torch.Tensor, w: torch.Tensor, config: dict) -> tuple[bool, tuple]:
        """How this call's tile loop loads a and w: (TMA, the descriptors it passes), TMA where `tile_loop`
        asks for it and TMA can address both (``matmul.loads_through_descriptors``), else (False, ())."""
        if not loads_through_descriptors(self.config.tile_loop, a, w):
            return False, ()
        descriptors = operand_descriptors(a, w, config)
        return True, (descriptors["a_desc"], descriptors["w_desc"])

    # ------------------------------------------------------------------------------------ flags

    def reset(self, name: str, count: int) -> None:
        """Zero this rank's first `count` flags of the TPBuffers field `name`, then a barrier over the group,
        bounded by timeout_s (``reset_and_barrier_kernel``)."""
        self._reset[name](count)

    def wait_flag(self, name: str, peer: int) -> None:
        """Hold the current stream until this rank's flag `name`[peer] is set (bounded)."""
        self._wait[name](peer, peer)

    def reduce_partials(self, own: torch.Tensor, out: torch.Tensor) -> None:
        """out = own + the peers' partials of the chunked reduce-scatter, in fp32 (``reduce_partials_kernel``)."""
        numel = out.numel()
        grid = cdiv(numel, REDUCE_BLOCK)
        kernel = self.bound.get((reduce_partials_kernel, grid))
        if kernel is None:
            kernel = self.bound[reduce_partials_kernel, grid] = BoundKernel(
                reduce_partials_kernel, grid, ("own", "out", "numel"), partials=self.buffers.partials,
                rank=self.config.rank, world=self.config.world, BLOCK=REDUCE_BLOCK, num_warps=8)
        kernel(own, out, numel)
