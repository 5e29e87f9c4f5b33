"""What every EP protocol shares: the layer's shape (``EPConfig``), what the front hands a protocol
(``EPResources``), what a protocol offers the front (``EPProtocol``), and the machinery of the protocols
that run Triton kernels over symmetric buffers (``KernelProtocol``).

A protocol owns its buffers, its launches and its status words; the front (``front.EPAllToAll``) checks
every argument, counts calls into buffer slots, makes handles and hooks, and a protocol trusts all that.
What it offers, each launch on the current stream:

    dispatch_send(slot, x, topk_ids, topk_weights, call, mode,   # this rank's tokens to their ranks
                  tensor_scale)
    dispatch_recv(slot)                                          # fills outputs[slot]
    combine_send(slot, dispatch_slot, expert_out)                # weighted sums back to their sources
    combine_recv(slot, dispatch_slot, out, topk_ids, num_tokens)   # adds them up into out [T, H]
    dispatch(...), combine(...) -> y                             # both phases (one launch where it may)
    combined(slot, num_tokens)                                   # combine's y [T, H] when no `out` is given
    lost(dispatch_slot, num_tokens)                              # [T, K] bool: experts an elastic combine lost
    mask_ranks(ranks), keep_ranks(live), live_ranks()            # elastic: the ranks counted live

A protocol whose sends deliver at once (``receives_at_send``: ``collective.CollectiveProtocol``) offers
dispatch and combine only: the front runs them whole and hands out a hook that does nothing.

`tensor_scale` is the per-tensor scale of a payload format with one (nvfp4: float32 [1] or [] on the device),
else None. `mode` (MODES) picks dispatch's kernels: "decode" tiles (one launch without a hook, where the
protocol may), "prefill" tiles (a send and a receive kernel), or "auto": decode up to
`one_launch_tokens` tokens, prefill above and in CUDA graphs.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import triton

from ..formats import PayloadFormat
from ..graphs import capturing
from ..launcher import BoundKernel
from ..runtime import device_library
from ..shmem import INTERPRETING

MODES = ("auto", "decode", "prefill")     # dispatch's choice of kernels (EPProtocol)


def crossover_tokens(sizes, decode_us, prefill_us) -> int:
    """The `one_launch_tokens` measured timings call for: the largest of `sizes` (token counts) at which the
    decode tiles took less time than the prefill tiles (decode_us[i], prefill_us[i]: microseconds at
    sizes[i]), or 0 if they never did."""
    return max((tokens for tokens, decode, prefill in zip(sizes, decode_us, prefill_us) if decode < prefill),
               default=0)


@dataclass(frozen=True)
class EPConfig:
    """One MoE layer's shape on one rank, and the options every protocol honours."""
    world: int
    rank: int
    max_tokens: int            # T: most tokens a rank passes to one dispatch
    hidden: int                # H
    num_experts: int           # E, a multiple of world
    topk: int                  # K
    dtype: torch.dtype         # of x, expert_out and combine's output
    payload: PayloadFormat     # what a token's row becomes on the wire and in recv_x (moe_ep.formats)
    timeout_s: float           # bound of every device-side wait
    validate: bool             # range-check topk_ids
    timing: bool               # per-phase device timestamps
    elastic: bool = False      # go on without a rank that stops answering (EPAllToAll)

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world

    @property
    def fp8_group(self) -> int | None:
        """Columns per scale of the payload (its format's ``group``: 128 for "fp8" and "fp8_ue8m0", 32 for
        "mxfp8"), None without scales. Float32 scales only for "fp8": the others' are ``payload.scale_dtype``."""
        return self.payload.group or None

    @property
    def payload_dtype(self) -> torch.dtype:
        """Of recv_x and of the rows on the wire: the payload format's."""
        return self.payload.payload_dtype

    @property
    def scale_dtype(self) -> torch.dtype:
        """What the scales buffers hold (``PayloadFormat.scale_storage``; float32 without scales: unused)."""
        return self.payload.scale_storage or torch.float32

    @property
    def groups(self) -> int:
        """Scales items per row (``PayloadFormat.scales_shape``; 1 without scales: the scales buffers are then
        unused)."""
        return self.payload.scales_shape(1, self.hidden)[1] if self.payload.group else 1

    @functools.cached_property
    def expert_rows(self) -> tuple[int, int, int]:
        """(E_loc, W * T_max, H): the shape of combine's expert_out, and of a slot's recv_x but for a packed
        payload format's last dimension (H / element_pack) (made once: the front compares it on every combine)."""
        return self.experts_per_rank, self.world * self.max_tokens, self.hidden


