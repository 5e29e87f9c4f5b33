"""EPAllToAll: the host object that owns expert-parallel buffers and launches dispatch/combine.

    ep = EPAllToAll(max_tokens=128, hidden=7168, num_experts=256, topk=8)   # collective
    recv_x, recv_scales, recv_count, handle = ep.dispatch(x, topk_ids, topk_weights)
    expert_out = my_experts(recv_x, recv_scales, recv_count)                # [E_loc, W*T_max, H] bf16
    y = ep.combine(expert_out, handle)                                      # [T, H]
    ep.destroy()                                                            # collective

What the tensors mean is ``moe_ep.reference``'s contract; the kernels are in
``moe_ep.kernels.all_to_all``. Results of a dispatch are views into buffers of one of two
slots (double buffering): they stay valid until the dispatch after next. With
``return_recv_hook=True`` dispatch and combine return after issuing the sends, together
with a callable that launches the receive: run compute in between, call the hook, and only
then read the outputs. At most two dispatches (and two combines) may be in flight.

Dispatch and combine can be captured in a CUDA graph: the call counts the signals depend on
live on the device. The value check of ``topk_ids`` (a device-to-host copy) is skipped while
capturing, and always with ``validate=False``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import triton

from . import reference, runtime
from .kernels import all_to_all as kernels

BACKENDS = ("nvshmem", "reference")
MAX_TOPK = 16
_SLOTS = 2


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
        group: the process group (NVSHMEM backend: the whole default group).
        dtype: dtype of x, of expert_out and of combine's output.
        fp8_dispatch: quantize tokens to FP8 e4m3 (per ``fp8_group`` columns) inside dispatch.
        backend: "nvshmem" (Triton kernels over NVLink) or "reference" (torch.distributed).
        timeout_s: bound of every device-side wait.
        validate: check topk_ids values (costs a device-to-host copy per dispatch).
    """

    TAGS = kernels.TAGS

    def __init__(self, max_tokens: int, hidden: int, num_experts: int, topk: int, group=None,
                 dtype: torch.dtype = torch.bfloat16, fp8_dispatch: bool = True, fp8_group: int = 128,
                 backend: str = "nvshmem", timeout_s: float = 10.0, validate: bool = True):
        if not dist.is_initialized():
            raise RuntimeError("EPAllToAll needs torch.distributed to be initialized")
        self._configure(dist.get_world_size(group), dist.get_rank(group), max_tokens, hidden, num_experts, topk,
                        dtype, fp8_dispatch, fp8_group, backend, timeout_s, validate)
        sms = self._open(group, backend)
        if sms is None:
            return
        self._allocate(runtime.symmetric_zeros, programs=4 * sms)
        self._connect(lambda name, buf: [runtime.peer_ptr(buf, r) for r in range(self.world)])
        runtime.barrier()

    # ------------------------------------------------------------------------------------ setup

    def _configure(self, world, rank, max_tokens, hidden, num_experts, topk, dtype, fp8_dispatch, fp8_group,
                   backend, timeout_s, validate) -> None:
        _check_config(max_tokens, hidden, num_experts, topk, world, dtype, fp8_dispatch, fp8_group,
                      backend, timeout_s)
        self.world, self.rank = world, rank
        self.max_tokens, self.hidden, self.num_experts, self.topk = max_tokens, hidden, num_experts, topk
        self.experts_per_rank = num_experts // world
        self.dtype, self.backend, self.validate = dtype, backend, validate
        self.fp8_group = fp8_group if fp8_dispatch else None
        self.timeout_s = timeout_s
        self._calls = {"dispatch": 0, "combine": 0}
        self._pending = {"dispatch": 0, "combine": 0}
        self._symmetric: dict[str, torch.Tensor] = {}
        self._broken: str | None = None

    def _allocate(self, symmetric_zeros, programs: int) -> None:
        """Buffers: symmetric ones from `symmetric_zeros(shape, dtype)`, local ones on self.device.
        `programs` bounds every grid (it must be the same on every rank)."""
        S, W, T, H, K, EL = _SLOTS, self.world, self.max_tokens, self.hidden, self.topk, self.experts_per_rank
        payload = torch.float8_e4m3fn if self.fp8_group else self.dtype
        groups = H // self.fp8_group if self.fp8_group else 1
        shapes = {
            "d_data": ((S, W, T, H), payload), "d_scale": ((S, W, T, groups), torch.float32),
            "d_ids": ((S, W, T, K), torch.int32), "d_w": ((S, W, T, K), torch.float32),
            "d_pos": ((S, W, T, K), torch.int32), "d_count": ((S, W, EL), torch.int32),
            "d_ntok": ((S, W), torch.int32), "d_flag": ((S, W), torch.int64), "d_ack": ((S, W), torch.int64),
            "c_data": ((S, W, T, H), self.dtype), "c_flag": ((S, W), torch.int64), "c_ack": ((S, W), torch.int64),
        }
        for name, (shape, dtype) in shapes.items():
            self._symmetric[name] = symmetric_zeros(shape, dtype)

        rows = W * T
        zeros = lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=self.device)  # noqa: E731
        self._recv_x = zeros((S, EL, rows, H), payload)
        self._recv_scales = zeros((S, EL, rows, groups), torch.float32)
        self._recv_count = zeros((S, EL), torch.int32)
        self._recv_src = zeros((S, EL, rows), torch.int32)
        self._keep = {"ids": zeros((S, W, T, K), torch.int32), "w": zeros((S, W, T, K), torch.float32),
                      "row": zeros((S, W, T, K), torch.int32), "ntok": zeros((S, W), torch.int32)}
        self._status = torch.zeros(5, dtype=torch.int32, pin_memory=self.device.type == "cuda")   # shmem.STATUS_*

        self._block_groups = max(1, 2048 // (self.fp8_group or 128))
        dispatch_chunks = triton.cdiv(H, self._block_groups * (self.fp8_group or 128))
        self._block_h = 1024
        combine_chunks = triton.cdiv(H, self._block_h)
        self._grid = {
            "dispatch_send": self.num_experts + min(T * dispatch_chunks, programs),
            "dispatch_recv": min(rows * dispatch_chunks, programs),
            "combine_send": min(rows * combine_chunks, programs),
            "combine_recv": min(T * combine_chunks, programs),
        }
        # per program of each kernel: uses of slot 0, uses of slot 1, clock word (kernels/all_to_all.py)
        self._state = {name: zeros((S + 1, g), torch.int64) for name, g in self._grid.items()}

    def _connect(self, peer_addresses) -> None:
        """Peer tables: peer_addresses(name, buffer) -> every rank's address of it (None: unreachable)."""
        self._peers = {}
        for name, buf in self._symmetric.items():
            addresses = peer_addresses(name, buf)
            for r, address in enumerate(addresses):
                if address is None:
                    raise ValueError(f"rank {r} is not reachable through NVLink from rank {self.rank}: the "
                                     "nvshmem backend needs every rank in one NVLink domain (use backend='reference')")
            self._peers[name] = torch.tensor(addresses, dtype=torch.int64, device=self.device)

    # ------------------------------------------------------------------------------------ checks

    def _context(self) -> str:
        return f"; calls {self._calls}"

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
        if self.validate and tokens and not _capturing():
            low, high = torch.stack([topk_ids.min(), topk_ids.max()]).tolist()
            if low < -1 or high >= self.num_experts:
                raise ValueError(f"topk_ids must lie in [-1, {self.num_experts}) (-1 = dropped slot), "
                                 f"found values in [{low}, {high}]")
        if self._pending["dispatch"] >= _SLOTS:
            raise ValueError("two dispatches are already in flight: call the receive hook of the earlier one first")

    # ------------------------------------------------------------------------------------ dispatch

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 return_recv_hook: bool = False):
        """x [T, H], topk_ids [T, K] int32/int64 (-1 = dropped), topk_weights [T, K] float.

        Returns (recv_x [E_loc, W*T_max, H] fp8 or x.dtype, recv_scales [E_loc, W*T_max, H/g] f32
        or None, recv_count [E_loc] int32, handle), plus the receive hook if asked for.
        """
        self._raise_if_failed()
        self._check_dispatch_args(x, topk_ids, topk_weights)
        slot = self._calls["dispatch"] % _SLOTS
        self._calls["dispatch"] += 1
        if self.backend == "reference":
            recv_x, recv_scales, recv_count, ref = reference.dispatch(
                x, topk_ids, topk_weights, num_experts=self.num_experts, max_tokens=self.max_tokens,
                fp8_group=self.fp8_group, group=self.group)
            handle = EPHandle(slot, self._calls["dispatch"], x.shape[0], topk_ids, ref.recv_src, True, ref)
            outputs = (recv_x, recv_scales, recv_count, handle)
            return (*outputs, lambda: None) if return_recv_hook else outputs

        handle = EPHandle(slot, self._calls["dispatch"], x.shape[0], topk_ids, self._recv_src[slot])
        self._launch("dispatch_send", slot, x, topk_ids, topk_weights,
                     *self._tables("d_data", "d_scale", "d_ids", "d_w", "d_pos", "d_count", "d_ntok", "d_flag"),
                     self._symmetric["d_ack"], num_tokens=x.shape[0], num_experts=self.num_experts,
                     peer="dispatch_recv", FP8=self.fp8_group is not None, GROUP=self.fp8_group or 128,
                     BLOCK_GROUPS=self._block_groups, K_PAD=self._k_pad, BLOCK_I=2048)
        outputs = (self._recv_x[slot], self._recv_scales[slot] if self.fp8_group else None,
                   self._recv_count[slot], handle)
        hook = self._hook("dispatch", lambda: self._dispatch_recv(handle))
        if return_recv_hook:
            return (*outputs, hook)
        hook()
        return outputs

    def _dispatch_recv(self, handle: EPHandle) -> None:
        slot, sym = handle.slot, self._symmetric
        self._launch("dispatch_recv", slot,
                     *(sym[n] for n in ("d_data", "d_scale", "d_ids", "d_w", "d_pos", "d_count", "d_ntok", "d_flag")),
                     self._peers["d_ack"], self._recv_x[slot], self._recv_scales[slot], self._recv_count[slot],
                     self._recv_src[slot], *(self._keep[n][slot] for n in ("ids", "w", "row", "ntok")),
                     peer="dispatch_send", FP8=self.fp8_group is not None, GROUP=self.fp8_group or 128,
                     BLOCK_GROUPS=self._block_groups, K_PAD=self._k_pad)
        handle.received = True

    # ------------------------------------------------------------------------------------ combine

    def combine(self, expert_out: torch.Tensor, handle: EPHandle, return_recv_hook: bool = False):
        """expert_out [E_loc, W*T_max, H] in the layout of recv_x, dtype `dtype` -> y [T, H]."""
        self._raise_if_failed()
        rows = self.world * self.max_tokens
        self._expect("expert_out", expert_out, (self.dtype,), shape=(self.experts_per_rank, rows, self.hidden))
        if not isinstance(handle, EPHandle) or not handle.received:
            raise ValueError("combine needs the handle of a dispatch whose receive has completed")
        if self._calls["dispatch"] >= handle.call + _SLOTS:
            raise ValueError("stale handle: its dispatch buffers were reused by a later dispatch")
        if self._pending["combine"] >= _SLOTS:
            raise ValueError("two combines are already in flight: call the receive hook of the earlier one first")
        slot = self._calls["combine"] % _SLOTS
        self._calls["combine"] += 1
        if self.backend == "reference":
            y = reference.combine(expert_out, handle.reference, group=self.group)
            return (y, lambda: None) if return_recv_hook else y

        y = torch.empty((handle.num_tokens, self.hidden), dtype=self.dtype, device=self.device)
        self._launch("combine_send", slot, expert_out,
                     *(self._keep[n][handle.slot] for n in ("ids", "w", "row", "ntok")),
                     *self._tables("c_data", "c_flag"), self._symmetric["c_ack"],
                     peer="combine_recv", BLOCK_H=self._block_h, K_PAD=self._k_pad,
                     enable_fp_fusion=False)   # mul then add, rounded twice: the reference's fp32 sums
        recv = lambda: self._launch(  # noqa: E731
            "combine_recv", slot, y, handle.topk_ids, self._symmetric["c_data"], self._symmetric["c_flag"],
            self._peers["c_ack"], num_tokens=handle.num_tokens, peer="combine_send", BLOCK_H=self._block_h,
            K_PAD=self._k_pad, WORLD_PAD=triton.next_power_of_2(self.world))
        hook = self._hook("combine", recv)
        if return_recv_hook:
            return y, hook
        hook()
        return y

    # ------------------------------------------------------------------------------------ launching

    @property
    def _k_pad(self) -> int:
        return triton.next_power_of_2(self.topk)

    def _tables(self, *names):
        return [self._peers[n] for n in names]

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

    def _launch(self, name: str, slot: int, *tensors, peer: str, num_tokens=None, num_experts=None, **meta):
        """Launch kernel `name` on its grid with the scalars every kernel takes."""
        kernel = getattr(kernels, f"{name}_kernel")
        counts = [] if num_tokens is None else [num_tokens]
        scalars = [slot, self.rank, self.world, self.max_tokens, self.hidden, self.topk, self.experts_per_rank]
        if num_experts is not None:
            scalars.append(num_experts)
        scalars += [self._grid[peer], int(self.timeout_s * 1e9)]
        kernel[(self._grid[name],)](*tensors, self._state[name], self._status.data_ptr(),
                                    *counts, *scalars, num_warps=4, **meta)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _check_config(max_tokens, hidden, num_experts, topk, world, dtype, fp8_dispatch, fp8_group, backend,
                  timeout_s) -> None:
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
