"""Low-latency expert-parallel dispatch and combine over NVLink peer pointers.

Four kernels, two per direction, each launched by ``moe_ep.EPAllToAll``:

dispatch_send   (on every rank, for its own tokens)
    programs [0, E)       "layout": program e scans this rank's topk ids in (token, k) order
                          and writes, on the rank that owns expert e, the position of each hit
                          among this rank's rows for e, and their count.
    programs [E, grid)    "tokens": one work item = (token, column chunk). The chunk is
                          quantized to FP8 once (``fp8_quantize_groups``) and stored once to
                          every rank that owns at least one of the token's experts; the
                          token's expert ids go to every rank, its weights to those ranks.
    Every program then release-adds 1 to each receiver's arrival counter for (slot, me).

dispatch_recv   (on every rank)
    Waits until every sender's counter says its whole grid has arrived, then fans each
    received token out, in local HBM, to the rows of its local experts:
    row = (rows of this expert from lower ranks) + (position sent by the layout program),
    so rows come in (source rank, token, k) order, the reference's order. It keeps what
    combine needs (ids, weights, rows) in local memory and acks each sender.

combine_send    (on every expert rank)
    One work item = (source rank, token, column chunk): sum_k w[k] * expert_out[row(k)]
    over the token's local experts, in fp32, in k order, cast to the output dtype, stored
    once into the source rank's combine buffer; then release-add to its counter.

combine_recv    (on every source rank)
    Waits for every rank's counter, adds the per-rank rows in rank order in fp32 for the
    ranks each token was routed to, casts; acks each expert rank.

Signals never carry a flag value that could be stale: each program keeps its own count of
how often it has used each buffer slot, and a counter must reach uses * (sender grid).
Those counts live in a per-kernel int64 `state` array [3, grid]: rows 0 and 1 count the uses
of slots 0 and 1, row 2 is the program's clock word for the bounded waits.
Before writing into a slot a sender waits for the receivers' acks of that slot's previous
use, so a straggler is never overwritten. Every wait is bounded (``wait_until_ge``).

Peer addresses come in per-buffer tables: ``table[r]`` is the int64 address of rank r's copy.
"""
import triton
import triton.language as tl

from ..shmem import signal_add, wait_until_ge
from .quant import cast_rn, fp8_quantize_groups, to_fp8

# Which wait timed out, as written into the status tensor.
TAG_DISPATCH_CREDIT = tl.constexpr(1)
TAG_DISPATCH_ARRIVAL = tl.constexpr(2)
TAG_COMBINE_CREDIT = tl.constexpr(3)
TAG_COMBINE_ARRIVAL = tl.constexpr(4)
TAGS = {1: "dispatch (waiting for the receiver to free its buffer)",
        2: "dispatch (waiting for the sender's tokens)",
        3: "combine (waiting for the receiver to free its buffer)",
        4: "combine (waiting for the expert rank's rows)"}

# Run-time ints: no specialization on their values (an int equal to 1 would become a constexpr).
# hidden and max_tokens stay specialized: their divisibility by 16 is what lets loads and stores vectorize.
_INTS = ["slot", "rank", "world", "topk", "experts_per_rank", "peer_programs", "timeout_ns"]


@triton.jit
def _peer(table, r, dtype: tl.constexpr):
    """Rank r's copy of a symmetric buffer, as a pointer to dtype (symmetric buffers are 16-byte aligned)."""
    return tl.multiple_of(tl.load(table + r).to(tl.pointer_type(dtype)), 16)


@triton.jit
def _next_use(state, slot):
    """This program's use count of `slot`, incremented (only this program touches its entry).

    Every thread loads the entry; the barrier keeps the store (by one thread) behind all the
    loads, or a late warp would read the new count and wait for a different target.
    """
    entry = state + slot * tl.num_programs(0) + tl.program_id(0)
    use = tl.load(entry) + 1
    tl.debug_barrier()
    tl.store(entry, use)
    return use


@triton.jit
def _wait_all(flags, slot, world, target, timeout_ns, status, tag, state):
    """Wait until flags[slot, r] >= target for every rank r; False if any wait timed out."""
    clock = state + 2 * tl.num_programs(0) + tl.program_id(0)
    ok = target >= 0
    for r in range(world):
        ok = ok & wait_until_ge(flags + slot * world + r, target, timeout_ns, status, r, tag, clock)
    return ok


@triton.jit
def _signal_all(table, slot, rank, world):
    """Add 1 to entry [slot, rank] of every rank's copy of an int64 [2, world] counter array."""
    for r in range(world):
        signal_add(_peer(table, r, tl.int64) + slot * world + rank, 1)


