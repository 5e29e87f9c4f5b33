"""EPAllToAll: the host object that owns expert-parallel buffers and launches dispatch/combine.

    ep = EPAllToAll(max_tokens=128, hidden=7168, num_experts=256, topk=8)   # collective
    recv_x, recv_scales, recv_count, handle = ep.dispatch(x, topk_ids, topk_weights)
    expert_out = my_experts(recv_x, recv_scales, recv_count)                # [E_loc, W*T_max, H] bf16
    y = ep.combine(expert_out, handle)                                      # [T, H]
    ep.destroy()                                                            # collective

What the tensors mean is ``moe_ep.reference``'s contract; the kernels and their protocol are in
``moe_ep.kernels.all_to_all``. Results of a dispatch are views into buffers of one of two
slots (double buffering): they stay valid until the dispatch after next. With
``return_recv_hook=True`` dispatch and combine return after issuing the sends, together
with a callable that launches the receive: run compute in between, call the hook, and only
then read the outputs. At most two dispatches (and two combines) may be in flight.

No call waits for the GPU. Dispatch and combine can be captured in a CUDA graph: the call
counts the signals depend on live on the device. Expert ids are range-checked by the dispatch
kernel itself (``validate=True``): an id outside [-1, E) is dropped like -1, and the next call
(or ``check()``) raises a ValueError naming the call that saw it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist
import triton

from . import reference, runtime
from .kernels import all_to_all as kernels
from .launcher import BoundKernel
from .shmem import INTERPRETING

BACKENDS = ("nvshmem", "reference")
MAX_TOPK = 16
SLOTS = kernels.NUM_SLOTS
# Programs (of 4 warps) per SM: as many as the registers allow (ptxas for sm_90: dispatch_send needs 96
# per thread, so 5 fit; the others 38-48, so 8 fit with room), so that the grid-stride loops keep enough
# rows in flight to cover HBM and NVLink latency.
PROGRAMS_PER_SM = {"dispatch_send": 5, "dispatch_recv": 8, "combine_send": 8, "combine_recv": 8}
CHUNK_COLUMNS = 2048         # columns per dispatch work item: 2048 bf16 = 4 KiB, 32 B per thread of 4 warps
COMBINE_COLUMNS = 1024       # columns per combine work item: k rows of 1024 are loaded at once, in fp32 then
LAYOUT_IDS = 2048            # at most this many topk ids per layout step (one cumsum per expert)
LAYOUT_TILE = 2048           # ids x experts compared per layout step: 16 per thread of 4 warps (a larger tile
                             # costs dispatch_send registers: 127 at 4096)


@dataclass
class DispatchBuffers:
    """Dispatch's buffers. S = SLOTS, W ranks, T = max_tokens, H = hidden, K = topk, G = H / fp8_group
    scale groups, E_loc local experts, R = W * T rows per local expert. Row block [slot, src] of a
    symmetric buffer is written by rank src's dispatch_send through a peer pointer."""
    # symmetric (the peer table rows, kernels.DISPATCH_PEERS)
    data: torch.Tensor         # [S, W, T, H] fp8 or dtype: each source's token rows; dispatch_recv reads them
    scales: torch.Tensor       # [S, W, T, G] f32: their FP8 scales
    ids: torch.Tensor          # [S, W, T, K] i32: each source token's expert ids (sent to every rank)
    weights: torch.Tensor      # [S, W, T, K] f32: their weights (sent to the ranks the token goes to)
    positions: torch.Tensor    # [S, W, T, K] i32: hit (t, k)'s place among the source's rows for its expert
    counts: torch.Tensor       # [S, W, E_loc] i32: the source's rows per local expert (layout programs)
    tokens: torch.Tensor       # [S, W] i32: how many tokens the source sent
    arrived: torch.Tensor      # [S, W] i64: calls whose rows from each source have landed (dispatch_recv waits)
    freed: torch.Tensor        # [S, W] i64: calls whose rows each receiver has read out (dispatch_send waits)
    # local: dispatch_recv writes; the experts and combine_send read
    recv_x: torch.Tensor       # [S, E_loc, R, H]: rows per local expert, in (source, token, k) order
    recv_scales: torch.Tensor  # [S, E_loc, R, G] f32
    recv_count: torch.Tensor   # [S, E_loc] i32: valid rows per local expert
    recv_src: torch.Tensor     # [S, E_loc, R] i32: (source * T + t) * K + k of each row
    kept_ids: torch.Tensor     # [S, W, T, K] i32: the received ids, for combine_send
    kept_weights: torch.Tensor  # [S, W, T, K] f32: the received weights (0 for other ranks' experts)
    kept_rows: torch.Tensor    # [S, W, T, K] i32: the row of each local hit in recv_x (-1: not local)
    kept_tokens: torch.Tensor  # [S, W] i32: tokens each source sent


