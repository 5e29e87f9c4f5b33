"""Bulk expert-parallel dispatch and combine (prefill): blocks of token rows per work item.

The same contract, buffers and slot protocol as ``all_to_all`` (the low-latency kernels; read
its docstring first), with work moved in tiles of ``BLOCK_T`` token rows x a column chunk, so
that every program keeps many rows in flight, and one signal per block of ``BLOCK_T`` tokens
instead of one per call, so that receivers start on the first blocks while later ones are
still on their way. Each block's counter counts its column chunks: the program that finishes a
block's last chunk release-adds 1 to the block's arrival counter on the receivers.

bulk_dispatch_send    (on every rank, for its own tokens)
    programs [0, L)       the layout (``all_to_all._dispatch_layout``, as in the low-latency path,
                          with the token count); the last layout program to finish
                          release-adds 1 to every rank's layout counter (slot, me).
    programs [L, grid)    work item = (block, column chunk): a tile [BLOCK_T * groups, GROUP] of x,
                          quantized to FP8 per group once, stored once to every rank that owns one of
                          a row's experts (rows without one are masked off); with chunk 0, the rows'
                          ids to every rank and their weights to those ranks. Every block of
                          max_tokens is counted and signalled, also blocks past num_tokens (no work):
                          the counters then grow by exactly one per call and block.

bulk_dispatch_recv    (on every rank)
    Waits for every sender's layout counter (counts, token counts, positions are then in), then per
    work item (source, block, column chunk) of a block with tokens: waits for that block's
    arrival counter, and fans the tile out to the rows of its local experts, k by k, with tile
    stores. Its last program to finish frees the slot on every sender.

bulk_combine_send     (on every expert rank)
    Work item = (source, block, column chunk): per row, sum_k w[k] * expert_out[row(k)] over the
    token's local experts in fp32, k order, as tiles [BLOCK_T, columns]; stored once into the
    source's combine buffer; the last chunk of a block signals that block to that source only.

bulk_combine_recv     (on every source rank)
    Work item = (block, column chunk): waits for that block's counter from every expert rank,
    adds the ranks' rows in rank order in fp32 for the ranks each token was routed to, casts.
    Its last program to finish frees the slot on every expert rank.

Peer tables: ``BULK_DISPATCH_PEERS`` / ``all_to_all.COMBINE_PEERS`` rows, as in ``all_to_all``.
"""
import triton
import triton.language as tl

from ..shmem import last_to_finish, signal_add, signal_add_all, wait_all_ge, wait_until_ge
from .all_to_all import (_INTS, C_ARRIVED, C_DATA, C_FREED, D_ARRIVED, D_DATA, D_FREED, D_IDS, D_SCALES, D_WEIGHTS,
                         DISPATCH_PEERS, STAMP_SIGNALED, STAMP_STARTED, STAMP_WAITED, STAMP_WORKED,
                         TAG_COMBINE_ARRIVAL, TAG_COMBINE_CREDIT, TAG_DISPATCH_ARRIVAL, TAG_DISPATCH_CREDIT, _clock,
                         _dispatch_layout, _finish, _peer, _retire, _stamp, _use)
from .quant import cast_rn, fp8_quantize_groups, to_fp8

# Rows of the dispatch peer table: the low-latency rows (all_to_all.D_*; "arrived" holds one counter per
# (slot, source, block) here), then the layout counters. Combine's table is the low-latency one
# (all_to_all.COMBINE_PEERS; "arrived" holds one counter per (slot, block, expert rank)).
BULK_DISPATCH_PEERS = (*DISPATCH_PEERS, "layout")
D_LAYOUT = tl.constexpr(len(DISPATCH_PEERS))


@triton.jit
def _column(values, kk, k):
    """Column k of a [N, K_PAD] tile, as [N]."""
    return tl.sum(tl.where(kk[None, :] == k, values, 0), axis=1)


@triton.jit
def _tile(block, chunk, hidden, BLOCK_T: tl.constexpr, GROUP: tl.constexpr, BLOCK_GROUPS: tl.constexpr):
    """Block `block`, chunk `chunk` as a flat tile of (row, group) pairs: per pair its token row [N]
    (N = BLOCK_T * BLOCK_GROUPS), its group [N], whether it is the row's first pair [N], its columns
    [N, GROUP] and their mask."""
    i = tl.arange(0, BLOCK_T * BLOCK_GROUPS)
    t = block * BLOCK_T + i // BLOCK_GROUPS
    g = chunk * BLOCK_GROUPS + i % BLOCK_GROUPS
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    return t, g, i % BLOCK_GROUPS == 0, cols, cols < hidden


