"""The library's contracts computed with plain torch and torch.distributed collectives.

This module is the test oracle (CPU with gloo, GPU with NCCL, or GPU tensors over gloo when several
ranks share one GPU: ``all_to_all_single`` and the other collectives of ``moe_ep.collectives`` move them
through host copies there). It imports nothing from the rest of the package but those collectives, thin
wrappers of torch.distributed's, so it cannot share a bug with what it checks; production code never
imports it: ``backend="reference"`` runs production paths of their own on the same collectives
(``moe_ep.ep.collective`` for EP, ``moe_ep.tp.plain`` for TP).

Expert-parallel dispatch/combine contract (``moe_ep.EPAllToAll``), world W, experts E,
E_loc = E / W experts per rank (rank r owns experts [r * E_loc, (r + 1) * E_loc)):

dispatch(x [T, H], topk_ids [T, K], topk_weights [T, K]):
    * FP8: each token is quantized per `group` columns with ``quantize_fp8``; with a payload format
      (``moe_ep.formats``), by its ``quantize``, scales of its dtype (float32, packed UE8M0 int32, e8m0,
      e4m3), nvfp4's under the per-tensor scale the caller passes, its rows H / 2 bytes of e2m1 pairs.
    * each token is sent once to every rank owning at least one of its experts
      (ids of -1 are dropped slots and go nowhere);
    * the receiver lays the rows out expert-major: recv_x [E_loc, W * T_max, H] (H / 2 for nvfp4), rows of
      expert e ordered by (source rank, source token, k); recv_count [E_loc];
      recv_src [E_loc, W * T_max] int32 = (src * T_max + t) * K + k for valid rows.
combine(expert_out [E_loc, W * T_max, H], handle) -> y [T, H]:
    * the expert rank sums w[t, k] * expert_out[row(t, k)] over its local experts in fp32,
      in k order, casts to x's dtype and returns that one row per (token, rank);
    * the source adds the rows of the ranks the token went to, in rank order, in fp32,
      and casts to x's dtype. A token with every slot dropped gets zeros.

Tensor-parallel contract (``moe_ep.tp``), tp ranks, rows split in rank order, w of any strides:
    ag_gemm(a_shard [M/tp, K], w [K, N]) = all_gather(a_shard) @ w                       -> [M, N]
    gemm_rs(a [M, K], w [K, N])          = reduce_scatter(a @ w): the partials a @ w in
                                           a's dtype, summed over ranks in fp32, cast back -> [M/tp, N]
    gemm_ar(a [M, K], w [K, N])          = all_reduce(a @ w): the same partials and sum,
                                           every row on every rank                         -> [M, N]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .collectives import all_gather_into_tensor, all_reduce, all_to_all_single, reduce_scatter_tensor

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4


def quantize_fp8(x: torch.Tensor, group: int = 128):
    """x [T, H] -> (q [T, H] float8_e4m3fn, scales [T, H // group] float32); x ~= q * scale.

    amax = max(amax over the group, 1e-4), scale = amax * fp32(1 / 448), q = fp8(x * (448 / amax)),
    round to nearest even, 448 / amax an IEEE division (a tensor by a tensor: torch turns a division by
    a constant, or of one, into a product with the reciprocal on CUDA). A NaN or an inf in a group makes
    its amax (torch's amax propagates NaN) and its scale non-finite, and so the whole group NaN once
    dequantized; the dispatch kernel's maximum skips a NaN, which there spoils its own element only.
    """
    tokens, hidden = x.shape
    xf = x.float().reshape(tokens, hidden // group, group)
    amax = xf.abs().amax(-1).clamp(min=AMAX_FLOOR)
    q = (xf * (torch.full_like(amax, FP8_MAX) / amax)[..., None]).to(torch.float8_e4m3fn)
    return q.reshape(tokens, hidden), amax * (1.0 / FP8_MAX)


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, group: int = 128) -> torch.Tensor:
    """(q [..., H] fp8, scales [..., H // group]) -> float32 [..., H]."""
    return (q.float().unflatten(-1, (-1, group)) * scales[..., None]).flatten(-2)


def _rows_to_bytes(*parts: torch.Tensor) -> torch.Tensor:
    """Concatenate per-row tensors [N, ...] into one uint8 [N, bytes] tensor."""
    rows = [(p[:, None] if p.dim() == 1 else p.flatten(1)).contiguous().view(torch.uint8) for p in parts]
    return torch.cat(rows, dim=1)


def _bytes_to_rows(rows: torch.Tensor, specs):
    """Inverse of _rows_to_bytes: specs = [(dtype, per-row shape), ...]. Each field is copied out (a field of a
    single row is contiguous already, and may start at any byte: nvfp4's rows are H / 2 + H / 16 bytes)."""
    out, start = [], 0
    for dtype, shape in specs:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        field = rows[:, start:start + nbytes].clone(memory_format=torch.contiguous_format)
        out.append(field.view(dtype).reshape(rows.shape[0], *shape))
        start += nbytes
    return out


def _exchange_rows(rows: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    """all_to_all_single of byte rows with uneven splits."""
    received = torch.empty((sum(recv_counts), rows.shape[1]), dtype=torch.uint8, device=rows.device)
    all_to_all_single(received, rows.contiguous(), recv_counts, send_counts, group=group)
    return received


@dataclass
class ReferenceHandle:
    """What combine needs from a reference dispatch."""
    num_tokens: int
    topk: int
    dtype: torch.dtype
    send_rank: torch.Tensor        # [S] rank each sent row went to (rank order)
    send_token: torch.Tensor       # [S] source token of each sent row
    send_counts: list[int]
    recv_counts: list[int]
    recv_weights: torch.Tensor     # [N, K] float32, weights of each received row
    entry_row: torch.Tensor        # [M] received row of each (row, k) entry that is local
    entry_k: torch.Tensor          # [M] its k
    entry_expert: torch.Tensor     # [M] its local expert
    entry_pos: torch.Tensor        # [M] its row within the expert
    recv_src: torch.Tensor         # [E_loc, W * T_max] int32, (src * T_max + t) * K + k, -1 if unused


def dispatch(x, topk_ids, topk_weights, *, num_experts: int, max_tokens: int, fp8_group: int | None = None,
             group=None, payload=None, tensor_scale=None):
    """Returns (recv_x, recv_scales or None, recv_count [E_loc] int32, ReferenceHandle).

    payload: a ``moe_ep.formats.PayloadFormat`` (taken as given, not imported: its ``quantize`` is the
    definition), in place of fp8_group; recv_x and recv_scales then have its payload_dtype and scale_dtype
    (recv_scales None without scales), recv_x [E_loc, W * T_max, H / element_pack]. tensor_scale: the
    per-tensor scale of a format with one (nvfp4), float32 [1] or [], the same on every rank; ValueError
    without a payload or with one that has no per-tensor scale."""
    fmt = payload
    if fmt is not None and fp8_group:
        raise ValueError(f"pass fp8_group={fp8_group} or payload={fmt.name!r}, not both")
    if tensor_scale is not None and not (fmt is not None and fmt.tensor_scale):
        raise ValueError("tensor_scale is for a payload format with a per-tensor scale (nvfp4); "
                         + (f"payload {fmt.name!r} has none" if fmt is not None
                            else f"without a payload (fp8_group={fp8_group}) dispatch takes none"))
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    experts_per_rank = num_experts // world
    tokens = x.shape[0]
    topk = topk_ids.shape[1]
    device = x.device
    ids = topk_ids.long()

    if fmt is not None and fmt.group:
        payload, scales = fmt.quantize(x, tensor_scale)
    elif fp8_group:
        payload, scales = quantize_fp8(x, fp8_group)
    else:
        payload, scales = x, None
    # The scales travel and are laid out as their bytes [T, G * itemsize] (torch indexes no float8_e8m0fnu).
    scale_dtype = None if scales is None else scales.dtype
    scales = (torch.empty(tokens, 0, dtype=torch.uint8, device=device) if scales is None
              else scales.contiguous().view(torch.uint8))
    scale_shape = scales.shape[1:]

    dest = torch.where(ids >= 0, ids // experts_per_rank, -1)
    routed = (dest[:, :, None] == torch.arange(world, device=device)).any(1)       # [T, W]
    send_rank, send_token = routed.t().nonzero(as_tuple=True)                     # rank-major
    send_counts = routed.sum(0).long()
    recv_counts = torch.empty_like(send_counts)
    all_to_all_single(recv_counts, send_counts, group=group)
    send_counts, recv_counts = send_counts.tolist(), recv_counts.tolist()

    token_index = torch.arange(tokens, device=device, dtype=torch.int32)
    rows = _rows_to_bytes(payload, scales, ids.int(), topk_weights.float(), token_index)[send_token]
    received = _exchange_rows(rows, send_counts, recv_counts, group)
    width = payload.shape[1]                                 # hidden / 2 for packed e2m1
    r_payload, r_scales, r_ids, r_weights, r_token = _bytes_to_rows(received, [
        (payload.dtype, (width,)), (torch.uint8, scale_shape), (torch.int32, (topk,)),
        (torch.float32, (topk,)), (torch.int32, ())])
    r_src = torch.repeat_interleave(torch.arange(world, device=device), torch.tensor(recv_counts, device=device))

    # Expert-major layout: local (row, k) entries in (src, t, k) order, grouped by expert.
    r_ids = r_ids.long()
    local = (r_ids >= 0) & (r_ids // experts_per_rank == rank)
    entry_row, entry_k = local.nonzero(as_tuple=True)
    entry_expert = r_ids[entry_row, entry_k] - rank * experts_per_rank
    order = torch.sort(entry_expert, stable=True).indices
    entry_row, entry_k, entry_expert = entry_row[order], entry_k[order], entry_expert[order]
    recv_count = torch.bincount(entry_expert, minlength=experts_per_rank)
    first = torch.cumsum(recv_count, 0) - recv_count
    entry_pos = torch.arange(entry_expert.numel(), device=device) - first[entry_expert]

    rows_per_expert = world * max_tokens
    recv_x = torch.empty((experts_per_rank, rows_per_expert, width), dtype=payload.dtype, device=device)
    recv_x[entry_expert, entry_pos] = r_payload[entry_row]
    recv_scales = None
    if scale_dtype is not None:
        recv_scales = torch.empty((experts_per_rank, rows_per_expert, *scale_shape), dtype=torch.uint8, device=device)
        recv_scales[entry_expert, entry_pos] = r_scales[entry_row]
        recv_scales = recv_scales.view(scale_dtype)
    recv_src = torch.full((experts_per_rank, rows_per_expert), -1, dtype=torch.int32, device=device)
    source = (r_src[entry_row] * max_tokens + r_token[entry_row].long()) * topk + entry_k
    recv_src[entry_expert, entry_pos] = source.int()

    handle = ReferenceHandle(tokens, topk, x.dtype, send_rank, send_token, send_counts, recv_counts,
                             r_weights, entry_row, entry_k, entry_expert, entry_pos, recv_src)
    return recv_x, recv_scales, recv_count.int(), handle


def combine(expert_out: torch.Tensor, handle: ReferenceHandle, group=None) -> torch.Tensor:
    """expert_out [E_loc, W * T_max, H] -> y [T, H] in the dispatched x's dtype."""
    world = dist.get_world_size(group)
    hidden = expert_out.shape[-1]
    device = expert_out.device
    h = handle
    partial = torch.zeros((len(h.recv_weights), hidden), dtype=torch.float32, device=device)
    for k in range(h.topk):                                  # k order, as the kernel sums
        sel = h.entry_k == k
        rows = h.entry_row[sel]
        y = expert_out[h.entry_expert[sel], h.entry_pos[sel]].float()
        partial[rows] = partial[rows] + h.recv_weights[rows, k, None] * y
    back = _exchange_rows(partial.to(h.dtype).view(torch.uint8), h.recv_counts, h.send_counts, group)
    back = back.view(h.dtype)
    out = torch.zeros((h.num_tokens, hidden), dtype=torch.float32, device=device)
    for r in range(world):                                   # rank order
        sel = h.send_rank == r
        out[h.send_token[sel]] += back[sel].float()
    return out.to(h.dtype)


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, scales: torch.Tensor | None = None,
                 group: int = 128) -> torch.Tensor:
    """out[e, :counts[e]] = a[e, :counts[e]] @ w[e].T in fp32, cast to w's dtype; other rows are zero.

    a [E, R, K] (FP8 with scales [E, R, K // group], or a float dtype), w [E, N, K].
    """
    out = torch.zeros((a.shape[0], a.shape[1], w.shape[1]), dtype=w.dtype, device=a.device)
    for e, count in enumerate(counts.tolist()):
        rows = a[e, :count]
        rows = dequantize_fp8(rows, scales[e, :count], group) if scales is not None else rows.float()
        out[e, :count] = (rows @ w[e].float().t()).to(w.dtype)
    return out


def ag_gemm(a_shard: torch.Tensor, w: torch.Tensor, group=None, return_gathered: bool = False):
    """all_gather of the row shards [M/tp, K] -> A [M, K], then A @ w with w [K, N] -> [M, N] (and A)."""
    world = dist.get_world_size(group)
    gathered = torch.empty((world * a_shard.shape[0], a_shard.shape[1]), dtype=a_shard.dtype, device=a_shard.device)
    all_gather_into_tensor(gathered, a_shard.contiguous(), group=group)
    out = gathered @ w
    return (out, gathered) if return_gathered else out


def gemm_rs(a: torch.Tensor, w: torch.Tensor, group=None) -> torch.Tensor:
    """(a [M, K] @ w [K, N]) in a's dtype, summed over ranks in fp32, rows scattered -> [M/tp, N]."""
    world = dist.get_world_size(group)
    partial = (a @ w).float()
    out = torch.empty((partial.shape[0] // world, partial.shape[1]), dtype=torch.float32, device=a.device)
    reduce_scatter_tensor(out, partial, group=group)
    return out.to(a.dtype)


def gemm_ar(a: torch.Tensor, w: torch.Tensor, group=None) -> torch.Tensor:
    """(a [M, K] @ w [K, N]) in a's dtype, summed over ranks in fp32 -> [M, N] on every rank."""
    partial = (a @ w).float()
    all_reduce(partial, group=group)
    return partial.to(a.dtype)