@dataclass(frozen=True)
class EPResources:
    """What the front hands a protocol besides the config: where it runs and how it allocates."""
    group: object                          # the process group (None: the default one, or a simulated world)
    device: torch.device                   # where x, the outputs and the local buffers live
    symmetric_zeros: Callable | None = None   # (shape, dtype) -> a zeroed symmetric tensor (collective)
    sms: int = 1                           # SMs a grid may fill, the same on every rank
    one_launch: bool = True                # calls without a receive hook may run both phases in one launch
                                           # (not with several ranks on a GPU: see kernels.all_to_all)
    put_peers: tuple[int, ...] = ()        # the ranks reached by puts, not peer pointers (ep.puts)


class CallShape(NamedTuple):
    """What a KernelProtocol launches for a call of some number of tokens: the kernels whose work is this
    rank's own tokens get grids for those tokens (up to their bound grids), so that a decode call on an
    object sized for prefill starts no programs without work."""
    layout_blocks: int         # dispatch's layout programs
    send: int                  # programs of dispatch's send kernel with the decode tiles
    prefill_send: int          # the same with the prefill tiles
    combine_recv: int          # programs of combine's receive kernel


class EPProtocol:
    """What the front asks of a protocol. A protocol declares its `slots` (call n uses slot n % slots: its
    results stay valid until `slots` calls later), `symmetric` (the buffers destroy() frees), `status` (its
    kernels' int32 status words, the timeout report of ``moe_ep.shmem`` first, or None) and `outputs`
    (per slot, (recv_x, recv_scales, recv_count, recv_src) of the slot's last dispatch), and offers the
    launches of the module docstring."""

    name = ""
    slots = 2
    receives_at_send = False   # sends deliver at once: the front runs both phases and hands out a no-op hook
    agrees_on_calls = False    # calls are host collectives: every rank's verdict on a call is exchanged first
    checks_ids_on_host = False   # topk_ids are range-checked by check_ids before a dispatch, not on the device
    one_launch_tokens = 0      # "auto" dispatches of more tokens take the prefill tiles
    status: torch.Tensor | None = None

    def __init__(self, config: EPConfig, resources: EPResources):
        self.config, self.device = config, resources.device
        self.cuda = resources.device.type == "cuda"      # whether a launch may be captured (``capturing``)
        self.symmetric: dict[str, torch.Tensor] = {}

    def connect(self, peer_addresses) -> None:
        """After every rank has built its protocol (collective): `peer_addresses(name, buffer)` -> every
        rank's address of the symmetric buffer `name`. Protocols without peer tables need nothing."""

    def peer_paths(self) -> list[str]:
        """How this rank reaches each rank: "collective" (a torch.distributed collective) for every rank."""
        return ["collective"] * self.config.world

    def check_ids(self, topk_ids: torch.Tensor) -> None:
        """ValueError if an id lies outside [-1, E) (protocols with checks_ids_on_host)."""

    def reported(self) -> bool:
        """Whether the status words hold a report (a timeout, or a protocol's own): cheap, no sync."""
        return False

    def raise_reported(self) -> None:
        """Raise what the protocol's own status words report (a timeout is the front's to raise)."""

    def live_ranks(self) -> list[int]:
        """The ranks this one counts live: every rank, unless the protocol masks ranks (elastic)."""
        return list(range(self.config.world))

    def lost(self, slot: int, num_tokens: int) -> torch.Tensor | None:
        """What the combine of the dispatch in `slot` lost: None where no rank can be lost."""
        return None

    def breakdown(self) -> dict[str, float]:
        raise ValueError(f"the {self.name} protocol records no timing")


