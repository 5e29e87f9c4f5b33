"""AsyncTP: the host object that owns the async tensor-parallel buffers and launches its three ops.

    tp = AsyncTP(max_rows=16384, max_features=28672)     # collective, once per process group
    out = tp.ag_gemm(a_shard, w)      # a_shard [M/W, K], w [K, N]   -> all_gather(a_shard) @ w   [M, N]
    out = tp.gemm_rs(a, w)            # a [M, K], w [K, N]           -> reduce_scatter(a @ w)     [M/W, N]
    out = tp.gemm_ar(a, w)            # a [M, K], w [K, N]           -> all_reduce(a @ w)         [M, N]

W is the group's size; rows are sharded in rank order, as all_gather and reduce_scatter do.
w may have any strides: ``linear.weight.t()`` of an nn.Linear is fine. What the results mean is
``moe_ep.reference``'s contract (``ag_gemm``, ``gemm_rs``, ``gemm_ar``); the kernels are in
``moe_ep.kernels.ag_gemm``, ``gemm_rs`` and ``gemm_ar``. The object checks the calls and picks each
call's path; the rest are units of their own: its config and named buffers (``config``), its bound
launches (``launches``), the copy-engine steps (``copy_engine``), the choice of path (``autotune`` over
the cost model of ``cost``), the autograd functions (``autograd``) and the plain path (``plain``).

Each call takes one of three paths (``overlap``):
  - "fused": one persistent Triton GEMM that waits per tile for the shard it reads (all-gather)
    or stores its partial tiles straight into the peers and sums the peers' tiles into its own
    (reduce-scatter): ``moe_ep.kernels.ag_gemm`` / ``gemm_rs``, their tile loop on pointer loads
    or on TMA tensor descriptors (``tile_loop``);
  - "chunked": cuBLAS, one GEMM per shard, the shards' transfers on the copy engine in
    between; a one-warp kernel holds the stream until the shard a GEMM needs has landed;
  - "never": the plain path, NCCL collective then cuBLAS (or the reverse), nothing overlapped.
``overlap="auto"`` (the default) measures, for eager calls and for calls captured into a CUDA graph
apart: the first call of each shape (op, M, K, N; the object fixes dtype and group) times the candidate
paths on its operands (interleaved, round after round, each a burst of ``timing.GRAPH_CALLS`` calls in a row
after a barrier, as a model makes its calls; the median of each path's bursts counts: ``autotune``), then
times them again as replays of CUDA graphs, one a path of as many calls captured on every rank (a path
whose capture failed on any rank is left out of that choice; "never" stays in it, and is taken untimed
where its own capture failed). Each choice takes
each path's time on its slowest rank (an all-reduce MAX, so that every rank picks the same path) and keeps
the fastest for every later call of that shape in its mode, "never" unless an overlapped path took at most
``cost.MARGIN`` (0.97) of its time: an eager call takes the eager times' choice, a call made while its
stream is being captured the graphs' (they differ where the host time an eager call holds hides what the
GPU does). The cost model (``cost``) only orders the candidates and leaves out the hopeless ones (on
small shapes all overlapped paths: "never" is then taken untimed, in both modes).
``choices`` holds each decision: both paths, the times each was chosen by, the captures that failed, and
what the first call cost. That first call synchronizes the device and captures graphs of its own: make it
eagerly, before capturing a CUDA graph (a captured first call of a shape with candidates to time raises
RuntimeError).
``backend="reference"`` runs the plain path on torch.distributed (CPU with gloo too), with the partials
of gemm_rs and gemm_ar summed in fp32, as ``moe_ep.reference`` states the contract.

What gemm_rs and gemm_ar sum are the ranks' partials a @ w, rounded to the dtype to cross between ranks:
"fused", "chunked" and the reference backend add them in fp32 and round the sum once; "never" reduces
them in the dtype, as NCCL does, rounding after each addition (the same result for two ranks).

``gemm_ar`` (row-parallel without sequence parallelism: decode) has two paths: "never", cuBLAS then
an NCCL all-reduce, and "fused", one persistent Triton GEMM that sends each finished tile to the rank
that owns it, which sums the tile once every peer's copy has landed and sends the sum back to all
(``moe_ep.kernels.gemm_ar``), for M <= max_rows / W (it uses the reduce-scatter's buffers). "chunked"
means "never" for it.

The ops are differentiable (``autograd``): the input gradient of each of the first two is
the other op, on the same object and paths; gemm_ar's is local.

Every call of an overlapped path begins with a barrier over the group (one small kernel, its wait
bounded by ``timeout_s``: ``kernels.matmul.reset_and_barrier_kernel``; the pipelined kernels, gemm_ar's and
gemm_rs' over all rows, hold it inside, per program: ``kernels.matmul.program_arrives``): buffers are reused
from call to call, and a peer may write into them only once this rank is done with the previous call. Calls
must be made in the same order on every rank.

So a call that one rank refuses must end on every rank. Each call's checks (dtype, device, shapes,
bounds) run before anything does, and a refusal reaches the peers as EPAllToAll's does. The reference
backend, whose calls are host collectives, first exchanges every rank's verdict on the call
(CommObject._agree, bounded by ``timeout_s``): a rank's ValueError raises CallRefusedError naming that
rank and its reason on every rank, and no rank is left inside a collective. On the nvshmem backend the
refusing rank raises its ValueError and writes which call and why into its row of every peer's refusal
board (CommObject._tell_refusal, no collective). A peer that made the call times out in its barrier (and
then in the call's own first waits, each bounded by ``timeout_s``); check(), or its next call, then raises
CallRefusedError naming the refusing rank and its reason instead of CommTimeoutError, and the object is
broken from then on, as after any timeout: build it again on every rank. The refusing rank's object is
not: its next call pairs with whichever call of the same number its peers make, the timed-out one included
(whose writes may have landed in its buffers, but for the pipelined kernels', which send nothing once their
barrier timed out), as EPAllToAll's calls do. A call that takes the path "never" waits in NCCL's collectives
instead, which no board reaches (so does overlap="auto"'s first call of a shape, whose measurement runs
between barriers of the group and ends in collectives): a peer of a rank that refused it waits until the
process group's timeout.
"""
from __future__ import annotations

