"""The bulk protocol (prefill): its buffers and launches over ``kernels/all_to_all_bulk.py``.

Work items are tiles of BULK_ROWS token rows, signals one per block of BULK_ROWS tokens: many
rows in flight per program, and receivers that start on the first blocks while the last ones
are still being sent, for thousands of tokens per rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .ep_low_latency import CombineBuffers, DispatchBuffers, dispatch_buffers, layout_tile
from .ep_protocol import SLOTS, EPConfig, EPProtocol
from .kernels import all_to_all as kernels
from .kernels import all_to_all_bulk as bulk

BULK_ROWS = 8                # token rows per tile (BLOCK_T), and tokens per signalled block
BULK_COLUMNS = 512           # columns per dispatch tile: 8 x 512 values, 16 per thread of 8 warps (1024 took
                             # 196 registers in bulk_dispatch_send: one program per SM)
BULK_COMBINE_COLUMNS = 512   # columns per combine tile: 8 x 512 fp32 sums, 16 per thread, plus k loads in flight
BULK_WARPS = 8
PROGRAMS_PER_SM = 2          # programs of 8 warps per SM: the registers allow 2 (ptxas for sm_90, triton 3.9:
                             # 128, 95, 117 and 82 per thread in the four kernels)


@dataclass
class BulkDispatchBuffers(DispatchBuffers):
    """DispatchBuffers (NB = cdiv(T, BULK_ROWS) blocks), with `arrived` one counter per block:
    [S, W, NB] i64: calls whose block of rows from each source has landed (bulk_dispatch_recv waits)."""
    layout: torch.Tensor       # [S, W] i64, symmetric: calls whose counts, positions, token count from each source
                               # have landed (bulk_dispatch_recv waits)
    layout_done: torch.Tensor  # [S] i64: layout programs finished (the last one signals `layout`)
    block_done: torch.Tensor   # [S, NB] i64: column chunks of each block stored (the last one signals the block)


@dataclass
class BulkCombineBuffers(CombineBuffers):
    """CombineBuffers, with `arrived` one counter per block and expert rank: [S, NB, W] i64."""
    block_done: torch.Tensor   # [S, W, NB] i64: column chunks stored per (source, block) (the last one signals)


class Bulk(EPProtocol):
    """The bulk protocol of one EPAllToAll: its buffers, grids and bound kernels."""

    name = "bulk"

    def __init__(self, config: EPConfig, symmetric_zeros, device: torch.device, status: torch.Tensor, sms: int):
        """Buffers: symmetric ones from `symmetric_zeros(shape, dtype)`, local ones on `device`. Grids are
        bounded by `sms` (the same on every rank) times PROGRAMS_PER_SM."""
        S, W, T, H = SLOTS, config.world, config.max_tokens, config.hidden
        blocks = triton.cdiv(T, BULK_ROWS)
        self.group = config.fp8_group or 128
        self.block_groups = max(1, BULK_COLUMNS // self.group)
        chunks = triton.cdiv(H, self.block_groups * self.group)
        combine_chunks = triton.cdiv(H, BULK_COMBINE_COLUMNS)
        self.layout_ids, self.layout_experts = layout_tile(config)
        work = {"dispatch_send": blocks * chunks, "dispatch_recv": W * blocks * chunks,
                "combine_send": W * blocks * combine_chunks, "combine_recv": blocks * combine_chunks}
        grid = {name: min(items, PROGRAMS_PER_SM * sms) for name, items in work.items()}
        grid["dispatch_send"] += triton.cdiv(config.num_experts, self.layout_experts)   # the layout programs
        self._start(config, device, status, grid)
        i64 = torch.int64
        self.dispatch_buffers = dispatch_buffers(
            config, symmetric_zeros, self.local, BulkDispatchBuffers, bulk.BULK_DISPATCH_PEERS,
            {"arrived": ((S, W, blocks), i64), "layout": ((S, W), i64), "layout_done": ((S,), i64),
             "block_done": ((S, blocks), i64)})
        self.combine_buffers = BulkCombineBuffers(
            data=symmetric_zeros((S, W, T, H), config.dtype), arrived=symmetric_zeros((S, blocks, W), i64),
            freed=symmetric_zeros((S, W), i64), out=self.local((S, T, H), config.dtype),
            block_done=self.local((S, W, blocks), i64))
        self.publish(bulk.BULK_DISPATCH_PEERS, kernels.COMBINE_PEERS)

    def connect(self, peer_addresses) -> None:
        """Peer tables and bound kernels: per slot (and, for combine_send, per slot of the dispatch it
        follows). peer_addresses(name, buffer) -> every rank's address of a symmetric buffer."""
        c, d, cb = self.config, self.dispatch_buffers, self.combine_buffers
        dispatch_peers = self.peer_table("dispatch", bulk.BULK_DISPATCH_PEERS, peer_addresses)
        combine_peers = self.peer_table("combine", kernels.COMBINE_PEERS, peer_addresses)
        tile = dict(FP8=c.fp8_group is not None, GROUP=self.group, BLOCK_GROUPS=self.block_groups, BLOCK_T=BULK_ROWS,
                    num_warps=BULK_WARPS)
        self._dispatch_send = [self.bind(
            "dispatch_send", bulk.bulk_dispatch_send_kernel, s, ("x_ptr", "ids_ptr", "w_ptr", "num_tokens", "call"),
            peers=dispatch_peers, freed_ptr=d.freed, layout_done_ptr=d.layout_done, block_done_ptr=d.block_done,
            num_experts=c.num_experts, EXPERTS_BLOCK=self.layout_experts, BLOCK_I=self.layout_ids,
            VALIDATE=c.validate, **tile) for s in range(SLOTS)]
        self._dispatch_recv = [self.bind(
            "dispatch_recv", bulk.bulk_dispatch_recv_kernel, s,
            data_ptr=d.data, scale_ptr=d.scales, ids_ptr=d.ids, w_ptr=d.weights, pos_ptr=d.positions,
            count_ptr=d.counts, tokens_ptr=d.tokens, arrived_ptr=d.arrived, layout_ptr=d.layout, peers=dispatch_peers,
            recv_x_ptr=d.recv_x[s], recv_scale_ptr=d.recv_scales[s], recv_count_ptr=d.recv_count[s],
            recv_src_ptr=d.recv_src[s], kept_ids_ptr=d.kept_ids[s], kept_w_ptr=d.kept_weights[s],
            kept_row_ptr=d.kept_rows[s], kept_tokens_ptr=d.kept_tokens[s], **tile) for s in range(SLOTS)]
        self._combine_send = {(s, ds): self.bind(
            "combine_send", bulk.bulk_combine_send_kernel, s, ("y_ptr",),
            kept_ids_ptr=d.kept_ids[ds], kept_w_ptr=d.kept_weights[ds], kept_row_ptr=d.kept_rows[ds],
            kept_tokens_ptr=d.kept_tokens[ds], peers=combine_peers, freed_ptr=cb.freed, block_done_ptr=cb.block_done,
            BLOCK_T=BULK_ROWS, BLOCK_H=BULK_COMBINE_COLUMNS, num_warps=BULK_WARPS,
            enable_fp_fusion=False)   # mul then add, rounded twice: the reference's sums
            for s in range(SLOTS) for ds in range(SLOTS)}
        self._combine_recv = [self.bind(
            "combine_recv", bulk.bulk_combine_recv_kernel, s, ("out_ptr", "ids_ptr", "num_tokens"),
            data_ptr=cb.data, arrived_ptr=cb.arrived, peers=combine_peers, BLOCK_T=BULK_ROWS,
            BLOCK_H=BULK_COMBINE_COLUMNS, num_warps=BULK_WARPS) for s in range(SLOTS)]
