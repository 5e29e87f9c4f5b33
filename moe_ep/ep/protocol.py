"""What every EP protocol shares: the layer's shape (``EPConfig``) and the base of a protocol
object (``EPProtocol``).

A protocol is one kernel module and one class beside it (``low_latency.LowLatency`` over
``kernels/all_to_all.py``). The class owns
that module's buffers (dataclasses, one comment per field) and its bound kernels, and offers the
front (``moe_ep.ep.EPAllToAll``) its launches, each on the current stream:

    dispatch_send(slot, x, topk_ids, topk_weights, call, mode)   # this rank's tokens to their ranks
    dispatch_recv(slot)                                          # fills outputs[slot]
    combine_send(slot, dispatch_slot, expert_out)                # weighted sums back to their sources
    combine_recv(slot, out, topk_ids, num_tokens)                # adds them up into out [T, H]
    dispatch(...), combine(...)                                  # both phases (one launch where it may)

`mode` (MODES) picks dispatch's kernels: "decode" tiles (one launch without a hook, where the
protocol may), "prefill" tiles (a send and a receive kernel), or "auto": decode up to
`one_launch_tokens` tokens, prefill above.

The front has checked every argument; a protocol trusts them. A new protocol is a new pair of
files beside these.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ..kernels.all_to_all import KERNELS, NUM_SLOTS, STAMPS
from ..launcher import BoundKernel

SLOTS = NUM_SLOTS
MODES = ("auto", "decode", "prefill")     # dispatch's choice of kernels (EPProtocol)


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
    fp8_group: int | None      # columns per FP8 scale, None: no FP8 dispatch
    timeout_s: float           # bound of every device-side wait
    validate: bool             # range-check topk_ids on the device
    timing: bool               # per-phase device timestamps

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world

    @property
    def payload_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.fp8_group else self.dtype

    @property
    def groups(self) -> int:
        """FP8 scale groups per row (1 without FP8: the scales buffers are then unused)."""
        return self.hidden // self.fp8_group if self.fp8_group else 1


class EPProtocol:
    """The base of a protocol: per-kernel program state, timing stamps, peer tables, bound launches.

    Subclasses allocate `dispatch_buffers` and `combine_buffers` (with `out`, combine's results per slot)
    in ``__init__``, between ``_start`` and ``publish`` (which makes `symmetric`, the buffers destroy()
    frees, and `outputs`, dispatch's results per slot), and bind in ``connect`` the launches of each phase:
    `_dispatch_send`, `_dispatch_recv` (per slot), `_combine_send` (per slot and dispatch slot),
    `_combine_recv` (per slot), of both phases at once: `_dispatch` (per slot), `_combine` (per slot
    and dispatch slot), and `_prefill`: dispatch's send and receive kernels (per slot) with the prefill tiles.
    """

    name = ""

    def _start(self, config: EPConfig, device: torch.device, status: torch.Tensor, grid: dict[str, int],
               sms: int) -> None:
        """Program state, all int64: per kernel of `grid` (name -> programs: the names of
        kernels.all_to_all.KERNELS, "dispatch" and "combine" for the one-launch kernels, a name of
        KERNELS + "_prefill" for a phase's kernel bound with other tiles), every
        program's clock word for the bounded waits [grid]; per phase (a row per name of KERNELS), the
        programs finished per slot and the uses of each slot [4, SLOTS] and timing stamps [4, 4] (STAMPS;
        reset to "none yet" before a timed call). A one-launch kernel keeps both its phases' rows. `sms`:
        the SMs a grid may fill."""
        self.config, self.device, self.status, self.grid, self.sms = config, device, status, grid, sms
        self.clocks = {name: self.local((programs,), torch.int64) for name, programs in grid.items()}
        self.finished = self.local((len(KERNELS), SLOTS), torch.int64)
        self.uses = self.local((len(KERNELS), SLOTS), torch.int64)
        self.stamps = self.local((len(KERNELS), len(STAMPS)), torch.int64)
        self._unstamped = self.stamps.clone()
        self._unstamped[:, 0] = torch.iinfo(torch.int64).max
        self._combined_views: dict[tuple[int, int], torch.Tensor] = {}
        self._receivers: list = [None] * SLOTS       # per slot: the receive kernel of its last dispatch_send

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
                    WORLD_PAD=triton.next_power_of_2(c.world), TIMING=c.timing)

    def bind(self, name: str, fn, slot: int, varying=(), **arguments) -> BoundKernel:
        """Kernel `name` (a key of `grid`) bound for `slot` with its program state, use counts and stamps:
        those of its phase, or for a one-launch kernel ("dispatch", "combine") its two phases' rows, the
        send row first (the kernel reaches the receive row by its offset), and a grid that fits on the
        SMs at once: its programs wait for each other between the phases."""
        phase = name.removesuffix("_prefill")          # a split kernel bound with other tiles: the same phase
        one_launch = phase not in KERNELS
        row = KERNELS.index(f"{phase}_send" if one_launch else phase)
        return BoundKernel(fn, self.grid[name], varying, resident_on=self.sms if one_launch else None, slot=slot,
                           clock_ptr=self.clocks[name], finished_ptr=self.finished[row], uses_ptr=self.uses[row],
                           stamps_ptr=self.stamps[row], **self.common_arguments(), **arguments)

    def publish(self, dispatch_peers, combine_peers) -> None:
        """`symmetric` (what destroy() frees) from the peer-table names, and dispatch's outputs per slot
        as views made once."""
        d, c = self.dispatch_buffers, self.combine_buffers
        self.symmetric = {f"{self.name}.dispatch.{n}": getattr(d, n) for n in dispatch_peers}
        self.symmetric.update({f"{self.name}.combine.{n}": getattr(c, n) for n in combine_peers})
        self.outputs = [(d.recv_x[s], d.recv_scales[s] if self.config.fp8_group else None, d.recv_count[s],
                         d.recv_src[s]) for s in range(SLOTS)]

    def combined(self, slot: int, num_tokens: int) -> torch.Tensor:
        """Combine's output for a call of `num_tokens` tokens in `slot`: a view of the slot's [T_max, H]
        buffer, made once per (slot, num_tokens)."""
        view = self._combined_views.get((slot, num_tokens))
        if view is None:
            view = self._combined_views[slot, num_tokens] = self.combine_buffers.out[slot, :num_tokens]
        return view

    # --------------------------------------------------------------------- launches (bound in connect)

    one_launch = True          # calls without a receive hook may run both phases in one launch (False with
    one_launch_tokens = 0      # several ranks on a GPU); "auto" dispatches of more tokens take the prefill tiles

    def dispatch(self, slot: int, x, topk_ids, topk_weights, call: int, mode: str) -> None:
        """Both phases of a dispatch, for a call without a receive hook: in one launch with the decode
        tiles (with `one_launch`), otherwise as a send and a receive kernel."""
        if self.one_launch and not self._prefill_tiles(x.shape[0], mode):
            self.reset_stamps("dispatch")
            self._dispatch[slot](x, topk_ids, topk_weights, x.shape[0], call)
            return
        self.dispatch_send(slot, x, topk_ids, topk_weights, call, mode)
        self.dispatch_recv(slot)

    def combine(self, slot: int, dispatch_slot: int, expert_out, out, topk_ids, num_tokens: int) -> None:
        """Both phases of a combine, for a call without a receive hook: in one launch with `one_launch`."""
        if not self.one_launch:
            self.combine_send(slot, dispatch_slot, expert_out)
            self.combine_recv(slot, out, topk_ids, num_tokens)
            return
        self.reset_stamps("combine")
        self._combine[slot, dispatch_slot](expert_out, out, topk_ids, num_tokens)

    def dispatch_send(self, slot: int, x, topk_ids, topk_weights, call: int, mode: str) -> None:
        """The send kernel of `mode`'s tiles; dispatch_recv(slot) launches the receive kernel of the same."""
        self.reset_stamps("dispatch")
        send, recv = self._prefill if self._prefill_tiles(x.shape[0], mode) else (self._dispatch_send,
                                                                                  self._dispatch_recv)
        self._receivers[slot] = recv[slot]
        send[slot](x, topk_ids, topk_weights, x.shape[0], call)

    def dispatch_recv(self, slot: int) -> None:
        self._receivers[slot]()

    def _prefill_tiles(self, tokens: int, mode: str) -> bool:
        return mode == "prefill" or (mode == "auto" and tokens > self.one_launch_tokens)

    def combine_send(self, slot: int, dispatch_slot: int, expert_out) -> None:
        self.reset_stamps("combine")
        self._combine_send[slot, dispatch_slot](expert_out)

    def combine_recv(self, slot: int, out, topk_ids, num_tokens: int) -> None:
        self._combine_recv[slot](out, topk_ids, num_tokens)

    # --------------------------------------------------------------------- timing

    def reset_stamps(self, op: str) -> None:
        """Before a timed call of `op` (by its send): its two kernels' stamps back to "none yet"."""
        if self.config.timing:
            rows = slice(0, 2) if op == "dispatch" else slice(2, 4)
            self.stamps[rows].copy_(self._unstamped[rows])

    def breakdown(self) -> dict[str, float]:
        """Microseconds per phase of the last dispatch and combine (see EPAllToAll.breakdown)."""
        stamps = dict(zip(KERNELS, self.stamps.tolist()))
        out = {}
        for op in ("dispatch", "combine"):
            (s_start, _, s_worked, s_signaled), (_, r_waited, r_worked, _) = stamps[f"{op}_send"], stamps[f"{op}_recv"]
            out.update({f"{op}_send_us": (s_worked - s_start) / 1e3, f"{op}_signal_us": (s_signaled - s_worked) / 1e3,
                        f"{op}_wait_us": (r_waited - s_signaled) / 1e3, f"{op}_recv_us": (r_worked - r_waited) / 1e3,
                        f"{op}_total_us": (r_worked - s_start) / 1e3})
        return out
