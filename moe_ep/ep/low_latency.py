"""The low-latency protocol (decode): its buffers and launches over ``kernels/all_to_all.py``.

Work items are one token row (chunk) each, signals one per (call, peer): the fewest steps
between a call and its result, for tens to hundreds of tokens per rank ("decode" tiles). Its
dispatch kernels are bound a second time with larger work items ("prefill" tiles), for thousands.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import triton

from ..formats import FP8_GROUP
from ..kernels import all_to_all as kernels
from ..kernels.status import EP_STATUS_WORDS, STATUS_BAD_CALL, STATUS_BAD_ID, STATUS_BAD_INDEX, STATUS_EVICTED
from ..runtime import CommTimeoutError
from ..shmem import INTERPRETING
from .protocol import CallShape, EPConfig, EPResources, KernelProtocol
from .puts import PutPeers

SLOTS = kernels.NUM_SLOTS
BAD_CALL, EVICTED = STATUS_BAD_CALL.value, STATUS_EVICTED.value    # status words read at every call, as ints

# Programs (of 4 warps) per SM, at most: enough for the grid-stride loops to keep rows in flight against HBM
# and NVLink latency. A split kernel may ask for more than fit at once (the rest start as SMs free up); the
# one-launch kernels' programs wait for each other, so their grids are cut to what the compiled kernel's
# registers let the SMs hold at once (launcher.resident_programs; ptxas for sm_90 at H = 7168, top-8, 64
# tokens on 2 ranks: dispatch 124 registers a thread, 4 programs per SM; combine 90, 5).
PROGRAMS_PER_SM = {"dispatch_send": 5, "dispatch_recv": 8, "combine_send": 8, "combine_recv": 8,
                   "dispatch": 8, "combine": 8}
# Eager dispatches of mode "auto" take the decode tiles up to this many tokens, in one launch without a hook, the
# prefill tiles above. Measured across GPUs, a GPU a rank (H = 7168, top-8, FP8; eager, us, decode / prefill tiles;
# benchmarks/results/all_to_all_{2,4}gpus.json): 2 x H200 at 16, 128, 512 tokens: 36.7 / 40.6, 44.8 / 48.8,
# 89.2 / 62.9; 4 x H200: 40.8 / 40.8, 53.8 / 51.2, 130.8 / 92.9. One launch saves host time, but the decode tiles'
# one wave of programs, which must all wait for every peer, loses to the prefill tiles' split kernels by 512
# tokens. (On one GPU, with no peer to wait for, the crossover was 512; benchmarks/NOTES.md.) In CUDA graphs,
# where no launch costs host time, "auto" takes the prefill tiles at every size. Combine runs in one launch at
# every size. EPAllToAll.measure_crossover replaces it with the crossover it measures on its own GPUs.
ONE_LAUNCH_TOKENS = 128
CHUNK_COLUMNS = 2048         # columns per dispatch work item: 2048 bf16 = 4 KiB, 32 B per thread of 4 warps
# The columns, not the bytes: nvfp4's decode work items hold as many columns as FP8's (groups of 16, so 128 of
# them), half its bytes. Its quantization takes more registers a column (ptxas for sm_90, triton 3.9, H 7168,
# send kernel / one launch: 124 / 96; FP8's 96 / 98; MXFP8's 128 / 137); at FP8's bytes (4096 and 8192
# columns; send / prefill send / one launch) they took 168 / 255 with 144 bytes of spills / 167.
# Dispatches of more tokens (or of mode "prefill") take the send and receive kernels bound with larger work
# items (but for formats held to MAX_ITEM_GROUPS below) and twice the programs, up to one wave
# (``LowLatency.one_wave``): at 4096 tokens on one H200 that cut dispatch from 296 to 200 us (benchmarks/NOTES.md).
PREFILL_CHUNK_COLUMNS = 4096
PREFILL_PROGRAMS = 2         # times PROGRAMS_PER_SM
# At most this many scale groups a work item: the largest tile of each format that matched the reference on a
# GPU (fp8's 32 groups of 128, mxfp8's 128 of 32, nvfp4's 128 of 16). nvfp4's prefill tile of 256 groups
# (4096 columns) came out wrong on an H200 (triton 3.6, sm_90; exact in the interpreter), so its prefill work
# items keep the decode tiles' 2048 columns (benchmarks/NOTES.md, "NVFP4 through dispatch"), as do those of an
# FP8 format with groups of 16 columns.
MAX_ITEM_GROUPS = 128


def item_columns(columns: int, group: int) -> int:
    """Columns of a dispatch work item asked to hold `columns`, for a format of scale groups of `group`
    columns: no more than MAX_ITEM_GROUPS groups."""
    return min(columns, MAX_ITEM_GROUPS * group)


# What a dispatch launch passes per call (layout_blocks: the call's layout programs, from ``layout_blocks``), and
# after them the tensor scale where the payload format has one (nvfp4: ``dispatch_arguments``).
DISPATCH_ARGUMENTS = ("x_ptr", "ids_ptr", "w_ptr", "num_tokens", "call", "layout_blocks")
# Columns per combine_send work item: a token's expert rows of COMBINE_COLUMNS are loaded at once, and a program
# keeps one item in flight, so an item's bytes are what a program moves per round trip. On 2 x H200 (graph, us, at
# 512 / 4096 tokens) 1024 columns took 48.9 / 297.3 and 2048 took 40.8 / 253.7, with 88 registers a thread where
# 1024 took 64 (5 programs an SM where 8 fit): fewer programs holding more bytes each won (benchmarks/NOTES.md,
# "Combine's work items").
COMBINE_COLUMNS = 2048


def combine_hits(topk: int, world: int) -> int:
    """Expert rows of a token a combine_send load holds (dispatch's receive keeps its local hits first, in k
    order): twice the top-k / world a rank holds on average, a power of 2 (top-8: 8 at 2 ranks, 4 at 4, 2 at 8),
    so that few tokens take a second load and few of a load's registers hold no row. On 2 x H200 at 4096
    tokens, 4 rows a load (36% of the tokens take a second) lost to 8: 260.5 against 249.7 us on every SM,
    687.3 against 593.6 on 24 SMs' worth of programs (benchmarks/NOTES.md, "Combine's hits first")."""
    return min(triton.next_power_of_2(topk), triton.next_power_of_2(-(-2 * topk // world)))


# Combine's send takes whole rows as work items (a row's chunks one after another) where there are this many rows
# a program or more. A program's time per item is a chain of round trips (the token's hits, then their expert
# rows, then the sum); a row's later chunks find its hits in the SM's L1 cache. On 2 x H200 at 4096 tokens on 24
# SMs' worth of programs (one or two an SM, so each program's chain is the time), 653.1 -> 593.6 us; on every SM,
# where HBM and the link bound it, 253.1 -> 249.7. With few rows a program, chunks keep more programs busy.
COMBINE_WHOLE_ROWS = 8
# Columns per combine_recv work item: a rank's row a work item, so wider than the send's to keep as many bytes in
# flight per program.
COMBINE_RECV_COLUMNS = 4096
# The layout of a send: where a call of max_tokens has at most COMPARE_IDS topk ids, every layout program
# compares them all with a block of experts (COMPARE_TILE ids x experts at once), one step, all in parallel;
# above, each program sorts a chunk of LAYOUT_IDS ids by expert and the last one sums the chunks up, O(ids)
# work where the compare is O(ids x experts) (at 4096 tokens, top-8 of 256 experts on one H200, the compare's
# layout alone took 56 us; with sorted chunks the whole send takes 43: benchmarks/NOTES.md). A larger chunk
# costs its program more steps (a bitonic sort of n ids takes log2(n) (log2(n) + 1) / 2), a smaller one
# leaves more chunks for the last program to sum up. A call whose ids fit one chunk compares, whatever the
# object's size: a decode call on an object sized for prefill skips the sort and the sum-up.
# The positions a rank sends are per chunk: every rank's receive knows the senders' chunks from the config.
COMPARE_IDS, COMPARE_TILE = 2048, 2048
LAYOUT_IDS = 1024
SCAN_CHUNKS, SCAN_TILE = 8, 512   # the last layout program sums up at most 8 chunks x 64 experts a step


@dataclass
class DispatchBuffers:
    """Dispatch's buffers. S = SLOTS, W ranks, T = max_tokens, H = hidden, K = topk, P = the payload format
    (``config.payload``), G = its scales items per row (``config.groups``), E experts, E_loc local experts,
    R = W * T rows per local expert, C layout chunks of ids (``layout_chunks``). Row block [slot, src] of a
    symmetric buffer is written by rank src's dispatch_send through a peer pointer."""
    # symmetric (the peer table rows, kernels.DISPATCH_PEERS)
    data: torch.Tensor         # [S, W, T, H / P.element_pack] P.payload_dtype: each source's token rows (packed
                               # formats' rows in payload items); dispatch_recv reads them
    scales: torch.Tensor       # [S, W, T, G] P.scale_storage (f32 without scales, unused): their scales
    ids: torch.Tensor          # [S, W, T, K] i32: each source token's expert ids (sent to every rank)
    weights: torch.Tensor      # [S, W, T, K] f32: their weights (sent to the ranks the token goes to)
    positions: torch.Tensor    # [S, W, T, K] i32: hit (t, k)'s place among its chunk's hits of its expert
    offsets: torch.Tensor      # [S, W, C, E_loc] i32: per chunk of ids, the source's rows of each expert before it
    counts: torch.Tensor       # [S, W, E_loc] i32: the source's rows per local expert (layout programs)
    tokens: torch.Tensor       # [S, W] i32: how many tokens the source sent
    arrived: torch.Tensor      # [S, W] i64: calls whose rows from each source have landed (dispatch_recv waits)
    freed: torch.Tensor        # [S, W] i64: calls whose rows each receiver has read out (dispatch_send waits)
    # local: dispatch_send's layout scratch (kernels.all_to_all.LAYOUT_*); dispatch_recv writes the others, the
    # experts and combine_send read them
    layout: torch.Tensor       # [S, 2 + C * E] i32: blocks finished, first bad id, hits per chunk and expert
    recv_x: torch.Tensor       # [S, E_loc, R, H / P.element_pack] P.payload_dtype: rows per local expert, in
                               # (source, token, k) order
    recv_scales: torch.Tensor  # [S, E_loc, R, G] like scales: their scales, as sent
    recv_count: torch.Tensor   # [S, E_loc] i32: valid rows per local expert
    recv_src: torch.Tensor     # [S, E_loc, R] i32: (source * T + t) * K + k of each row
    # for combine_send, per source token its local hits first, in k order (the places after them: row -1)
    kept_weights: torch.Tensor  # [S, W, T, K] f32: their weights
    kept_rows: torch.Tensor    # [S, W, T, K] i32: their rows of recv_x's [E_loc * R]
    kept_tokens: torch.Tensor  # [S, W] i32: tokens each source sent


@dataclass
class CombineBuffers:
    """Combine's buffers (S, W, T, H as for dispatch). Row block [slot, r] of `data` is written by
    expert rank r's combine_send through a peer pointer."""
    data: torch.Tensor         # [S, W, T, H] dtype: rank r's sum over its experts of w * y per token
    arrived: torch.Tensor      # [S, W] i64: calls whose rows from each expert rank have landed (combine_recv waits)
    freed: torch.Tensor        # [S, W] i64: calls whose rows each source has read out (combine_send waits)
    out: torch.Tensor          # [S, T, H] dtype, local: combine's results (y is a view unless out= is given)


# Triton specializes a pointer argument on whether it is a multiple of 16 bytes. The kernels are bound per slot to
# each slot's block of the local buffers (buffer[slot]), so a buffer whose slot blocks are not a multiple of 16 bytes
# long gave slot 1 kernels of their own: every dispatch kernel compiled twice (the layout scratch, [S, 2 + C * E]
# int32), at 2 ranks the receive and combine kernels too (kept_tokens, [S, W] int32); on a CPU machine with triton
# 3.6 (scripts/ep_compile_times.py, benchmarks/NOTES.md) 3 to 7 s a variant. Their slot blocks start 16 bytes apart.
SLOT_ALIGN = 16


def slot_blocks(local, shape, dtype: torch.dtype) -> torch.Tensor:
    """local(shape, dtype) for a per-slot buffer [S, ...], its slot blocks a multiple of SLOT_ALIGN bytes apart:
    where they would not be, a view of a padded [S, n] buffer (each block contiguous, the same values)."""
    size, block = dtype.itemsize, math.prod(shape[1:])
    stride = -(-block * size // SLOT_ALIGN) * SLOT_ALIGN // size
    if stride == block:
        return local(shape, dtype)
    return local((shape[0], stride), dtype)[:, :block].view(shape)


def dispatch_buffers(config: EPConfig, symmetric_zeros, local) -> DispatchBuffers:
    """DispatchBuffers for `config`: the peer-table rows (kernels.DISPATCH_PEERS) from
    symmetric_zeros(shape, dtype), the others (each slot's block 16-byte aligned: slot_blocks) from local(shape,
    dtype)."""
    S, W, T, H, K, E, EL, G = (SLOTS, config.world, config.max_tokens, config.hidden, config.topk,
                               config.num_experts, config.experts_per_rank, config.groups)
    C, P = layout_chunks(config), config.payload
    shapes = {
        "data": (S, W, *P.payload_shape(T, H)), "scales": (S, W, T, G), "ids": (S, W, T, K), "weights": (S, W, T, K),
        "positions": (S, W, T, K), "offsets": (S, W, C, EL), "counts": (S, W, EL), "tokens": (S, W),
        "arrived": (S, W), "freed": (S, W), "layout": (S, 2 + C * E),
        "recv_x": (S, EL, *P.payload_shape(W * T, H)), "recv_scales": (S, EL, W * T, G), "recv_count": (S, EL),
        "recv_src": (S, EL, W * T), "kept_weights": (S, W, T, K),
        "kept_rows": (S, W, T, K), "kept_tokens": (S, W)}
    f32, i64, scale = torch.float32, torch.int64, config.scale_dtype
    dtypes = {"data": config.payload_dtype, "scales": scale, "weights": f32, "arrived": i64, "freed": i64,
              "recv_x": config.payload_dtype, "recv_scales": scale, "kept_weights": f32}
    buffers = DispatchBuffers(**{
        f.name: symmetric_zeros(shapes[f.name], dtypes.get(f.name, torch.int32)) if f.name in kernels.DISPATCH_PEERS
        else slot_blocks(local, shapes[f.name], dtypes.get(f.name, torch.int32)) for f in fields(DispatchBuffers)})
    buffers.layout[:, kernels.LAYOUT_FIRST_BAD.value] = kernels.NO_BAD_ID.value
    return buffers


def dispatch_arguments(config: EPConfig) -> tuple[str, ...]:
    """The arguments a dispatch send launch takes per call: DISPATCH_ARGUMENTS, then the tensor scale (a float32
    [1] on the device) for a payload format with one; other formats' kernels are bound to a constant one,
    which they never read, and pay nothing per call for it."""
    return DISPATCH_ARGUMENTS + (("tensor_scale_ptr",) if config.payload.tensor_scale else ())


def compares(config: EPConfig) -> bool:
    """Whether a send's layout compares every id with every expert (few ids), or sorts chunks of them."""
    return config.max_tokens * config.topk <= COMPARE_IDS


def chunk_ids(config: EPConfig) -> int:
    """Topk ids per layout chunk: all of a call of max_tokens where the layout compares, else LAYOUT_IDS."""
    ids = triton.next_power_of_2(config.max_tokens * config.topk)
    return ids if compares(config) else min(LAYOUT_IDS, ids)


def layout_chunks(config: EPConfig) -> int:
    """Layout chunks of a call of max_tokens."""
    return triton.cdiv(config.max_tokens * config.topk, chunk_ids(config))


def experts_block(config: EPConfig) -> int:
    """Experts a layout program compares with a call's ids at once: where the object's layout compares,
    COMPARE_TILE ids x experts; where it sorts (and compares only calls whose ids fit one chunk), one. There
    the compare shares its kernels with the sort, and 2 x 1024 at once raised the one-launch dispatch kernel
    from 167 to 255 registers a thread (ptxas for sm_90, triton 3.6, H 7168, 4096 tokens: 2 programs an SM
    instead of 3; 226 -> 316 us at 4096 tokens on one H200) and the prefill send kernel from 80 to 96; one
    expert at a time takes 168 and 72."""
    if not compares(config):
        return 1
    return min(triton.next_power_of_2(config.num_experts), max(1, COMPARE_TILE // chunk_ids(config)))


def layout_blocks(config: EPConfig, tokens: int) -> int:
    """Layout programs of a call of `tokens` tokens: a block of experts each where its ids fit one chunk
    (compared), else one per chunk of its ids (sorted); at least one, which sends the token count."""
    ids, chunk = tokens * config.topk, chunk_ids(config)
    if ids <= chunk:
        return triton.cdiv(config.num_experts, experts_block(config))
    return triton.cdiv(ids, chunk)


def layout_arguments(config: EPConfig) -> tuple[dict, dict]:
    """The layout's constant arguments (kernels.all_to_all._dispatch_layout): those of the send kernels,
    and those of the receive kernels."""
    chunks, ids, experts = layout_chunks(config), chunk_ids(config), triton.next_power_of_2(config.num_experts)
    receive = dict(layout_chunks=chunks, CHUNK_IDS=ids)
    send = dict(receive, COMPARE=compares(config), EXPERTS_BLOCK=experts_block(config))
    if compares(config):
        return dict(send, NUM_BINS=1, SCAN_CHUNKS=1, SCAN_EXPERTS=1), receive
    scan = min(SCAN_CHUNKS, triton.next_power_of_2(chunks))
    return dict(send, NUM_BINS=triton.next_power_of_2(config.num_experts + 1), SCAN_CHUNKS=scan,
                SCAN_EXPERTS=min(experts, SCAN_TILE // scan)), receive


class LowLatency(KernelProtocol):
    """The low-latency protocol of one EPAllToAll: its buffers, grids, bound kernels and status words."""

    name = "low_latency"
    slots = SLOTS
    kernel_names = kernels.KERNELS
    stamp_names = kernels.STAMPS
    one_launch_tokens = ONE_LAUNCH_TOKENS
    # Dispatch's send and receive in one wave of programs (grids cut to what the SMs hold at once): a program
    # of a later wave starts only when one of the first wave has done all its items, so a grid of 1.4 waves
    # takes as long as two. On one H200 (prefill tiles, graph): the receive's cut (48 registers, 10 programs an
    # SM, 1320 of 2112) took dispatch from 143.8 to 141.3 us at 4096 tokens and from 18.3 to 17.6 at 128; the
    # send's (72 registers, 7 programs an SM, 924 of 1352) its send phase from 42.5 to 37.8 us at 4096 tokens
    # and dispatch from 132.7 to 128.0.
    one_wave = ("dispatch_recv", "dispatch_send")

    def __init__(self, config: EPConfig, resources: EPResources):
        """Buffers: symmetric ones from resources.symmetric_zeros(shape, dtype), local ones on its device.
        Grids are bounded by resources.sms times PROGRAMS_PER_SM. The status words: the timeout report,
        then the first out-of-range expert id a dispatch saw (kernels.status), pinned on a GPU so that
        the host reads them without a sync."""
        super().__init__(config, resources)
        self.puts = PutPeers(config, resources.put_peers) if resources.put_peers else None
        symmetric_zeros, device, sms = resources.symmetric_zeros, resources.device, resources.sms
        self.one_launch = resources.one_launch
        status = torch.zeros(EP_STATUS_WORDS, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._words = memoryview(status.numpy())      # written by the kernels, read by the host (_watch_status)
        S, W, T, H = SLOTS, config.world, config.max_tokens, config.hidden
        self.send_layout, self.receive_layout = layout_arguments(config)
        self._layouts = layout = max(layout_blocks(config, 0), layout_blocks(config, T))   # the most of a call
        # Columns per scale group (without scales GROUP only cuts rows into work items), per work item of each
        # tiles, and work items per token of this rank's (dispatch_send, combine_recv) or of the longest source's
        self._group = group = config.payload.group or FP8_GROUP
        self._columns = {"decode": item_columns(CHUNK_COLUMNS, group),
                         "prefill": item_columns(PREFILL_CHUNK_COLUMNS, group)}
        self._items = items = {"dispatch_send": triton.cdiv(H, self._columns["decode"]),
                               "dispatch_send_prefill": triton.cdiv(H, self._columns["prefill"]),
                               "combine_recv": triton.cdiv(H, COMBINE_RECV_COLUMNS)}
        work = {"dispatch_send": T * items["dispatch_send"], "dispatch_recv": W * T * items["dispatch_send"],
                "combine_send": W * T * triton.cdiv(H, COMBINE_COLUMNS), "combine_recv": T * items["combine_recv"]}
        work["dispatch"] = max(layout, work["dispatch_recv"])
        work["combine"] = work["combine_send"]
        grid = {name: min(n, PROGRAMS_PER_SM[name] * sms) for name, n in work.items()}
        for name, rows in (("dispatch_send", T), ("dispatch_recv", W * T)):
            grid[f"{name}_prefill"] = min(rows * items["dispatch_send_prefill"],
                                          PREFILL_PROGRAMS * PROGRAMS_PER_SM[name] * sms)
        grid["dispatch_send"] += layout
        grid["dispatch_send_prefill"] += layout
        if INTERPRETING:            # one program at a time: a second one could never be waited for
            grid["dispatch"] = grid["combine"] = 1
        self._start(status, grid, sms)
        self.dispatch_buffers = dispatch_buffers(config, symmetric_zeros, self.local)
        self.combine_buffers = CombineBuffers(data=symmetric_zeros((S, W, T, H), config.dtype),
                                              arrived=symmetric_zeros((S, W), torch.int64),
                                              freed=symmetric_zeros((S, W), torch.int64),
                                              out=slot_blocks(self.local, (S, T, H), config.dtype))
        self.live = symmetric_zeros((W,), torch.int32).fill_(1)
        self.lost_experts = slot_blocks(self.local, (S, T, config.topk), torch.int8)
        if self.puts:
            self.puts.allocate(symmetric_zeros, {"dispatch": self.dispatch_buffers, "combine": self.combine_buffers})
            self.remote, self.echo_addr = self.puts.bits, self.puts.echo.data_ptr()
        self.publish(kernels.DISPATCH_PEERS, kernels.COMBINE_PEERS)
        if self.puts:
            self.symmetric.update(self.puts.symmetric(self.name))

    def call_shape(self, tokens: int) -> CallShape:
        """The layout programs of a call of `tokens` tokens (``layout_blocks``); its send kernels get them and
        a program per work item of its tokens, its combine receive a program per work item, up to the bound
        grids. The receive of a dispatch and the send of a combine work on what the peers sent, unknown
        here: their grids stay bound."""
        layout, items, grid = layout_blocks(self.config, tokens), self._items, self.grid
        send = {name: layout + min(grid[name] - self._layouts, tokens * items[name])
                for name in ("dispatch_send", "dispatch_send_prefill")}
        return CallShape(layout, send["dispatch_send"], send["dispatch_send_prefill"],
                         min(grid["combine_recv"], max(1, tokens * items["combine_recv"])))

    def reported(self) -> bool:
        """A timeout, an out-of-range expert id, or this rank masked by its peers: reads of pinned memory."""
        words = self._words
        return bool(words[0] or words[BAD_CALL] or words[EVICTED])

    def raise_reported(self) -> None:
        """CommTimeoutError if this (elastic) rank found itself masked by its peers; ValueError naming the
        first out-of-range expert id a dispatch saw (the id was dropped)."""
        if self._words[EVICTED]:
            raise CommTimeoutError(f"rank {self.config.rank} was masked by its peers: it answered one of their waits "
                                   f"later than timeout_s={self.config.timeout_s}s, and they went on without it")
        if self._words[BAD_CALL]:
            call, bad, index = (self._words[w.value] for w in (STATUS_BAD_CALL, STATUS_BAD_ID, STATUS_BAD_INDEX))
            self._words[BAD_CALL] = 0
            c = self.config
            raise ValueError(f"rank {c.rank}: dispatch call {call} had topk_ids[{index // c.topk}, {index % c.topk}] "
                             f"= {bad}, outside [-1, {c.num_experts}) (-1 = dropped slot); it was dropped")

    def connect(self, peer_addresses) -> None:
        """Peer tables and bound kernels: per slot (and, for combine_send, per slot of the dispatch it
        follows). peer_addresses(name, buffer) -> every rank's address of a symmetric buffer."""
        c, d, cb = self.config, self.dispatch_buffers, self.combine_buffers
        if self.puts:
            peer_addresses = self.puts.addresses(peer_addresses)
        self.live_peers = self.live_table(peer_addresses)
        dispatch_peers = self.peer_table("dispatch", kernels.DISPATCH_PEERS, peer_addresses)
        combine_peers = self.peer_table("combine", kernels.COMBINE_PEERS, peer_addresses)
        # The payload format's constexprs (PayloadFormat.kernel_constants).
        constants, group = c.payload.kernel_constants, self._group
        quantize = dict(SCALE_KIND=constants["SCALE_KIND"], SCALE_PACK=constants["SCALE_PACK"], GROUP=group,
                        ELEMENT_PACK=c.payload.element_pack)
        # The tensor scale: passed per call where the format has one, else bound to a constant never read.
        arguments = dispatch_arguments(c)
        unscaled = {} if c.payload.tensor_scale else {"tensor_scale_ptr": self.local((1,), torch.float32)}
        # The receive kernels start while their send kernel still runs (programmatic dependent launch: the
        # send kernels call _start_receiver); they read nothing it writes locally, only what peers signal.
        early = {} if INTERPRETING else {"launch_pdl": True}
        # What each phase binds, shared by its split kernel and the one-launch kernel of its op: dispatch's
        # send; dispatch's receive per slot (its staging, the staged ids and weights named apart, the outputs);
        # combine's send per dispatch slot; combine's receive.
        send = [dict(peers=dispatch_peers, freed_ptr=d.freed, layout_ptr=d.layout[s], num_experts=c.num_experts,
                     VALIDATE=c.validate, num_warps=4, **unscaled) for s in range(SLOTS)]
        receive = [dict(data_ptr=d.data, scale_ptr=d.scales, pos_ptr=d.positions, offset_ptr=d.offsets,
                        count_ptr=d.counts, tokens_ptr=d.tokens, arrived_ptr=d.arrived, peers=dispatch_peers,
                        recv_x_ptr=d.recv_x[s], recv_scale_ptr=d.recv_scales[s], recv_count_ptr=d.recv_count[s],
                        recv_src_ptr=d.recv_src[s], kept_w_ptr=d.kept_weights[s], kept_row_ptr=d.kept_rows[s],
                        kept_tokens_ptr=d.kept_tokens[s], num_warps=4) for s in range(SLOTS)]
        combine_send = [dict(kept_w_ptr=d.kept_weights[ds], kept_row_ptr=d.kept_rows[ds],
                             kept_tokens_ptr=d.kept_tokens[ds], peers=combine_peers, freed_ptr=cb.freed,
                             BLOCK_H=COMBINE_COLUMNS, HITS=combine_hits(c.topk, c.world),
                             WHOLE_ROWS=COMBINE_WHOLE_ROWS, num_warps=4,
                             enable_fp_fusion=False)   # mul then add, rounded twice: the reference's sums
                        for ds in range(SLOTS)]
        combine_recv = dict(data_ptr=cb.data, arrived_ptr=cb.arrived, peers=combine_peers,
                            RECV_BLOCK_H=COMBINE_RECV_COLUMNS, num_warps=4)

        def split_dispatch(suffix: str, columns: int):
            """Dispatch's send and receive kernels per slot, on the grids named with `suffix`, for work
            items of `columns` columns."""
            tiles = dict(quantize, BLOCK_GROUPS=columns // group)
            return ([self.bind(f"dispatch_send{suffix}", kernels.dispatch_send_kernel, s, arguments,
                               fewest=self._layouts + 1,     # the layout programs of any call, and a token one
                               **send[s], **tiles, **self.send_layout) for s in range(SLOTS)],
                    [self.bind(f"dispatch_recv{suffix}", kernels.dispatch_recv_kernel, s, ids_ptr=d.ids,
                               w_ptr=d.weights, **receive[s], **tiles, **self.receive_layout, **early)
                     for s in range(SLOTS)])

        self._dispatch_send, self._dispatch_recv = split_dispatch("", self._columns["decode"])
        self._prefill = split_dispatch("_prefill", self._columns["prefill"])
        self._dispatch = [self.bind("dispatch", kernels.dispatch_kernel, s, arguments, staged_ids_ptr=d.ids,
                                    staged_w_ptr=d.weights, **{**send[s], **receive[s]}, **quantize,
                                    BLOCK_GROUPS=self._columns["decode"] // group, **self.send_layout)
                          for s in range(SLOTS)]
        self._combine_send = {(s, ds): self.bind("combine_send", kernels.combine_send_kernel, s, ("y_ptr",),
                                                 **combine_send[ds]) for s in range(SLOTS) for ds in range(SLOTS)}
        self._combine_recv = {(s, ds): self.bind("combine_recv", kernels.combine_recv_kernel, s,
                                                 ("out_ptr", "ids_ptr", "num_tokens"), lost_ptr=self.lost_experts[ds],
                                                 **combine_recv, **early)
                              for s in range(SLOTS) for ds in range(SLOTS)}
        self._combine = {(s, ds): self.bind("combine", kernels.combine_kernel, s,
                                            ("y_ptr", "out_ptr", "ids_ptr", "num_tokens"),
                                            lost_ptr=self.lost_experts[ds], **{**combine_send[ds], **combine_recv})
                         for s in range(SLOTS) for ds in range(SLOTS)}