@triton.jit
def _pick(values, index, k):
    """values[k] of a short vector, as a scalar."""
    return tl.sum(tl.where(index == k, values, 0), axis=0)


@triton.jit(do_not_specialize=_INTS + ["num_tokens", "num_experts"])
def dispatch_send_kernel(
    x_ptr, ids_ptr, w_ptr,                                   # [T, H], [T, K], [T, K]
    data_peers, scale_peers, ids_peers, w_peers, pos_peers, count_peers, ntok_peers, flag_peers,
    ack_ptr, state_ptr, status_addr,
    num_tokens, slot, rank, world, max_tokens, hidden, topk, experts_per_rank, num_experts,
    peer_programs, timeout_ns,
    FP8: tl.constexpr, GROUP: tl.constexpr, BLOCK_GROUPS: tl.constexpr, K_PAD: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    """Staging on rank r, per slot and source rank s: data [T_max, H] (FP8 or x's dtype), scales
    [T_max, H/GROUP] f32, ids/weights/positions [T_max, K] i32/f32/i32, counts [E/world] i32,
    ntok [] i32; flags [2, world] i64. `peer_programs` is the receiver's grid size."""
    status = status_addr.to(tl.pointer_type(tl.int32))
    use = _next_use(state_ptr, slot)
    ok = _wait_all(ack_ptr, slot, world, (use - 1) * peer_programs, timeout_ns, status, TAG_DISPATCH_CREDIT,
                   state_ptr)
    pid = tl.program_id(0)
    stage = slot * world + rank                              # my row block on every receiver
    if ok:
        if pid < num_experts:
            # Layout: positions of (token, k) hits for expert `pid` among my rows, in (t, k) order.
            owner = pid // experts_per_rank
            positions = _peer(pos_peers, owner, tl.int32) + stage * max_tokens * topk
            found = tl.zeros((), tl.int32)
            n = num_tokens * topk
            for i0 in range(0, n, BLOCK_I):
                i = i0 + tl.arange(0, BLOCK_I)
                hit = (tl.load(ids_ptr + i, mask=i < n, other=-1) == pid).to(tl.int32)
                tl.store(positions + i, found + tl.cumsum(hit, 0) - 1, mask=hit > 0)
                found += tl.sum(hit, 0)
            counts = _peer(count_peers, owner, tl.int32) + stage * experts_per_rank
            tl.store(counts + pid - owner * experts_per_rank, found)
        else:
            j = pid - num_experts
            token_programs = tl.num_programs(0) - num_experts
            if j == 0:
                for r in range(world):
                    tl.store(_peer(ntok_peers, r, tl.int32) + stage, num_tokens)
            kk = tl.arange(0, K_PAD)
            groups = tl.arange(0, BLOCK_GROUPS)
            columns = tl.arange(0, GROUP)
            chunk_cols: tl.constexpr = BLOCK_GROUPS * GROUP
            chunks = tl.cdiv(hidden, chunk_cols)
            for item in range(j, num_tokens * chunks, token_programs):
                t = item // chunks
                chunk = item % chunks
                ids = tl.load(ids_ptr + t * topk + kk, mask=kk < topk, other=-1).to(tl.int32)
                dest = tl.where(ids >= 0, ids // experts_per_rank, -1)
                row = stage.to(tl.int64) * max_tokens + t
                if chunk == 0:
                    weights = tl.load(w_ptr + t * topk + kk, mask=kk < topk, other=0.0).to(tl.float32)
                    for r in range(world):
                        tl.store(_peer(ids_peers, r, tl.int32) + row * topk + kk, ids, mask=kk < topk)
                        if tl.max((dest == r).to(tl.int32), 0) > 0:
                            tl.store(_peer(w_peers, r, tl.float32) + row * topk + kk, weights, mask=kk < topk)
                g = chunk * BLOCK_GROUPS + groups
                cols = g[:, None] * GROUP + columns[None, :]
                mask = cols < hidden
                x = tl.load(x_ptr + t.to(tl.int64) * hidden + cols, mask=mask, other=0.0)
                if FP8:
                    values, scales = fp8_quantize_groups(x.to(tl.float32))
                    payload = to_fp8(values)
                else:
                    payload = x
                for r in range(world):
                    if tl.max((dest == r).to(tl.int32), 0) > 0:
                        tl.store(_peer(data_peers, r, payload.dtype) + row * hidden + cols, payload, mask=mask)
                        if FP8:
                            num_groups = hidden // GROUP
                            tl.store(_peer(scale_peers, r, tl.float32) + row * num_groups + g, scales,
                                     mask=g < num_groups)
        _signal_all(flag_peers, slot, rank, world)


@triton.jit(do_not_specialize=_INTS)
def dispatch_recv_kernel(
    data_ptr, scale_ptr, ids_ptr, w_ptr, pos_ptr, count_ptr, ntok_ptr, flag_ptr,   # my staging
    ack_peers,
    recv_x_ptr, recv_scale_ptr, recv_count_ptr, recv_src_ptr,   # [E_loc, R, H], [E_loc, R, H/G], [E_loc], [E_loc, R]
    keep_ids_ptr, keep_w_ptr, keep_row_ptr, keep_ntok_ptr,      # [world, T_max, K] x3, [world]
    state_ptr, status_addr,
    slot, rank, world, max_tokens, hidden, topk, experts_per_rank, peer_programs, timeout_ns,
    FP8: tl.constexpr, GROUP: tl.constexpr, BLOCK_GROUPS: tl.constexpr, K_PAD: tl.constexpr,
):
    """R = world * max_tokens rows per local expert; `peer_programs` is the sender's grid size."""
    status = status_addr.to(tl.pointer_type(tl.int32))
    use = _next_use(state_ptr, slot)
    ok = _wait_all(flag_ptr, slot, world, use * peer_programs, timeout_ns, status, TAG_DISPATCH_ARRIVAL, state_ptr)
    pid = tl.program_id(0)
    rows_per_expert = world * max_tokens
    stage = slot * world                                   # first source row block of this slot
    if ok:
        if pid == 0:
            for src in range(world):
                tl.store(keep_ntok_ptr + src, tl.load(ntok_ptr + stage + src))
            for e0 in range(0, experts_per_rank, 128):
                e = e0 + tl.arange(0, 128)
                total = tl.zeros((128,), tl.int32)
                for src in range(world):
                    total += tl.load(count_ptr + (stage + src) * experts_per_rank + e, mask=e < experts_per_rank,
                                     other=0)
                tl.store(recv_count_ptr + e, total, mask=e < experts_per_rank)
        kk = tl.arange(0, K_PAD)
        groups = tl.arange(0, BLOCK_GROUPS)
        columns = tl.arange(0, GROUP)
        chunk_cols: tl.constexpr = BLOCK_GROUPS * GROUP
        chunks = tl.cdiv(hidden, chunk_cols)
        num_groups = hidden // GROUP
        for item in range(pid, rows_per_expert * chunks, tl.num_programs(0)):
            src_row = item // chunks                       # src * max_tokens + t
            chunk = item % chunks
            src = src_row // max_tokens
            t = src_row % max_tokens
            if t < tl.load(ntok_ptr + stage + src):
                meta = (stage * max_tokens + src_row) * topk + kk
                ids = tl.load(ids_ptr + meta, mask=kk < topk, other=-1)
                local = (kk < topk) & (ids >= 0) & (ids // experts_per_rank == rank)
                expert = tl.where(local, ids - rank * experts_per_rank, 0)
                row = tl.load(pos_ptr + meta, mask=local, other=0)
                for s in range(src):
                    row += tl.load(count_ptr + (stage + s) * experts_per_rank + expert, mask=local, other=0)
                row = tl.where(local, row, -1)
                if chunk == 0:
                    keep = src_row * topk + kk
                    tl.store(keep_ids_ptr + keep, ids, mask=kk < topk)
                    tl.store(keep_w_ptr + keep, tl.load(w_ptr + meta, mask=local, other=0.0), mask=kk < topk)
                    tl.store(keep_row_ptr + keep, row, mask=kk < topk)
                    tl.store(recv_src_ptr + expert * rows_per_expert + row, keep, mask=local)
                if tl.max(local.to(tl.int32), 0) > 0:
                    g = chunk * BLOCK_GROUPS + groups
                    cols = g[:, None] * GROUP + columns[None, :]
                    mask = cols < hidden
                    staged = stage.to(tl.int64) * max_tokens + src_row
                    payload = tl.load(data_ptr + staged * hidden + cols, mask=mask)
                    if FP8:
                        scales = tl.load(scale_ptr + staged * num_groups + g, mask=g < num_groups)
                    for k in tl.static_range(K_PAD):
                        row_k = _pick(row, kk, k)
                        if row_k >= 0:
                            dst = _pick(expert, kk, k).to(tl.int64) * rows_per_expert + row_k
                            tl.store(recv_x_ptr + dst * hidden + cols, payload, mask=mask)
                            if FP8:
                                tl.store(recv_scale_ptr + dst * num_groups + g, scales, mask=g < num_groups)
        _signal_all(ack_peers, slot, rank, world)


@triton.jit(do_not_specialize=_INTS)
def combine_send_kernel(
    y_ptr,                                                   # expert_out [E_loc, R, H]
    keep_ids_ptr, keep_w_ptr, keep_row_ptr, keep_ntok_ptr,   # from the dispatch slot of the handle
    data_peers, flag_peers, ack_ptr, state_ptr, status_addr,
    slot, rank, world, max_tokens, hidden, topk, experts_per_rank, peer_programs, timeout_ns,
    BLOCK_H: tl.constexpr, K_PAD: tl.constexpr,
):
    """Combine staging on each source rank: data [2, world, T_max, H] (output dtype), flags [2, world]."""
    status = status_addr.to(tl.pointer_type(tl.int32))
    use = _next_use(state_ptr, slot)
    ok = _wait_all(ack_ptr, slot, world, (use - 1) * peer_programs, timeout_ns, status, TAG_COMBINE_CREDIT,
                   state_ptr)
    if ok:
        rows_per_expert = world * max_tokens
        chunks = tl.cdiv(hidden, BLOCK_H)
        kk = tl.arange(0, K_PAD)
        for item in range(tl.program_id(0), rows_per_expert * chunks, tl.num_programs(0)):
            src_row = item // chunks
            src = src_row // max_tokens
            t = src_row % max_tokens
            if t < tl.load(keep_ntok_ptr + src):
                meta = src_row * topk + kk
                ids = tl.load(keep_ids_ptr + meta, mask=kk < topk, other=-1)
                local = (kk < topk) & (ids >= 0) & (ids // experts_per_rank == rank)
                if tl.max(local.to(tl.int32), 0) > 0:
                    rows = tl.load(keep_row_ptr + meta, mask=local, other=0)
                    experts = tl.where(local, ids - rank * experts_per_rank, 0)
                    weights = tl.load(keep_w_ptr + meta, mask=local, other=0.0)
                    cols = (item % chunks) * BLOCK_H + tl.arange(0, BLOCK_H)
                    mask = cols < hidden
                    acc = tl.zeros((BLOCK_H,), tl.float32)
                    for k in tl.static_range(K_PAD):       # k order; the loads are all in flight at once
                        local_k = _pick(local.to(tl.int32), kk, k) > 0
                        dst = _pick(experts, kk, k).to(tl.int64) * rows_per_expert + _pick(rows, kk, k)
                        y = tl.load(y_ptr + dst * hidden + cols, mask=cols < tl.where(local_k, hidden, 0), other=0.0)
                        acc = tl.where(local_k, acc + _pick(weights, kk, k) * y.to(tl.float32), acc)
                    out = _peer(data_peers, src, y_ptr.dtype.element_ty)
                    row = (slot * world + rank).to(tl.int64) * max_tokens + t
                    tl.store(out + row * hidden + cols, cast_rn(acc, y_ptr.dtype.element_ty), mask=mask)
        _signal_all(flag_peers, slot, rank, world)


@triton.jit(do_not_specialize=_INTS + ["num_tokens"])
def combine_recv_kernel(
    out_ptr, ids_ptr,                                        # y [T, H], this rank's topk ids [T, K]
    data_ptr, flag_ptr, ack_peers, state_ptr, status_addr,
    num_tokens, slot, rank, world, max_tokens, hidden, topk, experts_per_rank, peer_programs, timeout_ns,
    BLOCK_H: tl.constexpr, K_PAD: tl.constexpr, WORLD_PAD: tl.constexpr,
):
    status = status_addr.to(tl.pointer_type(tl.int32))
    use = _next_use(state_ptr, slot)
    ok = _wait_all(flag_ptr, slot, world, use * peer_programs, timeout_ns, status, TAG_COMBINE_ARRIVAL, state_ptr)
    if ok:
        chunks = tl.cdiv(hidden, BLOCK_H)
        kk = tl.arange(0, K_PAD)
        for item in range(tl.program_id(0), num_tokens * chunks, tl.num_programs(0)):
            t = item // chunks
            cols = (item % chunks) * BLOCK_H + tl.arange(0, BLOCK_H)
            mask = cols < hidden
            ids = tl.load(ids_ptr + t * topk + kk, mask=kk < topk, other=-1).to(tl.int32)
            dest = tl.where(ids >= 0, ids // experts_per_rank, -1)
            acc = tl.zeros((BLOCK_H,), tl.float32)
            for r in tl.static_range(WORLD_PAD):            # rank order
                routed = tl.max((dest == r).to(tl.int32), 0) > 0
                row = (slot * world + r).to(tl.int64) * max_tokens + t
                part = tl.load(data_ptr + row * hidden + cols, mask=cols < tl.where(routed, hidden, 0), other=0.0)
                acc = tl.where(routed, acc + part.to(tl.float32), acc)
            tl.store(out_ptr + t.to(tl.int64) * hidden + cols, cast_rn(acc, out_ptr.dtype.element_ty), mask=mask)
        _signal_all(ack_peers, slot, rank, world)