@triton.jit(do_not_specialize=_INTS + ["num_tokens", "num_experts"])
def bulk_dispatch_send_kernel(
    x_ptr, ids_ptr, w_ptr,                                   # [T, H], [T, K], [T, K]
    peers,                                                   # int64 [BULK_DISPATCH_PEERS, world]
    freed_ptr,                                               # my credit counters [SLOTS, world]
    layout_done_ptr, block_done_ptr,                         # local [SLOTS] layout programs, [SLOTS, blocks] chunks
    finished_ptr, uses_ptr, clock_ptr, status_addr, stamps_ptr,
    num_tokens, call, slot, rank, world, max_tokens, hidden, topk, experts_per_rank, num_experts, timeout_ns,
    FP8: tl.constexpr, GROUP: tl.constexpr, BLOCK_GROUPS: tl.constexpr, BLOCK_T: tl.constexpr,
    K_PAD: tl.constexpr, EXPERTS_BLOCK: tl.constexpr, BLOCK_I: tl.constexpr, WORLD_PAD: tl.constexpr,
    VALIDATE: tl.constexpr, TIMING: tl.constexpr,
):
    """Staging on rank r as in all_to_all.dispatch_send_kernel, but arrived [SLOTS, world, blocks] i64
    and layout [SLOTS, world] i64 counters."""
    _stamp(stamps_ptr, STAMP_STARTED, TIMING)
    status_ptr = status_addr.to(tl.pointer_type(tl.int32))    # pinned host memory: the host reads it without a sync
    use = _use(uses_ptr, slot)
    ok = wait_all_ge(freed_ptr + slot * world, world, use - 1, timeout_ns, status_ptr, TAG_DISPATCH_CREDIT,
                     _clock(clock_ptr), WORLD_PAD)
    _stamp(stamps_ptr, STAMP_WAITED, TIMING)
    pid = tl.program_id(0)
    layout_programs = tl.cdiv(num_experts, EXPERTS_BLOCK)
    stage = slot * world + rank                              # my row block on every receiver
    blocks = tl.cdiv(max_tokens, BLOCK_T)
    if ok:
        if pid < layout_programs:
            _dispatch_layout(ids_ptr, peers, status_ptr, pid, stage, num_tokens, call, world, max_tokens, topk,
                             experts_per_rank, num_experts, EXPERTS_BLOCK, BLOCK_I, VALIDATE)
            if last_to_finish(layout_done_ptr + slot, use * layout_programs):
                signal_add_all(peers + D_LAYOUT * world, stage, world, 1, WORLD_PAD)
        else:
            kk = tl.arange(0, K_PAD)
            chunks = tl.cdiv(hidden, BLOCK_GROUPS * GROUP)
            num_groups = hidden // GROUP
            for item in range(pid - layout_programs, blocks * chunks, tl.num_programs(0) - layout_programs):
                block = item // chunks
                chunk = item % chunks
                if block * BLOCK_T < num_tokens:
                    t, g, first, cols, mask = _tile(block, chunk, hidden, BLOCK_T, GROUP, BLOCK_GROUPS)
                    live = t < num_tokens
                    meta = t[:, None] * topk + kk[None, :]
                    has_k = live[:, None] & (kk < topk)[None, :]
                    ids = tl.load(ids_ptr + meta, mask=has_k, other=-1).to(tl.int32)
                    dest = tl.where(ids >= 0, ids // experts_per_rank, -1)
                    row = stage.to(tl.int64) * max_tokens + t
                    x = tl.load(x_ptr + t[:, None].to(tl.int64) * hidden + cols, mask=mask & live[:, None], other=0.0)
                    if FP8:
                        values, scales = fp8_quantize_groups(x.to(tl.float32))
                        payload = to_fp8(values)
                    else:
                        payload = x
                    on_first_chunk = t * 0 + chunk == 0                            # [N], a tensor in any case
                    weights = tl.load(w_ptr + meta, mask=has_k & on_first_chunk[:, None], other=0.0).to(tl.float32)
                    for r in range(world):
                        routed = tl.max((dest == r).to(tl.int32), 1) > 0          # [N]
                        if chunk == 0:
                            kept = row[:, None] * topk + kk[None, :]
                            tl.store(_peer(peers, D_IDS, r, world, tl.int32) + kept, ids, mask=has_k & first[:, None])
                            tl.store(_peer(peers, D_WEIGHTS, r, world, tl.float32) + kept, weights,
                                     mask=has_k & (first & routed)[:, None])
                        if tl.max(routed.to(tl.int32), 0) > 0:
                            tl.store(_peer(peers, D_DATA, r, world, payload.dtype) + row[:, None] * hidden + cols,
                                     payload, mask=mask & routed[:, None])
                            if FP8:
                                tl.store(_peer(peers, D_SCALES, r, world, tl.float32) + row * num_groups + g, scales,
                                         mask=routed & (g < num_groups))
                _stamp(stamps_ptr, STAMP_WORKED, TIMING)
                if last_to_finish(block_done_ptr + slot * blocks + block, use * chunks):
                    signal_add_all(peers + D_ARRIVED * world, stage * blocks + block, world, 1, WORLD_PAD)
                    _stamp(stamps_ptr, STAMP_SIGNALED, TIMING)
    _retire(finished_ptr + slot, uses_ptr + slot, use)


@triton.jit(do_not_specialize=_INTS)
def bulk_dispatch_recv_kernel(
    data_ptr, scale_ptr, ids_ptr, w_ptr, pos_ptr, count_ptr, tokens_ptr, arrived_ptr, layout_ptr,   # my staging
    peers,                                                   # int64 [BULK_DISPATCH_PEERS, world]: senders' credits
    recv_x_ptr, recv_scale_ptr, recv_count_ptr, recv_src_ptr,   # [E_loc, R, H], [E_loc, R, H/G], [E_loc], [E_loc, R]
    kept_ids_ptr, kept_w_ptr, kept_row_ptr, kept_tokens_ptr,    # [world, T_max, K] x3, [world]
    finished_ptr, uses_ptr, clock_ptr, status_addr, stamps_ptr,
    slot, rank, world, max_tokens, hidden, topk, experts_per_rank, timeout_ns,
    FP8: tl.constexpr, GROUP: tl.constexpr, BLOCK_GROUPS: tl.constexpr, BLOCK_T: tl.constexpr,
    K_PAD: tl.constexpr, WORLD_PAD: tl.constexpr, TIMING: tl.constexpr,
):
    """R = world * max_tokens rows per local expert."""
    _stamp(stamps_ptr, STAMP_STARTED, TIMING)
    status_ptr = status_addr.to(tl.pointer_type(tl.int32))    # pinned host memory: the host reads it without a sync
    use = _use(uses_ptr, slot)
    clock = _clock(clock_ptr)
    ok = wait_all_ge(layout_ptr + slot * world, world, use, timeout_ns, status_ptr, TAG_DISPATCH_ARRIVAL, clock,
                     WORLD_PAD)
    _stamp(stamps_ptr, STAMP_WAITED, TIMING)
    pid = tl.program_id(0)
    rows_per_expert = world * max_tokens
    stage = slot * world                                   # first source row block of this slot
    blocks = tl.cdiv(max_tokens, BLOCK_T)
    if ok:
        if pid == 0:
            for src in range(world):
                tl.store(kept_tokens_ptr + src, tl.load(tokens_ptr + stage + src))
            for e0 in range(0, experts_per_rank, 128):
                e = e0 + tl.arange(0, 128)
                total = tl.zeros((128,), tl.int32)
                for src in range(world):
                    total += tl.load(count_ptr + (stage + src) * experts_per_rank + e, mask=e < experts_per_rank,
                                     other=0)
                tl.store(recv_count_ptr + e, total, mask=e < experts_per_rank)
        kk = tl.arange(0, K_PAD)
        chunks = tl.cdiv(hidden, BLOCK_GROUPS * GROUP)
        num_groups = hidden // GROUP
        for item in range(pid, world * blocks * chunks, tl.num_programs(0)):
            src = item // (blocks * chunks)
            block = item // chunks % blocks
            chunk = item % chunks
            tokens = tl.load(tokens_ptr + stage + src)
            if (block * BLOCK_T < tokens) & ok:
                ok = wait_until_ge(arrived_ptr + (stage + src) * blocks + block, use, timeout_ns, status_ptr, src,
                                   TAG_DISPATCH_ARRIVAL, clock)
                _stamp(stamps_ptr, STAMP_WAITED, TIMING)
            if (block * BLOCK_T < tokens) & ok:
                t, g, first, cols, mask = _tile(block, chunk, hidden, BLOCK_T, GROUP, BLOCK_GROUPS)
                src_row = src * max_tokens + t
                meta = (stage * max_tokens + src_row)[:, None] * topk + kk[None, :]
                has_k = (t < tokens)[:, None] & (kk < topk)[None, :]
                ids = tl.load(ids_ptr + meta, mask=has_k, other=-1)
                local = has_k & (ids >= 0) & (ids // experts_per_rank == rank)
                expert = tl.where(local, ids - rank * experts_per_rank, 0)
                row = tl.load(pos_ptr + meta, mask=local, other=0)
                for s in range(src):
                    row += tl.load(count_ptr + (stage + s) * experts_per_rank + expert, mask=local, other=0)
                row = tl.where(local, row, -1)
                if chunk == 0:
                    kept = src_row[:, None] * topk + kk[None, :]
                    tl.store(kept_ids_ptr + kept, ids, mask=has_k & first[:, None])
                    tl.store(kept_w_ptr + kept, tl.load(w_ptr + meta, mask=local, other=0.0),
                             mask=has_k & first[:, None])
                    tl.store(kept_row_ptr + kept, row, mask=has_k & first[:, None])
                    tl.store(recv_src_ptr + expert * rows_per_expert + row, kept, mask=local & first[:, None])
                if tl.max(tl.max(local.to(tl.int32), 1), 0) > 0:
                    staged = stage.to(tl.int64) * max_tokens + src_row
                    payload = tl.load(data_ptr + staged[:, None] * hidden + cols,
                                      mask=mask & (tl.max(local.to(tl.int32), 1) > 0)[:, None])
                    if FP8:
                        scales = tl.load(scale_ptr + staged * num_groups + g, mask=g < num_groups)
                    for k in tl.static_range(K_PAD):
                        row_k = _column(row, kk, k)
                        if tl.max(row_k, 0) >= 0:
                            dst = _column(expert, kk, k).to(tl.int64) * rows_per_expert + row_k
                            tl.store(recv_x_ptr + dst[:, None] * hidden + cols, payload, mask=mask & (row_k >= 0)[:, None])
                            if FP8:
                                tl.store(recv_scale_ptr + dst * num_groups + g, scales,
                                         mask=(row_k >= 0) & (g < num_groups))
    _finish(finished_ptr + slot, uses_ptr + slot, use, peers, D_FREED, slot * world + rank, world, stamps_ptr, TIMING, WORLD_PAD)


@triton.jit(do_not_specialize=_INTS)
def bulk_combine_send_kernel(
    y_ptr,                                                   # expert_out [E_loc, R, H]
    kept_ids_ptr, kept_w_ptr, kept_row_ptr, kept_tokens_ptr,   # from the dispatch slot of the handle
    peers,                                                   # int64 [COMBINE_PEERS, world]
    freed_ptr, block_done_ptr,                               # my credits [SLOTS, world]; local [SLOTS, world, blocks]
    finished_ptr, uses_ptr, clock_ptr, status_addr, stamps_ptr,
    slot, rank, world, max_tokens, hidden, topk, experts_per_rank, timeout_ns,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, K_PAD: tl.constexpr, WORLD_PAD: tl.constexpr,
    TIMING: tl.constexpr,
):
    """Combine staging on each source rank: data [SLOTS, world, T_max, H] (output dtype); arrived
    [SLOTS, blocks, world] i64 (one counter per block and expert rank); freed [SLOTS, world] i64."""
    _stamp(stamps_ptr, STAMP_STARTED, TIMING)
    status_ptr = status_addr.to(tl.pointer_type(tl.int32))    # pinned host memory: the host reads it without a sync
    use = _use(uses_ptr, slot)
    ok = wait_all_ge(freed_ptr + slot * world, world, use - 1, timeout_ns, status_ptr, TAG_COMBINE_CREDIT,
                     _clock(clock_ptr), WORLD_PAD)
    _stamp(stamps_ptr, STAMP_WAITED, TIMING)
    if ok:
        rows_per_expert = world * max_tokens
        blocks = tl.cdiv(max_tokens, BLOCK_T)
        chunks = tl.cdiv(hidden, BLOCK_H)
        kk = tl.arange(0, K_PAD)
        for item in range(tl.program_id(0), world * blocks * chunks, tl.num_programs(0)):
            src = item // (blocks * chunks)
            block = item // chunks % blocks
            t = block * BLOCK_T + tl.arange(0, BLOCK_T)
            if block * BLOCK_T < tl.load(kept_tokens_ptr + src):
                src_row = src * max_tokens + t
                meta = src_row[:, None] * topk + kk[None, :]
                has_k = (t < tl.load(kept_tokens_ptr + src))[:, None] & (kk < topk)[None, :]
                ids = tl.load(kept_ids_ptr + meta, mask=has_k, other=-1)
                local = has_k & (ids >= 0) & (ids // experts_per_rank == rank)
                rows = tl.load(kept_row_ptr + meta, mask=local, other=0)
                experts = tl.where(local, ids - rank * experts_per_rank, 0)
                weights = tl.load(kept_w_ptr + meta, mask=local, other=0.0)
                cols = (item % chunks) * BLOCK_H + tl.arange(0, BLOCK_H)
                mask = cols < hidden
                acc = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
                for k in tl.static_range(K_PAD):           # k order; the loads are all in flight at once
                    local_k = _column(local.to(tl.int32), kk, k) > 0
                    dst = _column(experts, kk, k).to(tl.int64) * rows_per_expert + _column(rows, kk, k)
                    y = tl.load(y_ptr + dst[:, None] * hidden + cols[None, :], mask=local_k[:, None] & mask[None, :],
                                other=0.0)
                    acc = tl.where(local_k[:, None], acc + _column(weights, kk, k)[:, None] * y.to(tl.float32), acc)
                out = _peer(peers, C_DATA, src, world, y_ptr.dtype.element_ty)
                row = (slot * world + rank).to(tl.int64) * max_tokens + t
                any_local = tl.max(local.to(tl.int32), 1) > 0
                tl.store(out + row[:, None] * hidden + cols[None, :], cast_rn(acc, y_ptr.dtype.element_ty),
                         mask=any_local[:, None] & mask[None, :])
                _stamp(stamps_ptr, STAMP_WORKED, TIMING)
            if last_to_finish(block_done_ptr + (slot * world + src) * blocks + block, use * chunks):
                arrived = _peer(peers, C_ARRIVED, src, world, tl.int64)
                signal_add(arrived + (slot * blocks + block) * world + rank, 1)
                _stamp(stamps_ptr, STAMP_SIGNALED, TIMING)
    _retire(finished_ptr + slot, uses_ptr + slot, use)


@triton.jit(do_not_specialize=_INTS + ["num_tokens"])
def bulk_combine_recv_kernel(
    out_ptr, ids_ptr,                                        # y [T, H], this rank's topk ids [T, K]
    data_ptr, arrived_ptr,                                   # my combine staging, arrival counters
    peers,                                                   # int64 [COMBINE_PEERS, world]: expert ranks' credits
    finished_ptr, uses_ptr, clock_ptr, status_addr, stamps_ptr,
    num_tokens, slot, rank, world, max_tokens, hidden, topk, experts_per_rank, timeout_ns,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, K_PAD: tl.constexpr, WORLD_PAD: tl.constexpr,
    TIMING: tl.constexpr,
):
    _stamp(stamps_ptr, STAMP_STARTED, TIMING)
    status_ptr = status_addr.to(tl.pointer_type(tl.int32))    # pinned host memory: the host reads it without a sync
    use = _use(uses_ptr, slot)
    clock = _clock(clock_ptr)
    blocks = tl.cdiv(max_tokens, BLOCK_T)
    chunks = tl.cdiv(hidden, BLOCK_H)
    kk = tl.arange(0, K_PAD)
    ok = use > 0
    for item in range(tl.program_id(0), tl.cdiv(num_tokens, BLOCK_T) * chunks, tl.num_programs(0)):
        block = item // chunks
        if ok:
            ok = wait_all_ge(arrived_ptr + (slot * blocks + block) * world, world, use, timeout_ns, status_ptr,
                             TAG_COMBINE_ARRIVAL, clock, WORLD_PAD)
            _stamp(stamps_ptr, STAMP_WAITED, TIMING)
        if ok:
            t = block * BLOCK_T + tl.arange(0, BLOCK_T)
            live = t < num_tokens
            cols = (item % chunks) * BLOCK_H + tl.arange(0, BLOCK_H)
            mask = cols < hidden
            ids = tl.load(ids_ptr + t[:, None] * topk + kk[None, :], mask=live[:, None] & (kk < topk)[None, :],
                          other=-1).to(tl.int32)
            dest = tl.where(ids >= 0, ids // experts_per_rank, -1)
            acc = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
            for r in tl.static_range(WORLD_PAD):            # rank order
                routed = tl.max((dest == r).to(tl.int32), 1) > 0
                row = (slot * world + r).to(tl.int64) * max_tokens + t
                part = tl.load(data_ptr + row[:, None] * hidden + cols[None, :],
                               mask=routed[:, None] & mask[None, :], other=0.0)
                acc = tl.where(routed[:, None], acc + part.to(tl.float32), acc)
            tl.store(out_ptr + t[:, None].to(tl.int64) * hidden + cols[None, :], cast_rn(acc, out_ptr.dtype.element_ty),
                     mask=live[:, None] & mask[None, :])
    _finish(finished_ptr + slot, uses_ptr + slot, use, peers, C_FREED, slot * world + rank, world, stamps_ptr, TIMING, WORLD_PAD)