from operator import attrgetter

import torch
import torch.distributed as dist

from .. import runtime
from ..kernels.matmul import DEFAULT_VARIANT, fused_tile_config
from ..kernels.status import TAGS, TP_STATUS_WORDS
from ..simulated import simulated_ranks
from . import plain
from .autograd import AllGatherGemm, GemmAllReduce, GemmReduceScatter, tracked
from .autotune import Autotuner
from .config import TPBuffers, TPConfig, tp_buffers
from .copy_engine import CopyEngine
from .launches import Launches


def _config_field(name: str, settable: bool = False) -> property:
    """An attribute that is ``config.<name>`` (read-only unless `settable`)."""
    setter = (lambda self, value: setattr(self.config, name, value)) if settable else None
    return property(attrgetter(f"config.{name}"), setter, doc=f"``config.{name}``")


PASSED_KINDS = 4096    # the most kinds of operands an AsyncTP remembers as having passed its checks
                       # (``AsyncTP._checked``): all forgotten when full, as a server's ever new M would fill it


class AsyncTP(runtime.CommObject):
    """All-gather GEMM, GEMM reduce-scatter and GEMM all-reduce over one process group (collective
    constructor: a bad argument on one rank raises CallRefusedError naming it on every rank, and ranks
    built with different bounds, dtype, backend, overlap or tile loop raise a ValueError naming them).

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
    CALLS = ("ag_gemm", "gemm_rs", "gemm_ar")     # the calls a refusal note names (CommObject._tell_refusal)
    world, rank, backend = _config_field("world"), _config_field("rank"), _config_field("backend")
    max_rows, max_features = _config_field("max_rows"), _config_field("max_features")
    dtype, timeout_s = _config_field("dtype"), _config_field("timeout_s")
    overlap, tile_loop = _config_field("overlap", settable=True), _config_field("tile_loop", settable=True)

    def __init__(self, max_rows: int, max_features: int, group=None, dtype: torch.dtype = torch.bfloat16,
                 backend: str = "nvshmem", overlap: str = "auto", timeout_s: float = 10.0,
                 tile_loop: str = DEFAULT_VARIANT, device: torch.device | str | None = None):
        if not dist.is_initialized():
            raise RuntimeError("AsyncTP needs torch.distributed to be initialized")
        rank = dist.get_rank(group)
        settings = dict(max_rows=max_rows, max_features=max_features, dtype=dtype, backend=backend, overlap=overlap,
                        tile_loop=tile_loop)
        self._configure_on_every_rank(
            "AsyncTP", lambda: self._configure(TPConfig(dist.get_world_size(group), rank, max_rows, max_features, dtype,
                                                        backend, overlap, timeout_s, tile_loop)),
            settings, group, backend, device)
        sms = self._open(group, backend, device)
        self.tuner = Autotuner(self.config, group, self.device)
        if sms is None:
            return
        self._build(runtime.symmetric_zeros, sms)
        self._open_refusals(runtime.symmetric_zeros, runtime.put_on_stream)
        self._connect(lambda name, buf: [buf if r == rank else runtime.peer_tensor(buf, r) for r in range(self.world)],
                      torch.cuda.Stream(self.device))
        runtime.barrier()

    @classmethod
    def simulated(cls, world: int, max_rows: int, max_features: int, dtype: torch.dtype = torch.float32,
                  overlap: str = "fused", timeout_s: float = 5.0, tile_loop: str = DEFAULT_VARIANT,
                  programs: int = 3) -> list[AsyncTP]:
        """Every rank of a `world` in this process, on the CPU, without torch.distributed or NVSHMEM: the
        symmetric buffers are plain tensors (``simulated.simulated_ranks``), a rank's peer views the other ranks'
        tensors, and copies and flags are made by the host. Under the Triton interpreter the kernels run for
        real, one program at a time: run each phase of a call (pushes and sends, then the waiting GEMMs) on
        every rank in turn. A call through the public methods begins with its barrier, which waits for every
        rank to begin the call: in one process it times out unless the peers' barriers ran before."""

        def build(tp, rank, symmetric_zeros):
            tp._configure(TPConfig(world, rank, max_rows, max_features, dtype, "nvshmem", overlap, timeout_s,
                                   tile_loop))
            tp.tuner = Autotuner(tp.config, None, tp.device)
            tp._build(symmetric_zeros, programs)

        ranks = simulated_ranks(cls, world, build)
        for tp in ranks:
            tp._connect(lambda name, buf: [other._symmetric[name] for other in ranks], None)
        return ranks

    # ------------------------------------------------------------------------------------ setup

    def _configure(self, config: TPConfig) -> None:
        self.config = config
        self.buffers: TPBuffers | None = None
        self._symmetric: dict[str, torch.Tensor] = {}
        self._watch_status(None)
        self._broken: str | None = None
        self._made = dict.fromkeys(self.CALLS, 0)     # calls of each op accepted so far
        self._passed: dict[tuple, tuple[int, int, int]] = {}   # a kind of operands that passed -> (M, K, N)

    def _build(self, symmetric_zeros, programs: int) -> None:
        """The TPBuffers from `symmetric_zeros(shape, dtype)`, the clock words of `programs` programs (every
        grid's bound, the same on every rank) and the status words."""
        self.buffers = tp_buffers(self.config, symmetric_zeros, programs)
        self._symmetric = dict(vars(self.buffers))
        self._programs = programs
        self._state = torch.zeros(programs, dtype=torch.int64, device=self.device)   # clock words
        self._watch_status(torch.zeros(TP_STATUS_WORDS, dtype=torch.int32, pin_memory=self.device.type == "cuda"))

    def _connect(self, peer_views, copy_stream: torch.cuda.Stream | None) -> None:
        """The launches and the copy-engine steps. `peer_views(name, buffer)` -> every rank's copy of the
        TPBuffers field `name` as a tensor this rank can address (NVLink); the kernels' address tables come
        from them, and the copy engine writes through them."""
        views = {name: peer_views(name, buf) for name, buf in vars(self.buffers).items()}
        peers = {name: torch.tensor([v.data_ptr() for v in copies], dtype=torch.int64, device=self.device)
                 for name, copies in views.items()}
        self.launches = Launches(self.config, self.buffers, peers, self._state, self._status, self._programs)
        self.copies = CopyEngine(self.config, self.buffers, views, self.launches, copy_stream)

    @property
    def choices(self) -> dict[tuple, dict]:
        """overlap="auto"'s decisions per shape (``autotune.Autotuner.choices``): "path", the path of eager
        calls, and "graph_path", that of calls captured into a CUDA graph, each with the times it was chosen by
        ("times_us", "graph_times_us"), the paths whose capture failed ("graph_failed") and "first_call_ms"."""
        return self.tuner.choices

    def _calls(self) -> dict[str, int]:
        return self._made

    def _checked(self, op: str, a: torch.Tensor, w: torch.Tensor) -> tuple[int, int, int]:
        """What an earlier call left (a timeout) raised, then the checks of this call's operands, before
        anything runs (``CommObject._check_call``: every rank's verdict agreed on the reference backend, a
        refusal told to the peers on nvshmem); counts the call; (M, K, N) of the call's [M, K] @ [K, N], M
        over all ranks. On nvshmem a call whose operands are of a kind that passed before (the op, a's and w's
        shapes, dtypes, devices and strides: everything the checks read, a's contiguity as its strides, which
        the key's other reads make cheaper to take than is_contiguous() where caches are cold) takes their
        verdict from ``_passed``, in half the host time of the checks; what an earlier call left is raised all
        the same. Here and in the ops, what runs in every call reads config's fields, not the properties that
        read them (0.03 us each)."""
        if self.config.backend == "reference":          # every call's verdict agreed on by every rank
            sizes = self._check_call(op, self._check_operands, op, a, w, agreed=True)
        else:
            try:
                kind = op, a.shape, w.shape, a.dtype, w.dtype, a.device, w.device, a.stride(), w.stride()
                sizes = self._passed.get(kind)
            except (AttributeError, TypeError):     # a or w is not a tensor: the checks say so
                kind = sizes = None
            if sizes is not None:
                self._raise_if_failed()
            else:
                sizes = self._check_call(op, self._check_operands, op, a, w, agreed=False)
                if kind is not None:
                    if len(self._passed) == PASSED_KINDS:
                        self._passed.clear()
                    self._passed[kind] = sizes
        self._made[op] += 1
        return sizes

    def _operands_pass(self, op: str, a, w) -> tuple[int, int, int] | None:
        """(M, K, N) if every check of _check_each_operand passes, in one expression, else None: the common
        case at half the host time of the checks that name what is wrong (at decode sizes a call's host
        time before its first launch shows in its time), for operands of a kind ``_checked`` has not seen
        pass."""
        try:
            c, device = self.config, self.device
            (m, k), (k_w, n) = a.shape, w.shape
            m *= c.world if op == "ag_gemm" else 1
            passes = (a.dtype == c.dtype and w.dtype == c.dtype and a.device == device and w.device == device
                      and a.is_contiguous() and k == k_w and m <= c.max_rows
                      and (k if op == "ag_gemm" else n) <= c.max_features and (op != "gemm_rs" or m % c.world == 0)
                      and max(w.stride()) * max(k_w, n) < 2**31)
            return (m, k, n) if passes else None
        except (AttributeError, TypeError, ValueError):
            return None

    def _check_operands(self, op: str, a: torch.Tensor, w: torch.Tensor) -> tuple[int, int, int]:
        """ValueError unless `op`'s a and w are 2-D operands of this object's dtype and device whose
        product fits its bounds; (M, K, N) of the call's [M, K] @ [K, N], M over all ranks (ag_gemm's a is
        this rank's shard of them)."""
        return self._operands_pass(op, a, w) or self._check_each_operand(op, a, w)

    def _check_each_operand(self, op: str, a: torch.Tensor, w: torch.Tensor) -> tuple[int, int, int]:
        """_check_operands one check at a time, each with its own ValueError."""
        self._expect(f"{op}: a", a, (self.dtype,), dim=2)
        self._expect(f"{op}: w", w, (self.dtype,), dim=2, contiguous=False)
        if w.numel() and max(w.stride()) * max(w.shape) >= 2**31:
            raise ValueError(f"{op}: w spans 2**31 elements or more; the kernels use 32-bit offsets")
        if a.shape[1] != w.shape[0]:
            raise ValueError(f"{op}: a is {tuple(a.shape)} and w is {tuple(w.shape)}: a's columns must equal w's rows")
        (m, k), n = a.shape, w.shape[1]
        if op == "ag_gemm":
            m *= self.world
        if op == "gemm_rs" and m % self.world:
            raise ValueError(f"gemm_rs: M={m} rows cannot be scattered evenly over {self.world} ranks")
        self.config.check_bounds(op, m, *(("K", k) if op == "ag_gemm" else ("N", n)))
        return m, k, n

    # ------------------------------------------------------------------------------------ all-gather GEMM

    def ag_gemm(self, a_shard: torch.Tensor, w: torch.Tensor, return_gathered: bool = False):
        """a_shard [M/W, K] (this rank's rows), w [K, N] -> out [M, N] (and the gathered A [M, K] if asked).

        Differentiable (``AllGatherGemm``): the gradient of a_shard is a GEMM reduce-scatter."""
        if tracked(a_shard, w):
            return AllGatherGemm.apply(a_shard, w, self._ag_gemm, self._gemm_rs, return_gathered)
        return self._ag_gemm(a_shard, w, return_gathered)

    def _ag_gemm(self, a_shard: torch.Tensor, w: torch.Tensor, return_gathered: bool = False):
        m, k, n = self._checked("ag_gemm", a_shard, w)
        if self.config.backend == "reference":
            return plain.ag_gemm(a_shard, w, self.group, return_gathered)
        path = self.tuner.path("ag_gemm", m, k, n, lambda p: self._ag_gemm_on(p, a_shard, w, False))
        return self._ag_gemm_on(path, a_shard, w, return_gathered)

    def _ag_gemm_on(self, path: str, a_shard: torch.Tensor, w: torch.Tensor, return_gathered: bool):
        if path == "never":
            return plain.ag_gemm(a_shard, w, self.group, return_gathered)
        # The GPU's first work, the own shard's tiles or GEMM, is queued before the pushes, whose host calls
        # (a copy and a flag per peer) would otherwise hold it back; the pushes still start at the barrier.
        self.launches.reset("shard_flags", self.world)
        start = self.copies.fork()
        out = self.launches.ag_gemm(a_shard, w) if path == "fused" else self.copies.ag_gemm_own(a_shard, w)
        self.copies.push_shard(a_shard, return_gathered, start)
        if path == "chunked":
            self.copies.ag_gemm_peers(a_shard, w, out)
        self.copies.join()
        if return_gathered:
            m, k = a_shard.shape[0] * self.world, a_shard.shape[1]
            return out, self.buffers.gathered[:m * k].view(m, k).clone()
        return out

    # ------------------------------------------------------------------------------------ GEMM reduce-scatter

    def gemm_rs(self, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """a [M, K] (this rank's columns of the activations), w [K, N] -> out [M/W, N] (this rank's rows
        of the sum over ranks of a @ w). "fused", "chunked" and the reference backend sum the partials in
        fp32; "never" reduces them in the dtype, as NCCL does (the same result for two ranks).

        Differentiable (``GemmReduceScatter``): the gradient of a is an all-gather GEMM."""
        if tracked(a, w):
            return GemmReduceScatter.apply(a, w, self._gemm_rs, self._ag_gemm)
        return self._gemm_rs(a, w)

    def _gemm_rs(self, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        m, k, n = self._checked("gemm_rs", a, w)
        if self.config.backend == "reference":
            return plain.gemm_rs(a, w, self.group, sum_dtype=torch.float32)
        path = self.tuner.path("gemm_rs", m, k, n, lambda p: self._gemm_rs_on(p, a, w))
        return self._gemm_rs_on(path, a, w)

    def _gemm_rs_on(self, path: str, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if path == "never":
            return plain.gemm_rs(a, w, self.group)
        m, n = a.shape[0], w.shape[1]
        out = torch.empty((m // self.world, n), dtype=self.dtype, device=self.device)
        if path == "fused":
            config = self.launches.rs_rows(m, n, a.element_size())
            if config is not None:          # small M: tiles over all rows, the weights read once
                self.launches.gemm_rs_rows(a, w, out, config)
                return out
            config = fused_tile_config(m // self.world, n, a.element_size(), self.launches.programs, self.world)
            self.launches.reset("tile_flags", self.world * self.launches.rs_tiles(m, n, config))
            self.launches.gemm_rs(a, w, out, config, 0, self.world)
        else:
            self.launches.reset("tile_flags", self.world)
            self.copies.rs_send(a, w)
            self.copies.rs_reduce(a, w, out)
        return out

    # ------------------------------------------------------------------------------------ GEMM all-reduce

    def gemm_ar(self, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """a [M, K] (this rank's columns of the activations), w [K, N] -> out [M, N], the sum over ranks
        of a @ w, the same on every rank. "fused" (M <= max_rows / W) sums the partials rounded to
        the dtype in fp32, as the reference backend does; "never" is cuBLAS, then an NCCL all-reduce,
        which sums in the dtype (the same result for two ranks).

        Differentiable (``GemmAllReduce``): the output is replicated, so the input gradient is local."""
        if tracked(a, w):
            return GemmAllReduce.apply(a, w, self._gemm_ar)
        return self._gemm_ar(a, w)

    def _gemm_ar(self, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        m, k, n = self._checked("gemm_ar", a, w)
        c = self.config
        if c.backend == "reference":
            return plain.gemm_ar(a, w, self.group, sum_dtype=torch.float32)
        fits = m * c.world <= c.max_rows
        path = self.tuner.path("gemm_ar", m, k, n, lambda p: self._gemm_ar_on(p, a, w)) if fits else "never"
        return self._gemm_ar_on(path, a, w)

    def _gemm_ar_on(self, path: str, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if path != "fused":                  # _gemm_ar takes "never" where M * W exceeds max_rows
            return plain.gemm_ar(a, w, self.group)
        m, n = a.shape[0], w.shape[1]
        out = torch.empty((m, n), dtype=self.dtype, device=self.device)
        self.launches.gemm_ar(a, w, out, fused_tile_config(m, n, a.element_size(), self.launches.programs))
        return out
