"""AsyncTP: the host object that owns the async tensor-parallel buffers and launches its three ops.

    tp = AsyncTP(max_rows=16384, max_features=28672)     # collective, once per process group
    out = tp.ag_gemm(a_shard, w)      # a_shard [M/W, K], w [K, N]   -> all_gather(a_shard) @ w   [M, N]
    out = tp.gemm_rs(a, w)            # a [M, K], w [K, N]           -> reduce_scatter(a @ w)     [M/W, N]
    out = tp.gemm_ar(a, w)            # a [M, K], w [K, N]           -> all_reduce(a @ w)         [M, N]

W is the group's size; rows are sharded in rank order, as all_gather and reduce_scatter do.
w may have any strides: ``linear.weight.t()`` of an nn.Linear is fine. What the results mean is
``moe_ep.reference``'s contract (``ag_gemm``, ``gemm_rs``, ``gemm_ar``); the kernels are in
``moe_ep.kernels.ag_gemm``, ``gemm_rs`` and ``gemm_ar``, the choice of path in ``moe_ep.tp.cost``,
the autograd functions in ``moe_ep.tp.autograd``.

Each call takes one of three paths (``overlap``):
  - "fused": one persistent Triton GEMM that waits per tile for the shard it reads (all-gather)
    or stores its partial tiles straight into the peers and sums the peers' tiles into its own
    (reduce-scatter): ``moe_ep.kernels.ag_gemm`` / ``gemm_rs``, their tile loop on pointer loads
    or on TMA tensor descriptors (``tile_loop``);
  - "chunked": cuBLAS, one GEMM per shard, the shards' transfers on the copy engine in
    between; a one-warp kernel holds the stream until the shard a GEMM needs has landed;
  - "never": the plain path, NCCL collective then cuBLAS (or the reverse), nothing overlapped.
``overlap="auto"`` (the default) measures: the first call of each shape (op, M, K, N; the object
fixes dtype and group) times the candidate paths on its operands, takes each path's time on its
slowest rank (an all-reduce MAX, so that every rank picks the same path) and keeps the fastest
for every later call of that shape. The cost model (``moe_ep.tp.cost``) only orders the candidates
and leaves out the hopeless ones (on small shapes all overlapped paths: "never" is then taken untimed).
``choices`` holds each decision: the path, the times it was chosen by, and what the first call
cost. That first call synchronizes the device: make it before capturing a CUDA graph.
``backend="reference"`` runs ``moe_ep.reference`` on torch.distributed (CPU with gloo too).

``gemm_ar`` (row-parallel without sequence parallelism: decode) has two paths: "never", cuBLAS then
an NCCL all-reduce, and "fused", one persistent Triton GEMM that pushes each finished tile to every
peer and sums each tile once every peer's copy has landed (``moe_ep.kernels.gemm_ar``), for
M <= max_rows / W (it uses the reduce-scatter's buffers). "chunked" means "never" for it.

The ops are differentiable (``moe_ep.tp.autograd``): the input gradient of each of the first two is
the other op, on the same object and paths; gemm_ar's is local.

Every call of an overlapped path begins with a barrier over the group (one small kernel):
buffers are reused from call to call, and a peer may write into them only once this rank is
done with the previous call. Calls must be made in the same order on every rank.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
import triton

from .. import collectives, reference, runtime
from ..kernels import ag_gemm as ag_kernels
from ..kernels import gemm_ar as ar_kernels
from ..kernels import gemm_rs as rs_kernels
from ..kernels.matmul import (DEFAULT_VARIANT, FUSED_VARIANTS, descriptor, operand_descriptors,
                             reset_and_barrier_kernel, tile_config, wait_flag_kernel)
from ..kernels.status import TAG_AG_SHARD, TAG_RS_TILE, TAGS, TP_STATUS_WORDS
from ..timing import median_us
from .autograd import AllGatherGemm, GemmAllReduce, GemmReduceScatter
from .cost import candidate_paths, measured_choice

BACKENDS = ("nvshmem", "reference")
OVERLAP = ("auto", "fused", "chunked", "never")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)

MEASURE_WARMUP = 1        # untimed calls of each candidate (the first compiles the Triton kernels)
MEASURE_ITERS = 3         # timed calls of each candidate; the median counts

_MIN_TILE = (64, 128)     # the smallest BLOCK_M, BLOCK_N tile_config hands out


@dataclass
class TPBuffers:
    """AsyncTP's symmetric buffers, one copy on every rank. W ranks, M = max_rows, F = max_features,
    T = tiles of the largest [M/W, F] shard at the smallest tile shape. Peers write into them
    (copy engine or NVLink stores) only after each call's barrier."""
    gathered: torch.Tensor     # [M * F] dtype: ag_gemm's A as [M, K], rank s's shard at rows s*M/W...; peers push
    shard_flags: torch.Tensor  # [W] i64: ag_gemm: 1 once rank s's shard has landed in `gathered`
    partials: torch.Tensor     # [M * F] dtype: gemm_rs: [W, M/W, N], rank s's partial rows for this rank;
                               # gemm_ar: [W, M', N], rank s's whole partial (M' <= M/W)
    tile_flags: torch.Tensor   # [W * T] i64: gemm_rs / gemm_ar: [W, tiles], 1 once rank s's tile t has landed
                               # (the chunked gemm_rs: [W], once all of rank s's partial rows have)