@dataclass
class CombineBuffers:
    """Combine's buffers (S, W, T, H as for dispatch). Row block [slot, r] of `data` is written by
    expert rank r's combine_send through a peer pointer."""
    data: torch.Tensor         # [S, W, T, H] dtype: rank r's sum over its experts of w * y per token
    arrived: torch.Tensor      # [S, W] i64: calls whose rows from each expert rank have landed (combine_recv waits)
    freed: torch.Tensor        # [S, W] i64: calls whose rows each source has read out (combine_send waits)


@dataclass
class EPHandle:
    """Where each received row came from, and what combine needs. Valid until the dispatch after next."""
    slot: int
    call: int
    num_tokens: int
    topk_ids: torch.Tensor                 # the source's own [T, K] ids (combine reads them)
    recv_src: torch.Tensor                 # [E_loc, W * T_max] int32: (src * T_max + t) * K + k
    received: bool = False
    reference: reference.ReferenceHandle | None = field(default=None, repr=False)


class EPAllToAll(runtime.CommObject):
    """Expert-parallel dispatch/combine for one MoE layer shape (collective constructor).

    Args:
        max_tokens: most tokens any rank passes to one dispatch.
        hidden: H; a multiple of ``fp8_group`` with FP8 dispatch, of 8 without.
        num_experts: E, a multiple of the world size; rank r owns experts [r*E/W, (r+1)*E/W).
        topk: K, 1..16.
        group: the process group (NVSHMEM backend: NVSHMEM spans its ranks; one such group per process).
        dtype: dtype of x, of expert_out and of combine's output.
        fp8_dispatch: quantize tokens to FP8 e4m3 (per ``fp8_group`` columns) inside dispatch.
        backend: "nvshmem" (Triton kernels over NVLink) or "reference" (torch.distributed).
        timeout_s: bound of every device-side wait.
        validate: range-check topk_ids on the device (reported by the next call or check()).
        timing: record per-phase device timestamps of every call, for ``breakdown()``.
    """

    TAGS = kernels.TAGS

    def __init__(self, max_tokens: int, hidden: int, num_experts: int, topk: int, group=None,
                 dtype: torch.dtype = torch.bfloat16, fp8_dispatch: bool = True, fp8_group: int = 128,
                 backend: str = "nvshmem", timeout_s: float = 10.0, validate: bool = True, timing: bool = False):
        if not dist.is_initialized():
            raise RuntimeError("EPAllToAll needs torch.distributed to be initialized")
        self._configure(dist.get_world_size(group), dist.get_rank(group), max_tokens, hidden, num_experts, topk,
                        dtype, fp8_dispatch, fp8_group, backend, timeout_s, validate, timing)
        sms = self._open(group, backend)
        if sms is None:
            return
        self._allocate(runtime.symmetric_zeros, sms)
        self._connect(lambda name, buf: [runtime.peer_ptr(buf, r) for r in range(self.world)])
        runtime.barrier()

    # ------------------------------------------------------------------------------------ setup

    def _configure(self, world, rank, max_tokens, hidden, num_experts, topk, dtype, fp8_dispatch, fp8_group,
                   backend, timeout_s, validate, timing=False) -> None:
        check_config(max_tokens, hidden, num_experts, topk, world, dtype, fp8_dispatch, fp8_group,
                     backend, timeout_s)
        self.world, self.rank = world, rank
        self.max_tokens, self.hidden, self.num_experts, self.topk = max_tokens, hidden, num_experts, topk
        self.experts_per_rank = num_experts // world
        self.dtype, self.backend, self.validate, self.timing = dtype, backend, validate, timing
        self.fp8_group = fp8_group if fp8_dispatch else None
        self.timeout_s = timeout_s
        self._calls = {"dispatch": 0, "combine": 0}
        self._pending = {"dispatch": 0, "combine": 0}
        self._symmetric: dict[str, torch.Tensor] = {}
        self._broken: str | None = None

    def _allocate(self, symmetric_zeros, sms: int) -> None:
        """Buffers: symmetric ones from `symmetric_zeros(shape, dtype)`, local ones on self.device.
        Grids are bounded by `sms` (the same on every rank) times PROGRAMS_PER_SM."""
        S, W, T, H, K, EL = SLOTS, self.world, self.max_tokens, self.hidden, self.topk, self.experts_per_rank
        payload = torch.float8_e4m3fn if self.fp8_group else self.dtype
        G = H // self.fp8_group if self.fp8_group else 1
        i32, i64, f32 = torch.int32, torch.int64, torch.float32
        local = lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=self.device)  # noqa: E731
        shapes = {
            "data": (S, W, T, H), "scales": (S, W, T, G), "ids": (S, W, T, K), "weights": (S, W, T, K),
            "positions": (S, W, T, K), "counts": (S, W, EL), "tokens": (S, W), "arrived": (S, W), "freed": (S, W),
            "recv_x": (S, EL, W * T, H), "recv_scales": (S, EL, W * T, G), "recv_count": (S, EL),
            "recv_src": (S, EL, W * T), "kept_ids": (S, W, T, K), "kept_weights": (S, W, T, K),
            "kept_rows": (S, W, T, K), "kept_tokens": (S, W)}
        dtypes = {"data": payload, "scales": f32, "weights": f32, "arrived": i64, "freed": i64, "recv_x": payload,
                  "recv_scales": f32, "kept_weights": f32}
        self.dispatch_buffers = DispatchBuffers(**{
            f.name: (symmetric_zeros if f.name in kernels.DISPATCH_PEERS else local)(
                shapes[f.name], dtypes.get(f.name, i32)) for f in fields(DispatchBuffers)})
        self.combine_buffers = CombineBuffers(data=symmetric_zeros((S, W, T, H), self.dtype),
                                              arrived=symmetric_zeros((S, W), i64), freed=symmetric_zeros((S, W), i64))
        self._symmetric = {f"dispatch.{n}": getattr(self.dispatch_buffers, n) for n in kernels.DISPATCH_PEERS}
        self._symmetric.update({f"combine.{n}": getattr(self.combine_buffers, n) for n in kernels.COMBINE_PEERS})
        self._status = torch.zeros(kernels.EP_STATUS_WORDS, dtype=i32, pin_memory=self.device.type == "cuda")
        self._status_words = self._status.numpy()        # read by the host without a sync: pinned, written by kernels
        d = self.dispatch_buffers
        self._outputs = [(d.recv_x[s], d.recv_scales[s] if self.fp8_group else None, d.recv_count[s], d.recv_src[s])
                         for s in range(S)]               # per slot: dispatch's outputs, as views made once

        chunks = triton.cdiv(H, CHUNK_COLUMNS)
        self._layout_ids = min(LAYOUT_IDS, triton.next_power_of_2(T * K))
        self._layout_experts = min(triton.next_power_of_2(self.num_experts), max(1, LAYOUT_TILE // self._layout_ids))
        work = {"dispatch_send": T * chunks, "dispatch_recv": W * T * chunks,
                "combine_send": W * T * triton.cdiv(H, COMBINE_COLUMNS), "combine_recv": T * triton.cdiv(H, COMBINE_COLUMNS)}
        self._grid = {name: min(items, PROGRAMS_PER_SM[name] * sms) for name, items in work.items()}
        self._grid["dispatch_send"] += triton.cdiv(self.num_experts, self._layout_experts)   # the layout programs
        # Per kernel: every program's use count of each slot and its clock word [S + 1, grid]; programs
        # finished per slot [S]; timing stamps [4] (kernels.STAMPS; reset to "none yet" before a timed call).
        self._state = {name: local((S + 1, grid), i64) for name, grid in self._grid.items()}
        self._finished = {name: local((S,), i64) for name in self._grid}
        self._stamps = local((len(kernels.KERNELS), len(kernels.STAMPS)), i64)
        self._unstamped = self._stamps.clone()
        self._unstamped[:, 0] = torch.iinfo(torch.int64).max

    def _connect(self, peer_addresses) -> None:
        """Peer tables and bound kernels; peer_addresses(name, buffer) -> every rank's address of the symmetric
        buffer `name` (a key of self._symmetric; None: unreachable)."""
        def table(side, buffers, names):
            rows = [peer_addresses(f"{side}.{name}", getattr(buffers, name)) for name in names]
            for r, address in enumerate(rows[0]):
                if address is None:
                    raise ValueError(f"rank {r} is not reachable through NVLink from rank {self.rank}: the nvshmem "
                                     "backend needs every rank in one NVLink domain (use backend='reference')")
            return torch.tensor(rows, dtype=torch.int64, device=self.device)
        self._dispatch_peers = table("dispatch", self.dispatch_buffers, kernels.DISPATCH_PEERS)
        self._combine_peers = table("combine", self.combine_buffers, kernels.COMBINE_PEERS)
        self._bind()

    def _bind(self) -> None:
        """Every launch, bound once: per slot (and, for combine_send, per slot of the dispatch it follows)."""
        d, c = self.dispatch_buffers, self.combine_buffers
        fp8 = self.fp8_group is not None
        common = dict(rank=self.rank, world=self.world, max_tokens=self.max_tokens, hidden=self.hidden,
                      topk=self.topk, experts_per_rank=self.experts_per_rank, timeout_ns=int(self.timeout_s * 1e9),
                      status_addr=self._status.data_ptr(), K_PAD=triton.next_power_of_2(self.topk),
                      WORLD_PAD=triton.next_power_of_2(self.world), SLOTS=SLOTS, TIMING=self.timing, num_warps=4)
        dispatch = dict(FP8=fp8, GROUP=self.fp8_group or 128, BLOCK_GROUPS=CHUNK_COLUMNS // (self.fp8_group or 128))
        # The receive kernels start while their send kernel still runs (programmatic dependent launch: the
        # send kernels call _start_receiver); they read nothing it writes locally, only what peers signal.
        early = {} if INTERPRETING else {"launch_pdl": True}

        def kernel(name, fn, slot, varying=(), **arguments):
            stamps = self._stamps[kernels.KERNELS.index(name)]
            return BoundKernel(fn, self._grid[name], varying, slot=slot, state_ptr=self._state[name],
                               finished_ptr=self._finished[name], stamps_ptr=stamps, **common, **arguments)

        self._dispatch_send = [kernel(
            "dispatch_send", kernels.dispatch_send_kernel, s, ("x_ptr", "ids_ptr", "w_ptr", "num_tokens", "call"),
            peers=self._dispatch_peers, freed_ptr=d.freed, num_experts=self.num_experts,
            EXPERTS_BLOCK=self._layout_experts, BLOCK_I=self._layout_ids,
            VALIDATE=self.validate, **dispatch) for s in range(SLOTS)]
        self._dispatch_recv = [kernel(
            "dispatch_recv", kernels.dispatch_recv_kernel, s,
            data_ptr=d.data, scale_ptr=d.scales, ids_ptr=d.ids, w_ptr=d.weights, pos_ptr=d.positions,
            count_ptr=d.counts, tokens_ptr=d.tokens, arrived_ptr=d.arrived, peers=self._dispatch_peers,
            recv_x_ptr=d.recv_x[s], recv_scale_ptr=d.recv_scales[s], recv_count_ptr=d.recv_count[s],
            recv_src_ptr=d.recv_src[s], kept_ids_ptr=d.kept_ids[s], kept_w_ptr=d.kept_weights[s],
            kept_row_ptr=d.kept_rows[s], kept_tokens_ptr=d.kept_tokens[s], **dispatch, **early) for s in range(SLOTS)]
        self._combine_send = {(s, ds): kernel(
            "combine_send", kernels.combine_send_kernel, s, ("y_ptr",),
            kept_ids_ptr=d.kept_ids[ds], kept_w_ptr=d.kept_weights[ds], kept_row_ptr=d.kept_rows[ds],
            kept_tokens_ptr=d.kept_tokens[ds], peers=self._combine_peers, freed_ptr=c.freed,
            BLOCK_H=COMBINE_COLUMNS, enable_fp_fusion=False)   # mul then add, rounded twice: the reference's sums
            for s in range(SLOTS) for ds in range(SLOTS)}
        self._combine_recv = [kernel(
            "combine_recv", kernels.combine_recv_kernel, s, ("out_ptr", "ids_ptr", "num_tokens"),
            data_ptr=c.data, arrived_ptr=c.arrived, peers=self._combine_peers, BLOCK_H=COMBINE_COLUMNS, **early)
            for s in range(SLOTS)]

    # ------------------------------------------------------------------------------------ checks

    def _context(self) -> str:
        return f"; calls {self._calls}"

    def _raise_if_failed(self) -> None:
        """The base's checks (destroyed, a timeout), then the first out-of-range expert id a dispatch saw."""
        if self._broken or self.backend == "reference":
            return super()._raise_if_failed()
        if not (self._status_words[0] or self._status_words[kernels.STATUS_BAD_CALL.value]):
            return                                      # the common case: two reads of pinned memory
        super()._raise_if_failed()
        if self._status_words[kernels.STATUS_BAD_CALL.value]:
            call, bad, index = (int(self._status_words[w.value]) for w in
                                (kernels.STATUS_BAD_CALL, kernels.STATUS_BAD_ID, kernels.STATUS_BAD_INDEX))
            self._status_words[kernels.STATUS_BAD_CALL.value] = 0
            raise ValueError(f"rank {self.rank}: dispatch call {call} had topk_ids[{index // self.topk}, "
                             f"{index % self.topk}] = {bad}, outside [-1, {self.num_experts}) (-1 = dropped slot); "
                             "it was dropped")

    def _check_dispatch_args(self, x, topk_ids, topk_weights) -> None:
        self._expect("x", x, (self.dtype,), dim=2)
        tokens = x.shape[0]
        if x.shape[1] != self.hidden:
            raise ValueError(f"x has hidden size {x.shape[1]}, this EPAllToAll was built for {self.hidden}")
        if tokens > self.max_tokens:
            raise ValueError(f"{tokens} tokens is more than max_tokens={self.max_tokens}")
        self._expect("topk_ids", topk_ids, (torch.int32, torch.int64), shape=(tokens, self.topk))
        self._expect("topk_weights", topk_weights, (torch.float32, torch.bfloat16, torch.float16),
                     shape=(tokens, self.topk))
        if self.backend == "reference" and self.validate and tokens:   # that path waits for the host anyway
            low, high = torch.stack([topk_ids.min(), topk_ids.max()]).tolist()
            if low < -1 or high >= self.num_experts:
                raise ValueError(f"topk_ids must lie in [-1, {self.num_experts}) (-1 = dropped slot), "
                                 f"found values in [{low}, {high}]")
        if self._pending["dispatch"] >= SLOTS:
            raise ValueError("two dispatches are already in flight: call the receive hook of the earlier one first")

    # ------------------------------------------------------------------------------------ dispatch

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 return_recv_hook: bool = False):
        """Send each token to the ranks of its experts; receive this rank's experts' rows.

        Args:
            x: [T, H] tokens, T <= max_tokens, dtype `dtype`.
            topk_ids: [T, K] int32/int64 expert ids, -1 = dropped slot.
            topk_weights: [T, K] float32/bfloat16/float16, kept for combine.
        Returns:
            recv_x: [E_loc, W*T_max, H] float8_e4m3fn (or `dtype` without FP8): rows [0, recv_count[e])
                of expert e are valid, in (source rank, token, k) order.
            recv_scales: [E_loc, W*T_max, H/fp8_group] float32 scales of those rows, or None.
            recv_count: [E_loc] int32 on the device.
            handle: what combine needs.
            hook (with return_recv_hook=True): launches the receive; read the outputs only after it.
        The outputs stay valid until the dispatch after next.
        """
        self._raise_if_failed()
        self._check_dispatch_args(x, topk_ids, topk_weights)
        slot = self._calls["dispatch"] % SLOTS
        self._calls["dispatch"] += 1
        call = self._calls["dispatch"]
        if self.backend == "reference":
            recv_x, recv_scales, recv_count, ref = reference.dispatch(
                x, topk_ids, topk_weights, num_experts=self.num_experts, max_tokens=self.max_tokens,
                fp8_group=self.fp8_group, group=self.group)
            handle = EPHandle(slot, call, x.shape[0], topk_ids, ref.recv_src, True, ref)
            outputs = (recv_x, recv_scales, recv_count, handle)
            return (*outputs, _no_hook) if return_recv_hook else outputs

        recv_x, recv_scales, recv_count, recv_src = self._outputs[slot]
        handle = EPHandle(slot, call, x.shape[0], topk_ids, recv_src)
        if self.timing:
            self._stamps[:2].copy_(self._unstamped[:2])
        self._dispatch_send[slot](x, topk_ids, topk_weights, x.shape[0], call)
        outputs = (recv_x, recv_scales, recv_count, handle)
        def receive():
            self._dispatch_recv[slot]()
            handle.received = True
        if not return_recv_hook:
            receive()
            return outputs
        return (*outputs, self._hook("dispatch", receive))

    # ------------------------------------------------------------------------------------ combine

    def combine(self, expert_out: torch.Tensor, handle: EPHandle, return_recv_hook: bool = False,
                out: torch.Tensor | None = None):
        """Send each expert row's weighted sum back to its token's rank, and add them up there.

        Args:
            expert_out: [E_loc, W*T_max, H] in the layout of recv_x, dtype `dtype`.
            handle: the dispatch's handle (its receive must have run).
            out: where to write y (contiguous [T, H] `dtype` on this device); a new tensor if None.
        Returns:
            y: [T, H] `dtype` (`out` when given): sum over k of topk_weights[t, k] * expert_out row of
                (t, k), in fp32.
            hook (with return_recv_hook=True): launches the receive; read y only after it.
        """
        self._raise_if_failed()
        rows = self.world * self.max_tokens
        self._expect("expert_out", expert_out, (self.dtype,), shape=(self.experts_per_rank, rows, self.hidden))
        if not isinstance(handle, EPHandle) or not handle.received:
            raise ValueError("combine needs the handle of a dispatch whose receive has completed")
        if self._calls["dispatch"] >= handle.call + SLOTS:
            raise ValueError("stale handle: its dispatch buffers were reused by a later dispatch")
        if self._pending["combine"] >= SLOTS:
            raise ValueError("two combines are already in flight: call the receive hook of the earlier one first")
        if out is not None:
            self._expect("out", out, (self.dtype,), shape=(handle.num_tokens, self.hidden))
        slot = self._calls["combine"] % SLOTS
        self._calls["combine"] += 1
        if self.backend == "reference":
            y = reference.combine(expert_out, handle.reference, group=self.group)
            y = y if out is None else out.copy_(y)
            return (y, _no_hook) if return_recv_hook else y

        y = torch.empty((handle.num_tokens, self.hidden), dtype=self.dtype, device=self.device) if out is None else out
        if self.timing:
            self._stamps[2:].copy_(self._unstamped[2:])
        self._combine_send[slot, handle.slot](expert_out)
        receive = lambda: self._combine_recv[slot](y, handle.topk_ids, handle.num_tokens)  # noqa: E731
        if not return_recv_hook:
            receive()
            return y
        return y, self._hook("combine", receive)

    # ------------------------------------------------------------------------------------ timing

    def breakdown(self) -> dict[str, float]:
        """Microseconds per phase of the last dispatch and combine, from this rank's device stamps
        (``timing=True``; waits for the GPU). Per op: send (first send program started -> last byte
        issued), signal (-> the last sender program's signal), wait (-> the receiver saw every
        rank's signal: launch gap and slower peers), recv (-> receive done), total."""
        if not self.timing:
            raise ValueError("breakdown() needs EPAllToAll(..., timing=True)")
        stamps = dict(zip(kernels.KERNELS, self._stamps.tolist()))
        out = {}
        for op in ("dispatch", "combine"):
            (s_start, _, s_worked, s_signaled), (_, r_waited, r_worked, _) = stamps[f"{op}_send"], stamps[f"{op}_recv"]
            out.update({f"{op}_send_us": (s_worked - s_start) / 1e3, f"{op}_signal_us": (s_signaled - s_worked) / 1e3,
                        f"{op}_wait_us": (r_waited - s_signaled) / 1e3, f"{op}_recv_us": (r_worked - r_waited) / 1e3,
                        f"{op}_total_us": (r_worked - s_start) / 1e3})
        return out

    # ------------------------------------------------------------------------------------ launching

    def _hook(self, op: str, receive):
        """A one-shot callable that runs `receive`; counts it as in flight until then."""
        self._pending[op] += 1
        done = []

        def hook():
            if done:
                raise RuntimeError(f"the {op} receive hook was already called")
            done.append(True)
            self._pending[op] -= 1
            receive()
        return hook


def _no_hook() -> None:
    """The receive hook of the reference backend: its receive already happened."""


def check_config(max_tokens, hidden, num_experts, topk, world, dtype, fp8_dispatch, fp8_group, backend,
                 timeout_s=10.0) -> None:
    """The ValueError EPAllToAll(...) would raise for these arguments on `world` ranks, without building it."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    for name, value in (("max_tokens", max_tokens), ("hidden", hidden), ("num_experts", num_experts)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not isinstance(topk, int) or not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"topk must be an int in [1, {MAX_TOPK}], got {topk!r}")
    if num_experts % world:
        raise ValueError(f"num_experts={num_experts} is not a multiple of the world size {world}")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype must be bfloat16, float16 or float32, got {dtype}")
    if fp8_dispatch:
        if not isinstance(fp8_group, int) or fp8_group < 16 or fp8_group & (fp8_group - 1):
            raise ValueError(f"fp8_group must be a power of two >= 16, got {fp8_group!r}")
        if hidden % fp8_group:
            raise ValueError(f"hidden={hidden} is not a multiple of fp8_group={fp8_group}")
    elif hidden % 8:
        raise ValueError(f"hidden={hidden} must be a multiple of 8")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
