"""EPAllToAll: the front of expert-parallel dispatch/combine.

    ep = EPAllToAll(max_tokens=128, hidden=7168, num_experts=256, topk=8)   # collective
    recv_x, recv_scales, recv_count, handle = ep.dispatch(x, topk_ids, topk_weights)
    expert_out = my_experts(recv_x, recv_scales, recv_count)                # [E_loc, W*T_max, H] bf16
    y = ep.combine(expert_out, handle)                                      # [T, H]
    ep.destroy()                                                            # collective

What the tensors mean is ``moe_ep.reference``'s contract. The front checks every argument,
counts calls into buffer slots, makes handles and hooks, and picks the backend; the kernels
and their buffers belong to a protocol object (``low_latency.LowLatency``; ``protocol``
says what a protocol offers, so that another one is a new module beside it, not a branch here).

Results of a dispatch are views into buffers of one of two slots (double buffering): they stay
valid until the dispatch after next; combine's result likewise until the combine after next
(unless it wrote a tensor given as ``out``). With ``return_recv_hook=True`` dispatch and combine
return after issuing the sends, together with a callable that launches the receive: run compute
in between, call the hook, and only then read the outputs. At most two dispatches (and two
combines) may be in flight. Without a hook, both phases run in one kernel launch where the
protocol allows it: one launch of host time less a call. Dispatch's ``mode`` picks its kernels:
"decode" (a token row a work item, one launch without a hook), "prefill" (larger work items and
more programs, a send and a receive kernel), or "auto" (the default): decode up to
``low_latency.ONE_LAUNCH_TOKENS`` tokens, prefill above.

No call waits for the GPU. Dispatch and combine can be captured in a CUDA graph: the call
counts the signals depend on live on the device. Expert ids are range-checked by the dispatch
kernel itself (``validate=True``): an id outside [-1, E) is dropped like -1, and the next call
(or ``check()``) raises a ValueError naming the call that saw it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .. import reference, runtime
from ..kernels import status
from .low_latency import LowLatency
from .protocol import MODES, SLOTS, EPConfig

BACKENDS = ("nvshmem", "reference")
MAX_TOPK = 16
IDS_DTYPES = (torch.int32, torch.int64)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(slots=True)
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
        num_sms: at most this many SMs' worth of programs per kernel (None: every SM), so that the
            kernels can run beside a GEMM.
        device: where x, topk_ids, expert_out and the outputs live. The reference backend takes any
            device; nvshmem runs on this process's GPU only. Default: this process's GPU when the group
            is NCCL (or ranks share a GPU), else the CPU.
    """

    TAGS = status.TAGS

    def __init__(self, max_tokens: int, hidden: int, num_experts: int, topk: int, group=None,
                 dtype: torch.dtype = torch.bfloat16, fp8_dispatch: bool = True, fp8_group: int = 128,
                 backend: str = "nvshmem", timeout_s: float = 10.0, validate: bool = True, timing: bool = False,
                 num_sms: int | None = None, device: torch.device | str | None = None):
        if not dist.is_initialized():
            raise RuntimeError("EPAllToAll needs torch.distributed to be initialized")
        self._configure(dist.get_world_size(group), dist.get_rank(group), max_tokens, hidden, num_experts, topk,
                        dtype, fp8_dispatch, fp8_group, backend, timeout_s, validate, timing, num_sms)
        sms = self._open(group, backend, device)
        if sms is None:
            return
        self._allocate(runtime.symmetric_zeros, sms, one_launch=runtime.ranks_per_gpu() == 1)
        self.protocol.connect(lambda name, buf: [runtime.peer_ptr(buf, r) for r in range(self.world)])
        runtime.barrier()

    @classmethod
    def simulated(cls, world: int, max_tokens: int, hidden: int, num_experts: int, topk: int,
                  dtype: torch.dtype = torch.bfloat16, fp8_dispatch: bool = True, fp8_group: int = 128,
                  timeout_s: float = 5.0, validate: bool = True, timing: bool = False,
                  num_sms: int = 1) -> list[EPAllToAll]:
        """Every rank of a `world` in this process, on the CPU, without torch.distributed or NVSHMEM:
        the symmetric buffers are plain tensors and the peer tables hold their addresses. Under the
        Triton interpreter the kernels run for real (one program at a time: issue every rank's sends,
        with return_recv_hook=True, before any receive); elsewhere it measures the host side of a call."""
        ranks = []
        for rank in range(world):
            ep = cls.__new__(cls)
            ep._configure(world, rank, max_tokens, hidden, num_experts, topk, dtype, fp8_dispatch, fp8_group,
                          "nvshmem", timeout_s, validate, timing, num_sms)
            ep.group, ep.device = None, torch.device("cpu")
            ep._allocate(lambda shape, dtype: torch.zeros(shape, dtype=dtype), sms=num_sms, one_launch=True)
            ranks.append(ep)
        for ep in ranks:
            ep.protocol.connect(lambda name, buf: [other._symmetric[name].data_ptr() for other in ranks])
        return ranks

    # ------------------------------------------------------------------------------------ setup

    def _configure(self, world, rank, max_tokens, hidden, num_experts, topk, dtype, fp8_dispatch, fp8_group,
                   backend, timeout_s, validate, timing=False, num_sms=None) -> None:
        check_config(max_tokens, hidden, num_experts, topk, world, dtype, fp8_dispatch, fp8_group,
                     backend, timeout_s, num_sms)
        self.config = EPConfig(world, rank, max_tokens, hidden, num_experts, topk, dtype,
                               fp8_group if fp8_dispatch else None, timeout_s, validate, timing)
        self.world, self.rank = world, rank
        self.max_tokens, self.hidden, self.num_experts, self.topk = max_tokens, hidden, num_experts, topk
        self.experts_per_rank = num_experts // world
        self.dtype, self.backend, self.validate, self.timing = dtype, backend, validate, timing
        self.fp8_group = self.config.fp8_group
        self.timeout_s = timeout_s
        self.num_sms = num_sms
        self._dispatches = self._combines = 0            # calls so far: call n uses slot n % SLOTS
        self._pending = {"dispatch": 0, "combine": 0}    # receive hooks not yet called
        self._symmetric: dict[str, torch.Tensor] = {}
        self._broken: str | None = None

    def _allocate(self, symmetric_zeros, sms: int, one_launch: bool) -> None:
        """The status words and the protocol with its buffers: symmetric ones from
        `symmetric_zeros(shape, dtype)`, local ones on self.device; grids bounded by `sms` (the same on
        every rank), or by num_sms if fewer. `one_launch`: calls without a receive hook may run both
        phases in one launch (not with several ranks on a GPU: see kernels.all_to_all)."""
        self._status = torch.zeros(status.EP_STATUS_WORDS, dtype=torch.int32,
                                   pin_memory=self.device.type == "cuda")
        self._status_words = self._status.numpy()        # read by the host without a sync: pinned, written by kernels
        sms = min(sms, self.num_sms or sms)
        self.protocol = LowLatency(self.config, symmetric_zeros, self.device, self._status, sms, one_launch)
        self._symmetric = self.protocol.symmetric

    # ------------------------------------------------------------------------------------ checks

    def _context(self) -> str:
        return f"; {self._dispatches} dispatches, {self._combines} combines"

    def _raise_if_failed(self) -> None:
        """The base's checks (destroyed, a timeout), then the first out-of-range expert id a dispatch saw."""
        if self._broken or self.backend == "reference":
            return super()._raise_if_failed()
        if not (self._status_words[0] or self._status_words[status.STATUS_BAD_CALL.value]):
            return                                      # the common case: two reads of pinned memory
        super()._raise_if_failed()
        if self._status_words[status.STATUS_BAD_CALL.value]:
            call, bad, index = (int(self._status_words[w.value]) for w in
                                (status.STATUS_BAD_CALL, status.STATUS_BAD_ID, status.STATUS_BAD_INDEX))
            self._status_words[status.STATUS_BAD_CALL.value] = 0
            raise ValueError(f"rank {self.rank}: dispatch call {call} had topk_ids[{index // self.topk}, "
                             f"{index % self.topk}] = {bad}, outside [-1, {self.num_experts}) (-1 = dropped slot); "
                             "it was dropped")

    def _dispatch_args_pass(self, x, topk_ids, topk_weights, mode) -> bool:
        """True if every check of _check_dispatch_args passes, in one expression: the common case at a
        third of the host time of the checks that name what is wrong."""
        try:
            device, rows = self.device, (x.shape[0], self.topk)
            return (x.dtype == self.dtype and topk_ids.dtype in IDS_DTYPES and topk_weights.dtype in WEIGHT_DTYPES
                    and x.shape == (rows[0], self.hidden) and topk_ids.shape == rows and topk_weights.shape == rows
                    and rows[0] <= self.max_tokens and x.device == device and topk_ids.device == device
                    and topk_weights.device == device and x.is_contiguous() and topk_ids.is_contiguous()
                    and topk_weights.is_contiguous() and self._pending["dispatch"] < SLOTS and mode in MODES)
        except (AttributeError, IndexError, TypeError):
            return False

    def _check_dispatch_args(self, x, topk_ids, topk_weights, mode) -> None:
        if self.backend == "nvshmem" and self._dispatch_args_pass(x, topk_ids, topk_weights, mode):
            return
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self._expect("x", x, (self.dtype,), dim=2)
        tokens = x.shape[0]
        if x.shape[1] != self.hidden:
            raise ValueError(f"x has hidden size {x.shape[1]}, this EPAllToAll was built for {self.hidden}")
        if tokens > self.max_tokens:
            raise ValueError(f"{tokens} tokens is more than max_tokens={self.max_tokens}")
        self._expect("topk_ids", topk_ids, IDS_DTYPES, shape=(tokens, self.topk))
        self._expect("topk_weights", topk_weights, WEIGHT_DTYPES, shape=(tokens, self.topk))
        if self.backend == "reference" and self.validate and tokens:   # that path waits for the host anyway
            low, high = torch.stack([topk_ids.min(), topk_ids.max()]).tolist()
            if low < -1 or high >= self.num_experts:
                raise ValueError(f"topk_ids must lie in [-1, {self.num_experts}) (-1 = dropped slot), "
                                 f"found values in [{low}, {high}]")
        if self._pending["dispatch"] >= SLOTS:
            raise ValueError("two dispatches are already in flight: call the receive hook of the earlier one first")

    def _check_combine_args(self, expert_out, handle, out) -> None:
        rows = self.world * self.max_tokens
        self._expect("expert_out", expert_out, (self.dtype,), shape=(self.experts_per_rank, rows, self.hidden))
        if not isinstance(handle, EPHandle) or not handle.received:
            raise ValueError("combine needs the handle of a dispatch whose receive has completed")
        if self._dispatches >= handle.call + SLOTS:
            raise ValueError("stale handle: its dispatch buffers were reused by a later dispatch")
        if out is not None:
            self._expect("out", out, (self.dtype,), shape=(handle.num_tokens, self.hidden))
        if self._pending["combine"] >= SLOTS:
            raise ValueError("two combines are already in flight: call the receive hook of the earlier one first")

    # ------------------------------------------------------------------------------------ dispatch

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 return_recv_hook: bool = False, mode: str = "auto"):
        """Send each token to the ranks of its experts; receive this rank's experts' rows.

        Args:
            x: [T, H] tokens, T <= max_tokens, dtype `dtype`.
            topk_ids: [T, K] int32/int64 expert ids, -1 = dropped slot.
            topk_weights: [T, K] float32/bfloat16/float16, kept for combine.
            mode: "auto", "decode" or "prefill": which kernels run (see the module's docstring); the
                results are the same.
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
        self._check_dispatch_args(x, topk_ids, topk_weights, mode)
        slot = self._dispatches % SLOTS
        self._dispatches += 1
        call = self._dispatches
        if self.backend == "reference":
            recv_x, recv_scales, recv_count, ref = reference.dispatch(
                x, topk_ids, topk_weights, num_experts=self.num_experts, max_tokens=self.max_tokens,
                fp8_group=self.fp8_group, group=self.group)
            handle = EPHandle(slot, call, x.shape[0], topk_ids, ref.recv_src, True, ref)
            return (recv_x, recv_scales, recv_count, handle, _no_hook) if return_recv_hook else \
                (recv_x, recv_scales, recv_count, handle)

        recv_x, recv_scales, recv_count, recv_src = self.protocol.outputs[slot]
        handle = EPHandle(slot, call, x.shape[0], topk_ids, recv_src)
        if not return_recv_hook:
            self.protocol.dispatch(slot, x, topk_ids, topk_weights, call, mode)
            handle.received = True
            return recv_x, recv_scales, recv_count, handle
        self.protocol.dispatch_send(slot, x, topk_ids, topk_weights, call, mode)
        return recv_x, recv_scales, recv_count, handle, _ReceiveHook(self, "dispatch", slot, handle)

    # ------------------------------------------------------------------------------------ combine

    def combine(self, expert_out: torch.Tensor, handle: EPHandle, return_recv_hook: bool = False,
                out: torch.Tensor | None = None):
        """Send each expert row's weighted sum back to its token's rank, and add them up there.

        Args:
            expert_out: [E_loc, W*T_max, H] in the layout of recv_x, dtype `dtype`.
            handle: the dispatch's handle (its receive must have run).
            out: [T, H] `dtype`, contiguous: where to write y (checked before anything runs). Without it,
                y is a view of a buffer of this object, valid until the combine after next.
        Returns:
            y: [T, H] `dtype` (`out` when given): sum over k of topk_weights[t, k] * expert_out row of
                (t, k), in fp32.
            hook (with return_recv_hook=True): launches the receive; read y only after it.
        """
        self._raise_if_failed()
        self._check_combine_args(expert_out, handle, out)
        slot = self._combines % SLOTS
        self._combines += 1
        if self.backend == "reference":
            y = reference.combine(expert_out, handle.reference, group=self.group)
            if out is not None:
                y = out.copy_(y)
            return (y, _no_hook) if return_recv_hook else y

        y = self.protocol.combined(slot, handle.num_tokens) if out is None else out
        if not return_recv_hook:
            self.protocol.combine(slot, handle.slot, expert_out, y, handle.topk_ids, handle.num_tokens)
            return y
        self.protocol.combine_send(slot, handle.slot, expert_out)
        return y, _ReceiveHook(self, "combine", slot, handle, y)

    # ------------------------------------------------------------------------------------ timing

    def breakdown(self) -> dict[str, float]:
        """Microseconds per phase of the last dispatch and combine, from this rank's device stamps
        (``timing=True``; waits for the GPU). Per op: send (first send program started -> last byte
        issued), signal (-> the last sender program's signal), wait (-> the receiver saw every
        rank's signal: launch gap and slower peers), recv (-> receive done), total."""
        if not self.timing:
            raise ValueError("breakdown() needs EPAllToAll(..., timing=True)")
        return self.protocol.breakdown()


class _ReceiveHook:
    """The one-shot receive of a dispatch or combine issued with return_recv_hook=True; counts as in
    flight until called."""

    __slots__ = ("ep", "op", "slot", "handle", "y", "done")

    def __init__(self, ep: EPAllToAll, op: str, slot: int, handle: EPHandle, y: torch.Tensor | None = None):
        self.ep, self.op, self.slot, self.handle, self.y, self.done = ep, op, slot, handle, y, False
        ep._pending[op] += 1

    def __call__(self) -> None:
        if self.done:
            raise RuntimeError(f"the {self.op} receive hook was already called")
        self.done = True
        self.ep._pending[self.op] -= 1
        if self.op == "dispatch":
            self.ep.protocol.dispatch_recv(self.slot)
            self.handle.received = True
        else:
            self.ep.protocol.combine_recv(self.slot, self.y, self.handle.topk_ids, self.handle.num_tokens)


def _no_hook() -> None:
    """The receive hook of the reference backend: its receive already happened."""


def check_config(max_tokens, hidden, num_experts, topk, world, dtype, fp8_dispatch, fp8_group, backend,
                 timeout_s=10.0, num_sms=None) -> None:
    """The ValueError EPAllToAll(...) would raise for these arguments on `world` ranks, without building it."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if num_sms is not None and (not isinstance(num_sms, int) or num_sms < 1):
        raise ValueError(f"num_sms must be a positive int or None, got {num_sms!r}")
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