class AsyncTP(runtime.CommObject):
    """All-gather GEMM, GEMM reduce-scatter and GEMM all-reduce over one process group (collective
    constructor).

    Args:
        max_rows: most rows M of any call (the gathered A, the un-scattered output).
        max_features: most K of an ag_gemm call and most N of a gemm_rs or gemm_ar call.
        group: the process group (NVSHMEM backend: NVSHMEM spans its ranks; one such group per process).
        dtype: dtype of every operand and output (bfloat16, float16 or float32).
        backend: "nvshmem" (Triton kernels, copy engine and NVLink) or "reference" (torch.distributed).
        overlap: "auto", "fused", "chunked" or "never" (see the module docstring).
        timeout_s: bound of every device-side wait.
        tile_loop: how the fused kernels load their operands, one of ``kernels.matmul.FUSED_VARIANTS``
            ("pointer", or "tma": tensor descriptors, which need a and w with 16-byte aligned rows).
        device: where the operands and outputs live (``EPAllToAll``'s rule: any device for the
            reference backend, this process's GPU for nvshmem).
    """

    TAGS = TAGS

    def __init__(self, max_rows: int, max_features: int, group=None, dtype: torch.dtype = torch.bfloat16,
                 backend: str = "nvshmem", overlap: str = "auto", timeout_s: float = 10.0,
                 tile_loop: str = DEFAULT_VARIANT, device: torch.device | str | None = None):
        if not dist.is_initialized():
            raise RuntimeError("AsyncTP needs torch.distributed to be initialized")
        self._configure(dist.get_world_size(group), dist.get_rank(group), max_rows, max_features, dtype, backend,
                        overlap, timeout_s, tile_loop)
        sms = self._open(group, backend, device)
        if sms is None:
            return
        self._allocate(runtime.symmetric_zeros, programs=sms)
        self._connect(lambda name, buf: [buf if r == self.rank else runtime.peer_tensor(buf, r)
                                         for r in range(self.world)])
        self._copy_stream = torch.cuda.Stream(self.device)
        runtime.barrier()

    # ------------------------------------------------------------------------------------ setup

    def _configure(self, world, rank, max_rows, max_features, dtype, backend, overlap, timeout_s,
                   tile_loop: str = DEFAULT_VARIANT) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if overlap not in OVERLAP:
            raise ValueError(f"overlap must be one of {OVERLAP}, got {overlap!r}")
        for name, value in (("max_rows", max_rows), ("max_features", max_features)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if max_rows * max_features >= 2**31:
            raise ValueError(f"max_rows * max_features = {max_rows * max_features} elements: the kernels index "
                             "buffers with 32-bit offsets, keep it under 2**31")
        if max_rows % world:
            raise ValueError(f"max_rows={max_rows} is not a multiple of the group size {world}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        if tile_loop not in FUSED_VARIANTS:
            raise ValueError(f"tile_loop must be one of {FUSED_VARIANTS}, got {tile_loop!r}")
        self.world, self.rank = world, rank
        self.max_rows, self.max_features, self.dtype = max_rows, max_features, dtype
        self.backend, self.overlap, self.timeout_s, self.tile_loop = backend, overlap, timeout_s, tile_loop
        self._symmetric: dict[str, torch.Tensor] = {}
        self.buffers: TPBuffers | None = None
        self._status: torch.Tensor | None = None
        self._broken: str | None = None
        # (op, M, K, N) -> {"path", "times_us": {path: us on the slowest rank}, "first_call_ms": host
        # time spent choosing} for overlap="auto"; filled by the first call of each shape
        self.choices: dict[tuple, dict] = {}

    def _allocate(self, symmetric_zeros, programs: int) -> None:
        """The TPBuffers from `symmetric_zeros(shape, dtype)`; `programs` is every grid's size (the same
        on every rank)."""
        W, elements = self.world, self.max_rows * self.max_features
        tiles = triton.cdiv(self.max_rows // W, _MIN_TILE[0]) * triton.cdiv(self.max_features, _MIN_TILE[1])
        self.buffers = TPBuffers(gathered=symmetric_zeros((elements,), self.dtype),
                                 shard_flags=symmetric_zeros((W,), torch.int64),
                                 partials=symmetric_zeros((elements,), self.dtype),
                                 tile_flags=symmetric_zeros((W * tiles,), torch.int64))
        self._symmetric = {f.name: getattr(self.buffers, f.name) for f in fields(TPBuffers)}
        self._programs = programs
        self._state = torch.zeros(programs, dtype=torch.int64, device=self.device)   # clock words
        self._status = torch.zeros(TP_STATUS_WORDS, dtype=torch.int32, pin_memory=self.device.type == "cuda")

    def _connect(self, peer_views) -> None:
        """`peer_views(name, buffer)` -> every rank's copy of the TPBuffers field `name` as a tensor whose
        data_ptr this rank can address (NVLink). The kernels' address tables come from them, and
        flags are raised through them; on CPU (the interpreter tests) data is copied into them."""
        self._views, self._peers = {}, {}
        for name, buf in self._symmetric.items():
            views = peer_views(name, buf)
            self._views[name] = views
            self._peers[name] = torch.tensor([v.data_ptr() for v in views], dtype=torch.int64, device=self.device)

    def _check_operands(self, op: str, a: torch.Tensor, w: torch.Tensor) -> None:
        self._expect(f"{op}: a", a, (self.dtype,), dim=2)
        self._expect(f"{op}: w", w, (self.dtype,), dim=2, contiguous=False)
        if w.numel() and max(w.stride()) * max(w.shape) >= 2**31:
            raise ValueError(f"{op}: w spans 2**31 elements or more; the kernels use 32-bit offsets")
        if a.shape[1] != w.shape[0]:
            raise ValueError(f"{op}: a is {tuple(a.shape)} and w is {tuple(w.shape)}: a's columns must equal w's rows")

    def _check_bounds(self, op: str, m: int, name: str, features: int) -> None:
        """ValueError naming the bound of the constructor that a call's M (rows, all ranks) or
        `name` = K (all-gather) / N (reduce-scatter, all-reduce) exceeds."""
        for what, value, bound in (("M", m, "max_rows"), (name, features, "max_features")):
            if value > getattr(self, bound):
                raise ValueError(f"{op}: {what}={value} exceeds this AsyncTP's {bound}={getattr(self, bound)}; "
                                 f"construct it with {bound} >= {value}")

    def _path(self, op: str, m: int, k: int, n: int, run) -> str:
        """"never", "fused" or "chunked" for this call (see the module docstring). Under overlap="auto"
        the first call of a shape runs `run(path)` (the op on this call's operands, result dropped)
        for each candidate: collective, as every call."""
        if self.backend == "reference" or m == 0 or n == 0:
            return "never"
        if self.overlap != "auto":
            return self.overlap
        key = (op, m, k, n)
        if key not in self.choices:
            start = time.perf_counter()
            candidates = candidate_paths(op, m, k, n, self.world, self.dtype.itemsize)
            path, times = "never", {}
            if len(candidates) > 1:
                path, times = measured_choice(candidates, lambda p: self._time_us(lambda: run(p)), self.group,
                                              self.device)
            self.choices[key] = {"path": path, "times_us": times,
                                 "first_call_ms": (time.perf_counter() - start) * 1e3}
        return self.choices[key]["path"]

    def _time_us(self, fn) -> float:
        return median_us(fn, MEASURE_ITERS, MEASURE_WARMUP)

    # ------------------------------------------------------------------------------------ all-gather GEMM

    def ag_gemm(self, a_shard: torch.Tensor, w: torch.Tensor, return_gathered: bool = False):
        """a_shard [M/W, K] (this rank's rows), w [K, N] -> out [M, N] (and the gathered A [M, K] if asked).

        Differentiable (``AllGatherGemm``): the gradient of a_shard is a GEMM reduce-scatter."""
        if torch.is_grad_enabled() and (a_shard.requires_grad or w.requires_grad):
            return AllGatherGemm.apply(a_shard, w, self._ag_gemm, self._gemm_rs, return_gathered)
        return self._ag_gemm(a_shard, w, return_gathered)

    def _ag_gemm(self, a_shard: torch.Tensor, w: torch.Tensor, return_gathered: bool = False):
        self._raise_if_failed()
        self._check_operands("ag_gemm", a_shard, w)
        rows, k = a_shard.shape
        m, n = rows * self.world, w.shape[1]
        self._check_bounds("ag_gemm", m, "K", k)
        path = self._path("ag_gemm", m, k, n, lambda p: self._ag_gemm_on(p, a_shard, w, False))
        return self._ag_gemm_on(path, a_shard, w, return_gathered)

    def _ag_gemm_on(self, path: str, a_shard: torch.Tensor, w: torch.Tensor, return_gathered: bool):
        rows, k = a_shard.shape
        m = rows * self.world
        if path == "never":
            return reference.ag_gemm(a_shard, w, self.group, return_gathered)
        self._start("shard_flags", self.world)
        self._ag_push(a_shard, return_gathered)
        out = (self._ag_fused if path == "fused" else self._ag_chunked)(a_shard, w)
        if self.device.type == "cuda":
            torch.cuda.current_stream().wait_stream(self._copy_stream)
        if return_gathered:
            return out, self.buffers.gathered[:m * k].view(m, k).clone()
        return out

    def _ag_push(self, a_shard: torch.Tensor, own_copy: bool) -> None:
        """Copy a_shard into every peer's `gathered` (peer r+1 first), raising its flag after each copy;
        into this rank's own too when the gathered A is wanted. On the copy engine, off the SMs."""
        rows, k = a_shard.shape
        mine = slice(self.rank * rows * k, (self.rank + 1) * rows * k)
        with self._on_copy_stream():
            for step in range(1, self.world):
                peer = (self.rank + step) % self.world
                self._put("gathered", mine, a_shard, peer)
                self._raise_flag("shard_flags", peer, self.rank)
            if own_copy:
                self.buffers.gathered[mine].view(rows, k).copy_(a_shard)

    def _ag_fused(self, a_shard: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        rows, k = a_shard.shape
        n = w.shape[1]
        out = torch.empty((rows * self.world, n), dtype=self.dtype, device=self.device)
        config = tile_config(rows, n, a_shard.element_size())
        tiles = self.world * triton.cdiv(rows, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"])
        programs = min(self._programs, tiles)
        descriptors = self._descriptors(a_shard, w, config)
        gathered = self.buffers.gathered[:self.world * rows * k].view(self.world * rows, k)
        descriptors["gathered_desc"] = (descriptor(gathered, [config["BLOCK_M"], config["BLOCK_K"]])
                                        if descriptors["TMA"] else None)
        ag_kernels.ag_gemm_kernel[(programs,)](
            a_local=a_shard, gathered=self.buffers.gathered, w=w, out=out, flags=self.buffers.shard_flags,
            state=self._state, status_addr=self._status.data_ptr(), rows=rows, N=n, K=k, rank=self.rank,
            world=self.world, timeout_ns=int(self.timeout_s * 1e9), stride_wk=w.stride(0), stride_wn=w.stride(1),
            programs=programs, EVEN_K=k % config["BLOCK_K"] == 0, **descriptors, **config)
        return out

    def _ag_chunked(self, a_shard: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """One cuBLAS GEMM per shard: the own shard first, then each shard once it has landed."""
        rows, k = a_shard.shape
        out = torch.empty((rows * self.world, w.shape[1]), dtype=self.dtype, device=self.device)
        for step in range(self.world):
            shard = (self.rank - step) % self.world
            if step == 0:
                a = a_shard
            else:
                self._wait_flag("shard_flags", shard, TAG_AG_SHARD)
                a = self.buffers.gathered[shard * rows * k:(shard + 1) * rows * k].view(rows, k)
            torch.matmul(a, w, out=out[shard * rows:(shard + 1) * rows])
        return out

    # ------------------------------------------------------------------------------------ GEMM reduce-scatter

    def gemm_rs(self, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """a [M, K] (this rank's columns of the activations), w [K, N] -> out [M/W, N] (this rank's rows
        of the sum over ranks of a @ w). The overlapped paths sum the partials in fp32; the plain
        path reduces in the dtype, as NCCL does (the same result for two ranks).

        Differentiable (``GemmReduceScatter``): the gradient of a is an all-gather GEMM."""
        if torch.is_grad_enabled() and (a.requires_grad or w.requires_grad):
            return GemmReduceScatter.apply(a, w, self._gemm_rs, self._ag_gemm)
        return self._gemm_rs(a, w)

    def _gemm_rs(self, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        self._raise_if_failed()
        self._check_operands("gemm_rs", a, w)
        m, k = a.shape
        n = w.shape[1]
        if m % self.world:
            raise ValueError(f"gemm_rs: M={m} rows cannot be scattered evenly over {self.world} ranks")
        self._check_bounds("gemm_rs", m, "N", n)
        if self.backend == "reference":
            return reference.gemm_rs(a, w, self.group)
        path = self._path("gemm_rs", m, k, n, lambda p: self._gemm_rs_on(p, a, w))
        return self._gemm_rs_on(path, a, w)

    def _gemm_rs_on(self, path: str, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        m, n = a.shape[0], w.shape[1]
        out = torch.empty((m // self.world, n), dtype=self.dtype, device=self.device)
        if path == "never":
            collectives.reduce_scatter_tensor(out, a @ w, group=self.group)
        elif path == "fused":
            config = tile_config(m // self.world, n, a.element_size())
            self._start("tile_flags", self.world * self._rs_tiles(m, n, config))
            self._rs_launch(a, w, out, config, 0, self.world)
        else:
            self._start("tile_flags", self.world)
            self._rs_send_chunked(a, w)
            self._rs_reduce_chunked(a, w, out)
        return out

    # ------------------------------------------------------------------------------------ GEMM all-reduce

    def gemm_ar(self, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """a [M, K] (this rank's columns of the activations), w [K, N] -> out [M, N], the sum over ranks
        of a @ w, the same on every rank. "fused" (M <= max_rows / W) sums the partials rounded to
        the dtype in fp32, as the reference backend does; the plain path is cuBLAS, then an NCCL
        all-reduce, which sums in the dtype.

        Differentiable (``GemmAllReduce``): the output is replicated, so the input gradient is local."""
        if torch.is_grad_enabled() and (a.requires_grad or w.requires_grad):
            return GemmAllReduce.apply(a, w, self._gemm_ar)
        return self._gemm_ar(a, w)

    def _gemm_ar(self, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        self._raise_if_failed()
        self._check_operands("gemm_ar", a, w)
        m, k = a.shape
        n = w.shape[1]
        self._check_bounds("gemm_ar", m, "N", n)
        if self.backend == "reference":
            return reference.gemm_ar(a, w, self.group)
        fits = m * self.world <= self.max_rows
        path = self._path("gemm_ar", m, k, n, lambda p: self._gemm_ar_on(p, a, w)) if fits else "never"
        return self._gemm_ar_on(path, a, w)

    def _gemm_ar_on(self, path: str, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        m, n = a.shape[0], w.shape[1]
        if path != "fused":                  # _gemm_ar takes "never" where M * W exceeds max_rows
            out = a @ w
            collectives.all_reduce(out, group=self.group)
            return out
        out = torch.empty((m, n), dtype=self.dtype, device=self.device)
        config = tile_config(m, n, a.element_size())
        self._start("tile_flags", self.world * self._ar_tiles(m, n, config))
        self._ar_launch(a, w, out, config, publish=True, reduce=True)
        return out

    def _ar_tiles(self, m: int, n: int, config: dict) -> int:
        return triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"])

    def _ar_launch(self, a, w, out, config, publish: bool, reduce: bool) -> None:
        """The GEMM all-reduce kernel: each tile's publishing half, reducing half, or both (the GPU)."""
        m, k = a.shape
        n = w.shape[1]
        programs = min(self._programs, self._ar_tiles(m, n, config))
        ar_kernels.gemm_ar_kernel[(programs,)](
            a=a, w=w, out=out, partials=self.buffers.partials, partial_peers=self._peers["partials"],
            flags=self.buffers.tile_flags, flag_peers=self._peers["tile_flags"], state=self._state,
            status_addr=self._status.data_ptr(), M=m, N=n, K=k, rank=self.rank, world=self.world,
            timeout_ns=int(self.timeout_s * 1e9), stride_am=a.stride(0), stride_wk=w.stride(0),
            stride_wn=w.stride(1), programs=programs, EVEN_K=k % config["BLOCK_K"] == 0, PUBLISH=publish,
            REDUCE=reduce, **self._descriptors(a, w, config), **config)

    def _rs_tiles(self, m: int, n: int, config: dict) -> int:
        return triton.cdiv(m // self.world, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"])

    def _rs_launch(self, a, w, out, config, step_begin: int, step_end: int) -> None:
        """The kernel over steps [step_begin, step_end) of its schedule (all of them on the GPU)."""
        m, k = a.shape
        n = w.shape[1]
        programs = min(self._programs, self.world * self._rs_tiles(m, n, config))
        rs_kernels.gemm_rs_kernel[(programs,)](
            a=a, w=w, out=out, partials=self.buffers.partials, partial_peers=self._peers["partials"],
            flags=self.buffers.tile_flags, flag_peers=self._peers["tile_flags"], state=self._state,
            status_addr=self._status.data_ptr(), rows=m // self.world, N=n, K=k, rank=self.rank, world=self.world,
            step_begin=step_begin, step_end=step_end, timeout_ns=int(self.timeout_s * 1e9), stride_am=a.stride(0),
            stride_wk=w.stride(0), stride_wn=w.stride(1), programs=programs, EVEN_K=k % config["BLOCK_K"] == 0,
            **self._descriptors(a, w, config), **config)

    def _descriptors(self, a: torch.Tensor, w: torch.Tensor, config: dict) -> dict:
        """The fused kernels' tile-loop arguments for `tile_loop`: TMA, and a's and w's descriptors
        (``matmul.operand_descriptors``) or None."""
        if self.tile_loop == "pointer":
            return dict(a_desc=None, w_desc=None, W_KMAJOR=False, TMA=False)
        return dict(operand_descriptors(a, w, config), TMA=True)

    def _rs_send_chunked(self, a: torch.Tensor, w: torch.Tensor) -> None:
        """cuBLAS computes the rows bound for each peer (rank r+1's first) and the copy engine puts
        them into that peer's `partials[rank]`, raising its flag tile_flags[rank]."""
        rows, n = a.shape[0] // self.world, w.shape[1]
        mine = slice(self.rank * rows * n, (self.rank + 1) * rows * n)
        for step in range(self.world - 1):
            dest = (self.rank + 1 + step) % self.world
            part = a[dest * rows:(dest + 1) * rows] @ w
            with self._on_copy_stream():
                self._put("partials", mine, part, dest)
                self._raise_flag("tile_flags", dest, self.rank)
            if self.device.type == "cuda":
                part.record_stream(self._copy_stream)

    def _rs_reduce_chunked(self, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        """The own rows' partial, then, once every peer's partials have landed, one fp32 pass summing them."""
        rows = a.shape[0] // self.world
        own = a[self.rank * rows:(self.rank + 1) * rows] @ w
        for src in range(self.world):
            if src != self.rank:
                self._wait_flag("tile_flags", src, TAG_RS_TILE)
        numel = out.numel()
        rs_kernels.reduce_partials_kernel[(triton.cdiv(numel, 4096),)](
            own, self.buffers.partials, out, self.rank, self.world, numel, BLOCK=4096, num_warps=8)
        if self.device.type == "cuda":
            torch.cuda.current_stream().wait_stream(self._copy_stream)

    # ------------------------------------------------------------------------------------ launching

    def _start(self, flags: str, count: int) -> None:
        """Zero this rank's first `count` flags of `flags`, then a barrier over the group (see the module)."""
        reset_and_barrier_kernel[(1,)](getattr(self.buffers, flags), count, BLOCK=1024, num_warps=4,
                                       extern_libs=runtime.device_library())

    def _wait_flag(self, name: str, peer: int, tag: int) -> None:
        """Hold the current stream until this rank's flag `name`[peer] is set (bounded, see check())."""
        wait_flag_kernel[(1,)](getattr(self.buffers, name), peer, self._state, self._status.data_ptr(),
                               int(self.timeout_s * 1e9), peer, TAG=tag, num_warps=1)

    def _on_copy_stream(self):
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        self._copy_stream.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(self._copy_stream)

    def _put(self, name: str, where: slice, src: torch.Tensor, peer: int) -> None:
        """Copy src into elements `where` of `peer`'s copy of symmetric buffer `name`, in stream order."""
        if self.device.type == "cuda":
            runtime.put_on_stream(getattr(self.buffers, name)[where], src, peer, torch.cuda.current_stream())
        else:
            self._views[name][peer][where].copy_(src.flatten())

    def _raise_flag(self, name: str, peer: int, index: int) -> None:
        """Set element `index` of `peer`'s int64 buffer `name` to 1, in stream order, after a fence."""
        if self.device.type == "cuda":
            address = self._views[name][peer].data_ptr() + 8 * index
            runtime.stream_write_value(address, 1, torch.cuda.current_stream())
        else:
            self._views[name][peer][index] = 1
