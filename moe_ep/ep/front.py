"""EPAllToAll: the front of expert-parallel dispatch/combine.

    ep = EPAllToAll(max_tokens=128, hidden=7168, num_experts=256, topk=8)   # collective
    recv_x, recv_scales, recv_count, handle = ep.dispatch(x, topk_ids, topk_weights)
    expert_out = my_experts(recv_x, recv_scales, recv_count)                # [E_loc, W*T_max, H] bf16
    y = ep.combine(expert_out, handle)                                      # [T, H]
    ep.destroy()                                                            # collective

What the tensors mean is ``moe_ep.reference``'s contract. The front checks every argument,
counts calls into buffer slots, makes handles and hooks; the kernels, their buffers and their
status words belong to a protocol object, the one ``PROTOCOLS`` names for the backend
(``low_latency.LowLatency``, ``collective.CollectiveProtocol``; ``protocol`` says what a protocol
offers, and the package's docstring how another one joins them).

Results of a dispatch are views into buffers of one of two slots (double buffering): they stay
valid until the dispatch after next; combine's result likewise until the combine after next
(unless it wrote a tensor given as ``out``). With ``return_recv_hook=True`` dispatch and combine
return after issuing the sends, together with a callable that launches the receive: run compute
in between, call the hook, and only then read the outputs. At most two dispatches (and two
combines) may be in flight. Without a hook, both phases run in one kernel launch where the
protocol allows it: one launch of host time less a call. Dispatch's ``mode`` picks its kernels:
"decode" (a token row a work item, one launch without a hook), "prefill" (larger work items and
more programs, a send and a receive kernel), or "auto" (the default): decode up to
``low_latency.ONE_LAUNCH_TOKENS`` tokens in eager calls, prefill above and in CUDA graphs;
``measure_crossover()`` times both on this GPU and moves that bound to where they cross.

No call waits for the GPU. Dispatch and combine can be captured in a CUDA graph: the call
counts the signals depend on live on the device. Expert ids are range-checked by the dispatch
kernel itself (``validate=True``): an id outside [-1, E) is dropped like -1, and the next call
(or ``check()``) raises a ValueError naming the call that saw it.

Every rank of the group makes the same calls, so a call that one rank refuses must end on every rank.
The constructor exchanges, once, every rank's settings and refusal (CommObject._agree_on_settings): a
rank's bad argument raises CallRefusedError naming it on every rank, and ranks built with different
settings (num_experts, hidden, ...) raise a ValueError naming the settings and the ranks. The reference
backend, whose calls are host collectives, exchanges every rank's verdict on each dispatch and combine
before the call's own collectives (CommObject._agree: one all_gather of 256 bytes a rank, bounded by
``timeout_s``), so a rank's ValueError (too many tokens, an id out of range, a wrong shape) raises
CallRefusedError naming that rank and its reason on every rank, and no rank is left inside a collective.
On the nvshmem backend, whose calls no collective agrees on, the refusing rank raises its ValueError
before any launch (a bad argument, or an out-of-range id that its previous dispatch saw) and tells its
peers, with no collective: it writes which call and why (cut to 256 bytes) into its row of every peer's
refusal board, a small symmetric buffer (CommObject._tell_refusal). A peer that made the call waits for
the refusing rank until ``timeout_s``; then check(), or its next call (which does not run), reads its board
and raises CallRefusedError naming the refusing ranks and their reasons instead of CommTimeoutError
(CommObject._raise_refused; the notes are consumed). As after any timeout the peer's object is broken from
then on (its counters and the refusing rank's are a call apart): build the object again on every rank. A
refusing rank whose next call of that kind comes before its peers' waits end makes their call complete
instead (a call pairs with whichever call of the same number comes). An accepted call neither writes nor
reads the board. With elastic=True no wait times out: the peers mask a rank that refuses, as they mask one
that stops.

Elastic mode (``elastic=True``): a rank that dies no longer stops the others. Each rank keeps a
live mask on the device, which every kernel reads. A wait that runs past ``timeout_s`` on a peer
marks that peer dead in every rank's mask (its own too) and the call completes among the others;
``mask_ranks`` masks ranks on purpose, ``live_ranks`` says who is left. Neither needs a sync with
the host nor a new CUDA graph. What a masked rank's experts held is gone: a token routed to them
comes back without their contributions, not renormalized, and ``handle.lost`` [T, K] says which
of its experts were lost (an engine may renormalize by the weights left, or route again). A rank
that finds itself masked (it answered too late) raises CommTimeoutError. The rows a rank sends
land in row blocks of their own on each receiver, which nobody reads once it is masked, so a late
write from a dying rank reaches nothing a survivor uses. Freeing symmetric memory is collective over
every rank NVSHMEM started with: after a loss, ``destroy`` refuses, and the survivors' buffers go
with their processes.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from operator import attrgetter

import torch
import torch.distributed as dist

from .. import runtime
from ..formats import FORMATS, FP8_GROUP, PayloadFormat, format_of
from ..kernels import status
from ..routing import random_topk
from ..simulated import simulated_ranks
from ..timing import median_us, why_untimed
from .collective import CollectiveProtocol
from .low_latency import LowLatency
from .protocol import MODES, EPConfig, EPResources, KernelProtocol, crossover_tokens
from .puts import put_peers

PROTOCOLS = {"nvshmem": LowLatency, "reference": CollectiveProtocol}   # backend -> protocol
BACKENDS = tuple(PROTOCOLS)
PUTS = ("auto", "all")       # which peers the nvshmem backend reaches through puts (ep.puts)
MAX_TOPK = 16
MAX_ELASTIC_WORLD = 32       # an elastic receive records the ranks it read as bits of one word
IDS_DTYPES = (torch.int32, torch.int64)
# The payload formats dispatch applies (moe_ep.formats), by their scales: none, float32 or UE8M0 with one element
# a payload item and no per-tensor scale, e4m3 times a per-tensor scale with two (nvfp4's packed e2m1; the caller
# passes the per-tensor scale: dispatch's tensor_scale; the kernels of the others read a constant instead).
DISPATCH_SCALES = {"none": (1, False), "fp32": (1, False), "ue8m0": (1, False),
                   "e4m3": (2, True)}      # scale -> (elements a payload item, per-tensor scale)
TENSOR_SCALE_SHAPES = ((1,), ())     # a per-tensor scale's shapes: [1] as engines hold it, or [] (tensor_scale_of)


def dispatchable(fmt: PayloadFormat) -> bool:
    """Whether dispatch's kernels apply `fmt`: its packing and per-tensor scale those of its scales in
    DISPATCH_SCALES."""
    return DISPATCH_SCALES.get(fmt.scale) == (fmt.element_pack, fmt.tensor_scale)


DISPATCH_FORMATS = tuple(name for name, f in FORMATS.items() if dispatchable(f))
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
    lost: torch.Tensor | None = None       # elastic: [T, K] bool, True where expert k of token t was on a rank
                                           # the combine went on without (valid after the combine's receive)
    owner: object = field(default=None, repr=False, compare=False)   # the EPAllToAll whose dispatch made it


def _from_config(name: str) -> property:
    """A read-only attribute that is ``config.<name>``."""
    return property(attrgetter(f"config.{name}"), doc=f"``config.{name}``")


class EPAllToAll(runtime.CommObject):
    """Expert-parallel dispatch/combine for one MoE layer shape (collective constructor).

    Args:
        max_tokens: most tokens any rank passes to one dispatch.
        hidden: H; a multiple of the payload's ``hidden_multiple`` (``fp8_group`` with FP8 dispatch, 512 for
            "fp8_ue8m0"), of 8 without scales.
        num_experts: E, a multiple of the world size; rank r owns experts [r*E/W, (r+1)*E/W).
        topk: K, 1..16.
        group: the process group (NVSHMEM backend: NVSHMEM spans its ranks; one such group per process).
        dtype: dtype of x, of expert_out and of combine's output.
        fp8_dispatch: quantize tokens to FP8 e4m3 (per ``fp8_group`` columns) inside dispatch. Keep tokens
            finite: an inf anywhere in a group of fp8_group columns makes the group's scale inf and every
            value of the group non-finite once dequantized; so does a NaN on the reference backend, whose
            maximum (torch's amax) propagates it (the kernels' maximum skips it).
        fp8_group: columns per float32 scale of FP8 dispatch, a power of two >= 16.
        payload: the payload format (``moe_ep.formats``), by name or as a ``PayloadFormat``: one of
            DISPATCH_FORMATS ("bf16", "fp16", "fp32": x's own dtype; "fp8"; "fp8_ue8m0": e4m3 with a
            power-of-two scale per 128 columns, four UE8M0 bytes in an int32, DeepGEMM's packed scales;
            "mxfp8": e4m3 with a UE8M0 scale per 32, one float8_e8m0fnu each; "nvfp4": e2m1 two a byte with an
            e4m3 scale per 16 and a per-tensor scale each dispatch takes). None: the format of
            fp8_dispatch and fp8_group (``formats.format_of``). Flags set apart from their defaults must
            agree with it.
        backend: "nvshmem" (Triton kernels over NVLink) or "reference" (torch.distributed).
        timeout_s: bound of every device-side wait, and on the reference backend of the exchange by which
            every rank agrees to a call.
        validate: range-check topk_ids on the device (reported by the next call or check()).
        timing: record per-phase device timestamps of every call, for ``breakdown()``.
        num_sms: at most this many SMs' worth of programs per kernel (None: every SM), so that the
            kernels can run beside a GEMM.
        elastic: go on without a rank that stops answering (nvshmem backend, at most 32 ranks; see the
            module's docstring).
        device: where x, topk_ids, expert_out and the outputs live. The reference backend takes any
            device; nvshmem runs on this process's GPU only. Default: this process's GPU when the group
            is NCCL (or ranks share a GPU), else the CPU.
        puts: which peers the nvshmem backend reaches through NVSHMEM puts and signals (over whatever
            transport NVSHMEM was started with) instead of stores through a peer pointer: "auto" those
            NVSHMEM gives no pointer to (other nodes), "all" every peer (the put path on one node).
            ``peer_paths`` says which path each rank takes. Not with elastic mode.
    """

    TAGS = status.TAGS
    CALLS = ("dispatch", "combine")     # the calls a refusal note names (CommObject._tell_refusal)
    # the layer's shape and options, read-only: EPConfig's fields
    world, rank = _from_config("world"), _from_config("rank")
    max_tokens, hidden, topk = _from_config("max_tokens"), _from_config("hidden"), _from_config("topk")
    num_experts, experts_per_rank = _from_config("num_experts"), _from_config("experts_per_rank")
    dtype, payload, timeout_s = _from_config("dtype"), _from_config("payload"), _from_config("timeout_s")
    fp8_group = _from_config("fp8_group")   # columns per scale (EPConfig.fp8_group), None without scales
    validate, timing, elastic = _from_config("validate"), _from_config("timing"), _from_config("elastic")

    def __init__(self, max_tokens: int, hidden: int, num_experts: int, topk: int, group=None,
                 dtype: torch.dtype = torch.bfloat16, fp8_dispatch: bool = True, fp8_group: int = 128,
                 backend: str = "nvshmem", timeout_s: float = 10.0, validate: bool = True, timing: bool = False,
                 num_sms: int | None = None, device: torch.device | str | None = None, elastic: bool = False,
                 puts: str = "auto", payload: str | PayloadFormat | None = None):
        if not dist.is_initialized():
            raise RuntimeError("EPAllToAll needs torch.distributed to be initialized")
        settings = dict(max_tokens=max_tokens, hidden=hidden, num_experts=num_experts, topk=topk, dtype=dtype,
                        fp8_group=fp8_group if fp8_dispatch else None, backend=backend, num_sms=num_sms,
                        elastic=elastic, puts=puts,
                        payload=payload.name if isinstance(payload, PayloadFormat) else payload)
        self._configure_on_every_rank(
            "EPAllToAll", lambda: self._configure(dist.get_world_size(group), dist.get_rank(group), max_tokens, hidden,
                                                  num_experts, topk, dtype, fp8_dispatch, fp8_group, backend,
                                                  timeout_s, validate, timing, num_sms, elastic, puts, payload),
            settings, group, backend, device)
        sms = self._open(group, backend, device)
        if sms is None:                                   # the reference backend: no NVSHMEM
            self._build(EPResources(group, self.device))
            return
        self._build(EPResources(group, self.device, runtime.symmetric_zeros, min(sms, num_sms or sms),
                                one_launch=runtime.ranks_per_gpu() == 1,
                                put_peers=put_peers(self.world, self.rank, runtime.reaches, puts)))
        self._open_refusals(runtime.symmetric_zeros, runtime.put_on_stream)
        self.protocol.connect(lambda name, buf: [runtime.peer_ptr(buf, r) for r in range(self.world)])
        runtime.barrier()

    @classmethod
    def simulated(cls, world: int, max_tokens: int, hidden: int, num_experts: int, topk: int,
                  dtype: torch.dtype = torch.bfloat16, fp8_dispatch: bool = True, fp8_group: int = 128,
                  timeout_s: float = 5.0, validate: bool = True, timing: bool = False,
                  num_sms: int = 1, elastic: bool = False, puts: str = "auto", nodes: int = 1,
                  payload: str | PayloadFormat | None = None) -> list[EPAllToAll]:
        """Every rank of a `world` in this process, on the CPU, without torch.distributed or NVSHMEM:
        the symmetric buffers are plain tensors (``simulated.simulated_ranks``) and the peer tables hold their
        addresses. The ranks form `nodes` nodes of world / nodes consecutive ranks: a rank reaches the
        ranks of its node through pointers, the others through puts (or every other rank, with puts="all").
        Under the Triton interpreter the kernels run for real, puts emulated (one program at a time: issue
        every rank's sends, with return_recv_hook=True, before any receive); elsewhere it measures the
        host side of a call."""
        if nodes < 1 or world % nodes:
            raise ValueError(f"nodes={nodes} does not divide world={world}")

        def build(ep, rank, symmetric_zeros):
            ep._configure(world, rank, max_tokens, hidden, num_experts, topk, dtype, fp8_dispatch, fp8_group,
                          "nvshmem", timeout_s, validate, timing, num_sms, elastic, puts, payload)
            node = rank * nodes // world
            remote = put_peers(world, rank, lambda r: r * nodes // world == node, puts)
            ep._build(EPResources(None, ep.device, symmetric_zeros, num_sms, put_peers=remote))

        ranks = simulated_ranks(cls, world, build)
        for ep in ranks:
            ep.protocol.connect(lambda name, buf: [other._symmetric[name].data_ptr() for other in ranks])
        return ranks

    # ------------------------------------------------------------------------------------ setup

    def _configure(self, world, rank, max_tokens, hidden, num_experts, topk, dtype, fp8_dispatch, fp8_group,
                   backend, timeout_s, validate, timing=False, num_sms=None, elastic=False, puts="auto",
                   payload=None) -> None:
        payload = check_config(max_tokens, hidden, num_experts, topk, world, dtype, fp8_dispatch, fp8_group,
                               backend, timeout_s, num_sms, elastic, puts, payload)
        self.config = EPConfig(world, rank, max_tokens, hidden, num_experts, topk, dtype, payload, timeout_s,
                               validate, timing, elastic)
        self.backend = backend
        self._dispatches = self._combines = 0            # calls so far: call n uses slot n % slots
        self._in_flight = {"dispatch": 0, "combine": 0}  # receive hooks not yet called
        self._symmetric: dict[str, torch.Tensor] = {}
        self._broken: str | None = None

    def _build(self, resources: EPResources) -> None:
        """The backend's protocol with its buffers and status words."""
        self.protocol = PROTOCOLS[self.backend](self.config, resources)
        self._slots = self.protocol.slots
        self._symmetric = self.protocol.symmetric
        self._watch_status(self.protocol.status)
        # Whether a call's checks are the front's alone (no verdicts exchanged, no ids read on the host): only then
        # may a call that passes them all in one expression skip _check_call (_dispatch_passes, _combine_passes)
        self._own_checks = not (self.protocol.agrees_on_calls or self.protocol.checks_ids_on_host)

    # ------------------------------------------------------------------------------------ checks

    def _context(self) -> str:
        return f"; {self._dispatches} dispatches, {self._combines} combines"

    def _raise_if_failed(self) -> None:
        """The base's checks (destroyed, a timeout), then what the protocol's own status words report."""
        if self._broken or self.protocol.reported():
            super()._raise_if_failed()
            self.protocol.raise_reported()

    def _calls(self) -> dict[str, int]:
        return {"dispatch": self._dispatches, "combine": self._combines}

    def _dispatch_passes(self, x, topk_ids, topk_weights, mode, tensor_scale) -> int | None:
        """T, the token count, if ``_check_call`` would let this dispatch through with nothing to raise or
        agree on, in one expression: nothing failed earlier (``_raise_if_failed``), the checks are this
        front's own, and every check of _check_dispatch_args passes. Else None: the checks one at a time
        name what is wrong. The common case at a fraction of their host time."""
        try:
            c, device = self.config, self.device
            tokens, hidden = x.shape
            rows = (tokens, c.topk)
            passes = (self._own_checks and not self._broken and not self.protocol.reported()
                      and x.dtype == c.dtype and topk_ids.dtype in IDS_DTYPES and topk_weights.dtype in WEIGHT_DTYPES
                      and hidden == c.hidden and topk_ids.shape == rows and topk_weights.shape == rows
                      and tokens <= c.max_tokens and x.device == device and topk_ids.device == device
                      and topk_weights.device == device and x.is_contiguous() and topk_ids.is_contiguous()
                      and topk_weights.is_contiguous() and self._in_flight["dispatch"] < self._slots
                      and mode in MODES
                      and (tensor_scale is None if not c.payload.tensor_scale else
                           tensor_scale.dtype == torch.float32 and tensor_scale.shape in TENSOR_SCALE_SHAPES
                           and tensor_scale.device == device))
            return tokens if passes else None
        except (AttributeError, TypeError, ValueError):
            return None

    def _check_dispatch_args(self, x, topk_ids, topk_weights, mode, tensor_scale) -> int:
        """ValueError unless x [T, H], topk_ids and topk_weights [T, K], `mode` and `tensor_scale` are a dispatch
        this object can take now (ids in range, where the protocol reads them on the host); T."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self._check_tensor_scale(tensor_scale)
        self._expect("x", x, (self.dtype,), dim=2)
        tokens = x.shape[0]
        if x.shape[1] != self.hidden:
            raise ValueError(f"x has hidden size {x.shape[1]}, this EPAllToAll was built for {self.hidden}")
        if tokens > self.max_tokens:
            raise ValueError(f"{tokens} tokens is more than max_tokens={self.max_tokens}")
        self._expect("topk_ids", topk_ids, IDS_DTYPES, shape=(tokens, self.topk))
        self._expect("topk_weights", topk_weights, WEIGHT_DTYPES, shape=(tokens, self.topk))
        if self.protocol.checks_ids_on_host and self.validate and tokens:
            self.protocol.check_ids(topk_ids)
        if self._in_flight["dispatch"] >= self._slots:
            raise ValueError("two dispatches are already in flight: call the receive hook of the earlier one first")
        return tokens

    def _check_tensor_scale(self, tensor_scale) -> None:
        """ValueError unless `tensor_scale` is what the payload format asks for: with a per-tensor scale
        (nvfp4) a float32 [1] or [] on this object's device, without one None."""
        name = self.payload.name
        if not self.payload.tensor_scale:
            if tensor_scale is not None:
                raise ValueError(f"payload format {name!r} has no per-tensor scale: pass no tensor_scale")
            return
        if tensor_scale is None:
            raise ValueError(f"payload format {name!r} needs tensor_scale: its per-tensor scale, float32 [1] on "
                             f"{self.device}, the same on every rank (a calibrated input scale)")
        self._expect("tensor_scale", tensor_scale, (torch.float32,), contiguous=False)
        if tensor_scale.shape not in TENSOR_SCALE_SHAPES:
            raise ValueError(f"tensor_scale has shape {tuple(tensor_scale.shape)}, expected (1,) or ()")

    def _combine_passes(self, expert_out, handle, out) -> bool:
        """Whether ``_check_call`` would let this combine through with nothing to raise or agree on, in one
        expression (as _dispatch_passes): nothing failed earlier, the checks are this front's own, and every
        check of _check_combine_args passes."""
        try:
            c, device = self.config, self.device
            return (self._own_checks and not self._broken and not self.protocol.reported()
                    and isinstance(handle, EPHandle) and handle.owner is self and handle.received
                    and self._dispatches < handle.call + self._slots
                    and expert_out.dtype == c.dtype and expert_out.shape == c.expert_rows
                    and expert_out.device == device and expert_out.is_contiguous()
                    and (out is None or (out.dtype == c.dtype and out.shape == (handle.num_tokens, c.hidden)
                                         and out.device == device and out.is_contiguous()))
                    and self._in_flight["combine"] < self._slots)
        except (AttributeError, TypeError):
            return False

    def _check_combine_args(self, expert_out, handle, out) -> None:
        """ValueError unless expert_out [E_loc, W*T_max, H], `handle` and `out` are a combine this object can
        take now."""
        self._expect("expert_out", expert_out, (self.dtype,), shape=self.config.expert_rows)
        if not isinstance(handle, EPHandle) or not handle.received:
            raise ValueError("combine needs the handle of a dispatch whose receive has completed")
        if handle.owner is not self:
            raise ValueError("combine needs a handle of this EPAllToAll's own dispatch, and this one came from "
                             "another EPAllToAll")
        if self._dispatches >= handle.call + self._slots:
            raise ValueError("stale handle: its dispatch buffers were reused by a later dispatch")
        if out is not None:
            self._expect("out", out, (self.dtype,), shape=(handle.num_tokens, self.hidden))
        if self._in_flight["combine"] >= self._slots:
            raise ValueError("two combines are already in flight: call the receive hook of the earlier one first")

    # ------------------------------------------------------------------------------------ dispatch

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 return_recv_hook: bool = False, mode: str = "auto", tensor_scale: torch.Tensor | None = None):
        """Send each token to the ranks of its experts; receive this rank's experts' rows.

        Args:
            x: [T, H] tokens, T <= max_tokens, dtype `dtype`.
            topk_ids: [T, K] int32/int64 expert ids, -1 = dropped slot.
            topk_weights: [T, K] float32/bfloat16/float16, kept for combine.
            mode: "auto", "decode" or "prefill": which kernels run (see the module's docstring); the
                results are the same.
            tensor_scale: for a payload format with a per-tensor scale ("nvfp4"), and only there: float32 [1]
                (or []) on the device, > 0 and the same on every rank: a calibrated one, as a checkpoint's input
                scale (amax / (448 * 6), NVIDIA's decode scale; ``payload.tensor_scale_of`` measures one).
                Read on the device, no sync: its value is not checked. Where tokens exceed 448 * 6 times it,
                their block scales saturate at 448 and their elements at 6.
        Returns:
            recv_x: [E_loc, W*T_max, H / P] of the payload's ``payload_dtype`` (float8_e4m3fn; `dtype` without
                scales; uint8 e2m1 pairs for "nvfp4", P = its ``element_pack``, 2, else 1): rows
                [0, recv_count[e]) of expert e are valid, in (source rank, token, k) order.
            recv_scales: [E_loc, W*T_max, G] of the payload's ``scale_dtype``, the scales of those rows as
                ``PayloadFormat.quantize`` makes them (``payload.dequantize(recv_x, recv_scales)`` decodes, with
                ``tensor_scale`` for "nvfp4"): G = H/128 float32 for "fp8", H/512 int32 for "fp8_ue8m0", H/32
                float8_e8m0fnu for "mxfp8", H/16 float8_e4m3fn for "nvfp4"; None without scales.
            recv_count: [E_loc] int32 on the device.
            handle: what combine needs.
            hook (with return_recv_hook=True): launches the receive; read the outputs only after it.
        The outputs stay valid until the dispatch after next.
        """
        tokens = self._dispatch_passes(x, topk_ids, topk_weights, mode, tensor_scale)
        if tokens is None:
            tokens = self._check_call("dispatch", self._check_dispatch_args, x, topk_ids, topk_weights, mode,
                                      tensor_scale, agreed=self.protocol.agrees_on_calls)
        slot = self._dispatches % self._slots
        self._dispatches += 1
        call, protocol = self._dispatches, self.protocol
        if return_recv_hook and not protocol.receives_at_send:
            protocol.dispatch_send(slot, x, topk_ids, topk_weights, call, mode, tensor_scale)
            recv_x, recv_scales, recv_count, recv_src = protocol.outputs[slot]
            handle = EPHandle(slot, call, tokens, topk_ids, recv_src, lost=protocol.lost(slot, tokens), owner=self)
            self._in_flight["dispatch"] += 1
            return recv_x, recv_scales, recv_count, handle, _ReceiveHook(
                "dispatch", functools.partial(self._dispatch_received, slot, handle))
        protocol.dispatch(slot, x, topk_ids, topk_weights, call, mode, tensor_scale)
        recv_x, recv_scales, recv_count, recv_src = protocol.outputs[slot]
        handle = EPHandle(slot, call, tokens, topk_ids, recv_src, True, protocol.lost(slot, tokens), self)
        return (recv_x, recv_scales, recv_count, handle, _no_hook) if return_recv_hook else \
            (recv_x, recv_scales, recv_count, handle)

    def _dispatch_received(self, slot: int, handle: EPHandle) -> None:
        """A dispatch's receive hook: launch the receive."""
        self._in_flight["dispatch"] -= 1
        self.protocol.dispatch_recv(slot)
        handle.received = True

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
        if not self._combine_passes(expert_out, handle, out):
            self._check_call("combine", self._check_combine_args, expert_out, handle, out,
                             agreed=self.protocol.agrees_on_calls)
        slot = self._combines % self._slots
        self._combines += 1
        protocol = self.protocol
        if return_recv_hook and not protocol.receives_at_send:
            y = protocol.combined(slot, handle.num_tokens) if out is None else out
            protocol.combine_send(slot, handle.slot, expert_out)
            self._in_flight["combine"] += 1
            return y, _ReceiveHook("combine", functools.partial(self._combine_received, slot, handle, y))
        y = protocol.combine(slot, handle.slot, expert_out, out, handle.topk_ids, handle.num_tokens)
        return (y, _no_hook) if return_recv_hook else y

    def _combine_received(self, slot: int, handle: EPHandle, y: torch.Tensor) -> None:
        """A combine's receive hook: launch the receive into y."""
        self._in_flight["combine"] -= 1
        self.protocol.combine_recv(slot, handle.slot, y, handle.topk_ids, handle.num_tokens)

    # ------------------------------------------------------------------------------------ replays

    def replay_slots(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> tuple | None:
        """For a caller that replays a CUDA graph of a dispatch and its combine captured on this object (EPMoE's
        eager forwards): the slots (dispatch's, combine's) a dispatch of x, topk_ids, topk_weights and its
        combine would take now, if that dispatch passes its checks with nothing to raise (``_dispatch_passes``)
        and a combine may start; else None, and the caller makes the calls, whose checks say what is wrong.
        A graph replays on the slots it was captured on only; after it, ``replayed()``."""
        if self._dispatch_passes(x, topk_ids, topk_weights, "auto", None) is None \
                or self._in_flight["combine"] >= self._slots:
            return None
        return self._dispatches % self._slots, self._combines % self._slots

    def replayed(self) -> None:
        """Count the dispatch and the combine a caller's graph just replayed (``replay_slots``): the next calls
        take the slots after theirs. An out-of-range expert id in a replayed dispatch is reported (ValueError,
        at the next call) under the number of the call the graph captured."""
        self._dispatches += 1
        self._combines += 1

    @property
    def one_launch_tokens(self) -> int:
        """The most tokens an eager "auto" dispatch takes the one-launch decode tiles for: up to it a call's host
        time outweighs what the prefill tiles save on the GPU (``low_latency.ONE_LAUNCH_TOKENS``, or what
        ``measure_crossover`` measured; 0 on the reference backend)."""
        return self.protocol.one_launch_tokens

    @property
    def calls(self) -> tuple[int, int]:
        """(dispatches, combines) made so far, replayed ones included: call n takes slot n % 2."""
        return self._dispatches, self._combines

    def rewind(self, calls: tuple[int, int]) -> None:
        """Set the calls made so far back to `calls` (an earlier ``calls``), for a caller whose CUDA graph capture
        of calls failed: a capture runs nothing, so the next calls take the slots the captured ones took."""
        self._dispatches, self._combines = calls

    # ------------------------------------------------------------------------------------ elastic

    def mask_ranks(self, ranks) -> None:
        """Count `ranks` dead from the next call on (``elastic=True``). Collective over the survivors: each
        calls it between the same two calls (no communication: the masks agree by program order). A
        masked rank must make no further call."""
        if not self.elastic:
            raise ValueError("mask_ranks needs EPAllToAll(..., elastic=True)")
        ranks = sorted(set(ranks))
        if not all(isinstance(r, int) and 0 <= r < self.world for r in ranks):
            raise ValueError(f"ranks must be ints in [0, {self.world}), got {ranks}")
        if self.rank in ranks:
            raise ValueError(f"rank {self.rank} cannot mask itself")
        if self.in_flight:
            raise ValueError("a dispatch or combine is in flight: call its receive hook before masking ranks")
        self._raise_if_failed()
        self.protocol.mask_ranks(ranks)

    def keep_ranks(self, live: torch.Tensor) -> None:
        """Count dead from the next call on (``elastic=True``) every rank whose word of `live` is 0: `live` is
        int [W] on this object's device (an engine's mask of the group's ranks, 1 = live), read on the device
        in stream order, with no sync (a CUDA graph can hold it): ``mask_ranks`` for a mask the host has not
        read. This rank's own word is not read (a rank cannot mask itself), and a rank counted dead stays
        dead. Collective over the survivors as mask_ranks is: each calls it between the same two calls."""
        if not self.elastic:
            raise ValueError("keep_ranks needs EPAllToAll(..., elastic=True)")
        self._expect("live", live, IDS_DTYPES, shape=(self.world,), contiguous=False)
        if self.in_flight:
            raise ValueError("a dispatch or combine is in flight: call its receive hook before masking ranks")
        self._raise_if_failed()
        self.protocol.keep_ranks(live)

    @property
    def in_flight(self) -> int:
        """Dispatches and combines issued with return_recv_hook=True whose receive hook is not yet called."""
        return sum(self._in_flight.values())

    @property
    def peer_paths(self) -> list[str]:
        """How this rank reaches each rank [W]: "local" (itself), "nvlink" (stores through a peer pointer),
        "put" (NVSHMEM puts and signals), or "collective" (the reference backend's torch.distributed)."""
        return self.protocol.peer_paths()

    def live_ranks(self) -> list[int]:
        """The ranks this one counts live: all of them unless elastic mode lost or masked some. Reads the
        device's mask after the work queued so far (a sync)."""
        return self.protocol.live_ranks()

    @property
    def live_mask(self) -> torch.Tensor:
        """int32 [W] on the device (``elastic=True``): 1 for each rank this one counts live, 0 once lost or
        masked. The kernels' own mask: read it in stream order (no sync, so a CUDA graph can hold the read),
        never write it (``mask_ranks`` does)."""
        if not self.elastic:
            raise ValueError("live_mask needs EPAllToAll(..., elastic=True)")
        return self.protocol.live

    def destroy(self) -> None:
        """Free the buffers (collective over every rank). After an elastic loss a peer can no longer take
        part: RuntimeError instead of a hang."""
        lost = sorted(set(range(self.world)) - set(self.live_ranks())) if self.elastic and self._symmetric else []
        if lost:
            raise RuntimeError(f"ranks {lost} are lost: freeing symmetric memory is collective over every rank, so "
                               "the survivors' buffers are released when their processes end")
        super().destroy()

    # ------------------------------------------------------------------------------------ timing

    def breakdown(self) -> dict[str, float]:
        """Microseconds per phase of the last dispatch and combine, from this rank's device stamps
        (``timing=True``; waits for the GPU). Per op: send (first send program started -> last byte
        issued), signal (-> the last sender program's signal), wait (-> the receiver saw every
        rank's signal: launch gap and slower peers), recv (-> receive done), total."""
        if not self.timing:
            raise ValueError("breakdown() needs EPAllToAll(..., timing=True)")
        return self.protocol.breakdown()

    def measure_crossover(self, sizes=None, iters: int = 20) -> int:
        """Time eager dispatches of mode "decode" and "prefill" on this GPU and let "auto" take the faster
        tiles: decode up to the returned token count, prefill above (collective: every rank calls it with
        the same arguments, with no dispatch or combine in flight; earlier handles are stale afterwards).

        Each dispatch (send and receive) of random routing is timed alone with CUDA events after a barrier,
        median of `iters` calls after a warm-up, at each token count of `sizes` (default: 16, 32, 64, ...
        below max_tokens, and max_tokens); each time is the slowest rank's, so every rank decides alike.

        Returns:
            the largest of `sizes` at which the decode tiles were faster (0 if at none), now the protocol's
            `one_launch_tokens`.
        """
        if not isinstance(self.protocol, KernelProtocol):
            raise ValueError(f"measure_crossover times kernel tiles, and the {self.backend} backend has none")
        if self.in_flight:
            raise ValueError("a dispatch or combine is in flight: call its receive hook before measure_crossover")
        if self.device.type != "cuda":
            raise ValueError(f"measure_crossover times kernels on a CUDA device; this EPAllToAll runs on {self.device}")
        untimed = why_untimed(self.device)
        if untimed is not None:
            raise ValueError(f"measure_crossover would measure nothing useful here: {untimed}")
        if sizes is None:
            sizes = [2**p for p in range(4, self.max_tokens.bit_length())] + [self.max_tokens]
        sizes = sorted(set(sizes))
        if not sizes or not all(isinstance(t, int) and 1 <= t <= self.max_tokens for t in sizes):
            raise ValueError(f"sizes must be token counts in [1, max_tokens={self.max_tokens}], got {sizes}")
        if not isinstance(iters, int) or iters < 1:
            raise ValueError(f"iters must be a positive int, got {iters!r}")
        g = torch.Generator().manual_seed(self.rank)
        x = torch.randn(sizes[-1], self.hidden, generator=g).to(self.device, self.dtype)
        ids, weights = random_topk(sizes[-1], self.num_experts, self.topk, device=self.device, generator=g)

        # nvfp4's per-tensor scale: this rank's own (what the rows decode to is never read here)
        scale = self.payload.tensor_scale_of(x).reshape(1) if self.payload.tensor_scale else None

        def dispatch(tokens: int, mode: str):
            return lambda: self.dispatch(x[:tokens], ids[:tokens], weights[:tokens], mode=mode, tensor_scale=scale)

        times = [[median_us(dispatch(t, mode), iters, before=runtime.barrier) for t in sizes]
                 for mode in ("decode", "prefill")]
        slowest = torch.tensor(times, device=self.device if dist.get_backend(self.group) == "nccl" else "cpu")
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=self.group)
        self.protocol.one_launch_tokens = crossover_tokens(sizes, *slowest.tolist())
        return self.protocol.one_launch_tokens


class _ReceiveHook:
    """The one-shot receive of a dispatch or combine issued with return_recv_hook=True; counts as in
    flight until called."""

    __slots__ = ("op", "receive", "done")

    def __init__(self, op: str, receive):
        self.op, self.receive, self.done = op, receive, False

    def __call__(self) -> None:
        if self.done:
            raise RuntimeError(f"the {self.op} receive hook was already called")
        self.done = True
        self.receive()


def _no_hook() -> None:
    """The receive hook of a protocol whose sends deliver at once: its receive already happened."""


def payload_format(payload, fp8_dispatch: bool = True, fp8_group: int = FP8_GROUP,
                   dtype: torch.dtype = torch.bfloat16) -> PayloadFormat:
    """The PayloadFormat EPAllToAll's arguments ask for: `payload` (a name of ``formats.FORMATS`` or a
    PayloadFormat), or with None the format of the flags (``formats.format_of``). ValueError for an unknown
    name, for flags set apart from their defaults (fp8_dispatch=True, fp8_group=128) that disagree with the
    payload (fp8_dispatch=False with scales; an fp8_group other than the payload's group), for a format
    dispatch does not apply (its scales, packing and per-tensor scale not a row of DISPATCH_SCALES: a
    PayloadFormat made apart from FORMATS), and for an unscaled format that is not x's dtype."""
    if payload is None:
        return format_of(fp8_dispatch, fp8_group, dtype)
    fmt = FORMATS.get(payload) if isinstance(payload, str) else payload
    if not isinstance(fmt, PayloadFormat):
        raise ValueError(f"payload must be one of {tuple(FORMATS)}, a PayloadFormat or None, got {payload!r}")
    if (not fp8_dispatch and fmt.group) or (fp8_group != FP8_GROUP and fp8_group != fmt.group):
        raise ValueError(f"payload={fmt.name!r} disagrees with fp8_dispatch={fp8_dispatch}, fp8_group={fp8_group}: "
                         f"pass the payload alone")
    if not dispatchable(fmt):
        raise ValueError(f"payload format {fmt.name!r} is not supported by dispatch; supported: "
                         f"{', '.join(DISPATCH_FORMATS)}")
    if not fmt.group and fmt.payload_dtype != dtype:
        raise ValueError(f"payload format {fmt.name!r} sends x as it is, and dtype is {dtype}")
    return fmt


def check_config(max_tokens, hidden, num_experts, topk, world, dtype, fp8_dispatch, fp8_group, backend,
                 timeout_s=10.0, num_sms=None, elastic=False, puts="auto", payload=None) -> PayloadFormat:
    """The ValueError EPAllToAll(...) would raise for these arguments on `world` ranks, without building it;
    else the payload format they ask for (``payload_format``)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if puts not in PUTS:
        raise ValueError(f"puts must be one of {PUTS}, got {puts!r}")
    if puts == "all" and (backend != "nvshmem" or elastic):
        raise ValueError("puts='all' needs backend='nvshmem' and elastic=False")
    if elastic and backend != "nvshmem":
        raise ValueError(f"elastic=True needs backend='nvshmem' (the {backend} backend cannot go on without a rank)")
    if elastic and world > MAX_ELASTIC_WORLD:
        raise ValueError(f"elastic=True supports at most {MAX_ELASTIC_WORLD} ranks, got {world}")
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
    fmt = payload_format(payload, fp8_dispatch, fp8_group, dtype)
    if fmt.scale == "fp32" and hidden % fmt.group:
        raise ValueError(f"hidden={hidden} is not a multiple of fp8_group={fmt.group}")
    if fmt.group:
        fmt.check_hidden(hidden)
    elif hidden % 8:
        raise ValueError(f"hidden={hidden} must be a multiple of 8")
    runtime.check_timeout(timeout_s)
    return fmt