class KernelProtocol(EPProtocol):
    """The base of a protocol over Triton kernels: per-kernel program state, timing stamps, peer tables,
    bound launches. A subclass declares `kernel_names` (its four phase kernels: dispatch_send,
    dispatch_recv, combine_send, combine_recv) and `stamp_names` (the columns of a kernel's timing row).

    Subclasses allocate `dispatch_buffers` and `combine_buffers` (with `out`, combine's results per slot),
    `live` (symmetric int32 [world]: 1 for each rank this one counts live, 0 once masked) and
    `lost_experts` (int8 [slots, T_max, K]: per dispatch slot, the experts its combine lost) in
    ``__init__``, between ``_start`` and ``publish`` (which makes `symmetric`, the buffers destroy() frees,
    and `outputs`, dispatch's results per slot), set `live_peers` (every rank's address of `live`,
    ``live_table``) and bind in ``connect`` the launches of each phase: `_dispatch_send`, `_dispatch_recv`
    (per slot), `_combine_send` (per slot and dispatch slot), `_combine_recv` (per slot and dispatch slot),
    of both phases at once: `_dispatch` (per slot), `_combine` (per slot and dispatch slot), and
    `_prefill`: dispatch's send and receive kernels (per slot) with the prefill tiles; and say in
    ``call_shape`` what a call of some number of tokens launches.
    """

    kernel_names: tuple[str, ...] = ()
    stamp_names: tuple[str, ...] = ()
    remote = 0                 # the ranks reached by puts, as int64 bits (ep.puts): none here
    echo_addr = 0              # the address of the puts' echo words (ep.puts)
    one_wave: tuple[str, ...] = ()       # split kernels whose grid is cut to what the SMs hold at once

    def _start(self, status: torch.Tensor, grid: dict[str, int], sms: int) -> None:
        """Program state, all int64: per kernel of `grid` (name -> programs: the names of kernel_names,
        "dispatch" and "combine" for the one-launch kernels, a name of kernel_names + "_prefill" for a
        phase's kernel bound with other tiles), every program's clock word for the bounded waits [grid]; per
        phase (a row per name of kernel_names), the programs finished per slot, the uses of each slot and
        the ranks an elastic receive read (``all_to_all._agree``) [4, slots], and timing stamps [4, 4]
        (stamp_names; reset to "none yet" before a timed call). A one-launch kernel keeps both its phases'
        rows. `sms`: the SMs a grid may fill; `status`: the
        kernels' status words."""
        self.status, self.grid, self.sms = status, grid, sms
        self.clocks = {name: self.local((programs,), torch.int64) for name, programs in grid.items()}
        self.finished = self.local((len(self.kernel_names), self.slots), torch.int64)
        self.uses = self.local((len(self.kernel_names), self.slots), torch.int64)
        self.agreed = self.local((len(self.kernel_names), self.slots), torch.int64)
        self.stamps = self.local((len(self.kernel_names), len(self.stamp_names)), torch.int64)
        self._unstamped = self.stamps.clone()
        self._unstamped[:, 0] = torch.iinfo(torch.int64).max
        self._views: dict[tuple[str, int, int], torch.Tensor] = {}     # (buffer, slot, tokens) -> a call's rows
        self._shapes: dict[int, CallShape] = {}           # tokens -> call_shape(tokens), made once
        self._receivers: list = [None] * self.slots       # per slot: the receive kernel of its last dispatch_send
        self._ready: set = set()                          # the calls whose every kernel is compiled (_ready_*)

    def peer_paths(self) -> list[str]:
        """How this rank reaches each rank: "local" (itself), "nvlink" (stores through a peer pointer) or
        "put" (NVSHMEM puts and signals: ``ep.puts``)."""
        return ["local" if r == self.config.rank else "put" if self.remote >> r & 1 else "nvlink"
                for r in range(self.config.world)]

    def call_shape(self, tokens: int) -> CallShape:
        """What a call of `tokens` tokens launches (the subclass's grids)."""
        raise NotImplementedError

    def _shape(self, tokens: int) -> CallShape:
        """call_shape(tokens), made once per token count: a call pays a dictionary lookup."""
        shape = self._shapes.get(tokens)
        if shape is None:
            shape = self._shapes[tokens] = self.call_shape(tokens)
        return shape

    def local(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def peer_table(self, side: str, names, peer_addresses) -> torch.Tensor:
        """int64 [len(names), world]: every rank's address of each named symmetric buffer of `side`
        ("dispatch" or "combine")."""
        buffers = getattr(self, f"{side}_buffers")
        rows = [peer_addresses(f"{self.name}.{side}.{name}", getattr(buffers, name)) for name in names]
        for r, address in enumerate(rows[0]):
            if address is None:
                raise ValueError(f"rank {r} is not reachable through NVLink from rank {self.config.rank}: the nvshmem "
                                 "backend needs every rank in one NVLink domain (use backend='reference')")
        return torch.tensor(rows, dtype=torch.int64, device=self.device)

    def common_arguments(self) -> dict:
        """The kernel arguments every EP kernel takes, whatever its protocol."""
        c = self.config
        return dict(rank=c.rank, world=c.world, max_tokens=c.max_tokens, hidden=c.hidden, topk=c.topk,
                    experts_per_rank=c.experts_per_rank, timeout_ns=int(c.timeout_s * 1e9),
                    status_addr=self.status.data_ptr(), K_PAD=triton.next_power_of_2(c.topk),
                    WORLD_PAD=triton.next_power_of_2(c.world), ELASTIC=c.elastic, TIMING=c.timing,
                    remote=self.remote, echo_addr=self.echo_addr, PUTS=self.remote != 0, **self._library())

    def _library(self) -> dict:
        """The compile option that links NVSHMEM's device library, for kernels that put (not under the
        interpreter, which emulates the puts: simulated.SimulatedHeap)."""
        return {"extern_libs": device_library()} if self.remote and not INTERPRETING else {}

    def bind(self, name: str, fn, slot: int, varying=(), **arguments) -> BoundKernel:
        """Kernel `name` (a key of `grid`) bound for `slot` with its program state, use counts and stamps:
        those of its phase, or for a one-launch kernel ("dispatch", "combine") its two phases' rows, the
        send row first (the kernel reaches the receive row by its offset), and a grid that fits on the
        SMs at once: its programs wait for each other between the phases. A phase of `one_wave` gets such a
        grid too."""
        phase = name.removesuffix("_prefill")          # a split kernel bound with other tiles: the same phase
        one_launch = phase not in self.kernel_names
        row = self.kernel_names.index(f"{phase}_send" if one_launch else phase)
        resident = one_launch or phase in self.one_wave
        return BoundKernel(fn, self.grid[name], varying, resident_on=self.sms if resident else None, slot=slot,
                           clock_ptr=self.clocks[name], finished_ptr=self.finished[row], uses_ptr=self.uses[row],
                           stamps_ptr=self.stamps[row], agreed_ptr=self.agreed[row], live_peers=self.live_peers,
                           **self.common_arguments(), **arguments)

    def publish(self, dispatch_peers, combine_peers) -> None:
        """`symmetric` (what destroy() frees) from the peer-table names, and dispatch's outputs per slot
        as views made once."""
        d, c = self.dispatch_buffers, self.combine_buffers
        self.symmetric = {f"{self.name}.dispatch.{n}": getattr(d, n) for n in dispatch_peers}
        self.symmetric.update({f"{self.name}.combine.{n}": getattr(c, n) for n in combine_peers})
        self.symmetric[f"{self.name}.live"] = self.live
        payload = self.config.payload
        self.outputs = [(d.recv_x[s], d.recv_scales[s].view(payload.scale_dtype) if payload.group else None,
                         d.recv_count[s], d.recv_src[s]) for s in range(self.slots)]

    def live_table(self, peer_addresses) -> torch.Tensor:
        """int64 [world]: every rank's address of the live mask (its peers clear a rank's word in all of them)."""
        return torch.tensor(peer_addresses(f"{self.name}.live", self.live), dtype=torch.int64, device=self.device)

    def mask_ranks(self, ranks: list[int]) -> None:
        """Count `ranks` dead from the next launch on (stream-ordered: no sync)."""
        self.live[ranks] = 0

    def keep_ranks(self, live: torch.Tensor) -> None:
        """Count dead from the next launch on every rank but this one whose word of `live` [W] is 0
        (stream-ordered: no sync)."""
        self.live.mul_((live != 0).to(self.live.dtype) | self._own_word)

    @functools.cached_property
    def _own_word(self) -> torch.Tensor:
        """int32 [W]: 1 at this rank, 0 elsewhere (what keep_ranks never clears)."""
        word = self.local((self.config.world,), torch.int32)
        word[self.config.rank] = 1
        return word

    def live_ranks(self) -> list[int]:
        """The ranks this one counts live (reads the device: a sync)."""
        return [r for r, alive in enumerate(self.live.tolist()) if alive]

    def lost(self, slot: int, num_tokens: int) -> torch.Tensor | None:
        """The lost-expert report [T, K] bool of the dispatch in `slot` (written by its combine), a view made
        once per (slot, num_tokens); None unless elastic."""
        return self._rows("lost", self.lost_experts, slot, num_tokens, torch.bool) if self.config.elastic else None

    def combined(self, slot: int, num_tokens: int) -> torch.Tensor:
        """Combine's output for a call of `num_tokens` tokens in `slot`: a view of the slot's [T_max, H]
        buffer, made once per (slot, num_tokens)."""
        return self._rows("combined", self.combine_buffers.out, slot, num_tokens)

    def _rows(self, name: str, buffer: torch.Tensor, slot: int, num_tokens: int, dtype=None) -> torch.Tensor:
        """buffer[slot, :num_tokens] (viewed as `dtype` if given), made once per (name, slot, num_tokens): a
        call's outputs cost no slicing on the host."""
        view = self._views.get((name, slot, num_tokens))
        if view is None:
            view = buffer[slot, :num_tokens]
            self._views[name, slot, num_tokens] = view = view if dtype is None else view.view(dtype)
        return view

    # --------------------------------------------------------------------- launches (bound in connect)

    one_launch = True          # calls without a receive hook may run both phases in one launch (EPResources)

    def _send_values(self, x, topk_ids, topk_weights, tokens: int, call: int, tensor_scale) -> tuple:
        """The values of a dispatch send's per-call arguments (``low_latency.dispatch_arguments``): the
        inputs, the token count T (x's rows), the call, its layout programs, and the tensor scale where the
        format has one."""
        values = (x, topk_ids, topk_weights, tokens, call, self._shape(tokens).layout_blocks)
        return values if tensor_scale is None else (*values, tensor_scale)

    def _ready_dispatch(self, slot: int, topk_ids, values: tuple) -> None:
        """Before an eager dispatch of these send `values` (``_send_values``, `topk_ids` among them): compile
        every dispatch kernel of `slot` for inputs like these (both tiles, one launch and two), once. Ranks
        whose calls take different kernels (their token counts or modes differ) then compile the same ones at
        their first call, instead of one rank compiling a kernel its peers have while they wait for it, past
        timeout_s on a cold compile cache. With puts, once per specialization, so that a CUDA graph captured
        later compiles none: their modules link NVSHMEM, which cannot initialize one while a stream is being
        captured; without, once per ids dtype (a launch compiles any other specialization itself, as it may
        inside a capture)."""
        key = ("dispatch", slot, topk_ids.dtype)
        if not self.remote and key in self._ready:          # the common case: nothing more to build
            return
        if self.remote:
            key = ("dispatch", slot, self._dispatch_send[slot].key(values))
        if key in self._ready or capturing(self.cuda):
            return
        sends = [self._dispatch_send[slot], self._prefill[0][slot]]
        if self.one_launch:
            sends.append(self._dispatch[slot])
        for kernel in sends:
            kernel.prepare(*values)
        self._dispatch_recv[slot].prepare()
        self._prefill[1][slot].prepare()
        self._ready.add(key)

    def _ready_combine(self, slot: int, dispatch_slot: int, expert_out, out, topk_ids, num_tokens: int) -> None:
        """With puts, before an eager combine without a hook: its send and receive kernels compiled too
        (``_ready_dispatch``)."""
        if capturing(self.cuda):
            return
        receive = (out, topk_ids, num_tokens)
        key = ("combine", slot, dispatch_slot, self._combine_send[slot, dispatch_slot].key((expert_out,)),
               self._combine_recv[slot, dispatch_slot].key(receive))
        if key in self._ready:
            return
        self._combine_send[slot, dispatch_slot].prepare(expert_out)
        self._combine_recv[slot, dispatch_slot].prepare(*receive)
        self._ready.add(key)

    def dispatch(self, slot: int, x, topk_ids, topk_weights, call: int, mode: str, tensor_scale=None) -> None:
        """Both phases of a dispatch, for a call without a receive hook: in one launch with the decode
        tiles (with `one_launch`), otherwise as a send and a receive kernel."""
        tokens = x.shape[0]
        values = self._send_values(x, topk_ids, topk_weights, tokens, call, tensor_scale)
        self._ready_dispatch(slot, topk_ids, values)
        prefill = self._prefill_tiles(tokens, mode)
        if self.one_launch and not prefill:
            self.reset_stamps("dispatch")
            self._dispatch[slot](*values)
            return
        self._send(slot, tokens, values, prefill)
        self.dispatch_recv(slot)

    def combine(self, slot: int, dispatch_slot: int, expert_out, out, topk_ids, num_tokens: int) -> torch.Tensor:
        """Both phases of a combine, for a call without a receive hook: in one launch with `one_launch`.
        Returns y: `out`, or without it (None) the view ``combined`` makes."""
        if out is None:
            out = self.combined(slot, num_tokens)
        if self.remote:
            self._ready_combine(slot, dispatch_slot, expert_out, out, topk_ids, num_tokens)
        if not self.one_launch:
            self.combine_send(slot, dispatch_slot, expert_out)
            self.combine_recv(slot, dispatch_slot, out, topk_ids, num_tokens)
            return out
        self.reset_stamps("combine")
        self._combine[slot, dispatch_slot](expert_out, out, topk_ids, num_tokens)
        return out

    def dispatch_send(self, slot: int, x, topk_ids, topk_weights, call: int, mode: str, tensor_scale=None) -> None:
        """The send kernel of `mode`'s tiles; dispatch_recv(slot) launches the receive kernel of the same."""
        tokens = x.shape[0]
        values = self._send_values(x, topk_ids, topk_weights, tokens, call, tensor_scale)
        self._ready_dispatch(slot, topk_ids, values)
        self._send(slot, tokens, values, self._prefill_tiles(tokens, mode))

    def _send(self, slot: int, tokens: int, values: tuple, prefill: bool) -> None:
        """Dispatch's send kernel of a call of `tokens` tokens with these `values` (``_send_values``), with the
        prefill tiles or the decode tiles, its receive kernel kept for dispatch_recv(slot)."""
        self.reset_stamps("dispatch")
        shape = self._shape(tokens)
        send, recv = self._prefill if prefill else (self._dispatch_send, self._dispatch_recv)
        self._receivers[slot] = recv[slot]
        send[slot](*values, programs=shape.prefill_send if prefill else shape.send)

    def dispatch_recv(self, slot: int) -> None:
        self._receivers[slot]()

    def _prefill_tiles(self, tokens: int, mode: str) -> bool:
        """Whether a dispatch of `tokens` in `mode` takes the prefill tiles: "auto" does above
        one_launch_tokens, and at any size while the stream is being captured into a CUDA graph. The
        decode tiles' one launch saves host time, which a replay does not spend; in replays the prefill
        tiles were the faster at every size measured (16 to 4096 tokens, one H200: benchmarks/NOTES.md)."""
        if mode != "auto":
            return mode == "prefill"
        return tokens > self.one_launch_tokens or capturing(self.cuda)

    def combine_send(self, slot: int, dispatch_slot: int, expert_out) -> None:
        self.reset_stamps("combine")
        self._combine_send[slot, dispatch_slot](expert_out)

    def combine_recv(self, slot: int, dispatch_slot: int, out, topk_ids, num_tokens: int) -> None:
        self._combine_recv[slot, dispatch_slot](out, topk_ids, num_tokens,
                                                programs=self._shape(num_tokens).combine_recv)

    # --------------------------------------------------------------------- timing

    def reset_stamps(self, op: str) -> None:
        """Before a timed call of `op` (by its send): its two kernels' stamps back to "none yet"."""
        if self.config.timing:
            rows = slice(0, 2) if op == "dispatch" else slice(2, 4)
            self.stamps[rows].copy_(self._unstamped[rows])

    def breakdown(self) -> dict[str, float]:
        """Microseconds per phase of the last dispatch and combine (see EPAllToAll.breakdown)."""
        stamps = dict(zip(self.kernel_names, self.stamps.tolist()))
        out = {}
        for op in ("dispatch", "combine"):
            (s_start, _, s_worked, s_signaled), (_, r_waited, r_worked, _) = stamps[f"{op}_send"], stamps[f"{op}_recv"]
            out.update({f"{op}_send_us": (s_worked - s_start) / 1e3, f"{op}_signal_us": (s_signaled - s_worked) / 1e3,
                        f"{op}_wait_us": (r_waited - s_signaled) / 1e3, f"{op}_recv_us": (r_worked - r_waited) / 1e3,
                        f"{op}_total_us": (r_worked - s_start) / 1e3})
        return out
