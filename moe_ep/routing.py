"""Routing helpers on the host: random top-k routing for tests and benchmarks, link and HBM accounting."""
from __future__ import annotations

import torch


def random_topk(tokens: int, num_experts: int, topk: int, device="cpu", generator: torch.Generator | None = None,
                dtype: torch.dtype = torch.float32):
    """Router-like routing: topk distinct experts per token from random scores, softmax weights.

    Returns (topk_ids [tokens, topk] int64, topk_weights [tokens, topk] dtype).
    """
    scores = torch.randn((tokens, num_experts), generator=generator, device="cpu").to(device)
    weights, ids = torch.topk(scores, topk, dim=-1)
    return ids, torch.softmax(weights, dim=-1).to(dtype)


def link_copies(topk_ids: torch.Tensor, experts_per_rank: int, rank: int, world: int) -> tuple[int, int]:
    """Copies of this rank's tokens that leave the GPU: (once per destination rank, once per (token, expert)).

    The first is what dispatch sends; the second what a kernel that sends one copy per selected
    expert would. Dropped slots (-1) count for neither.
    """
    ids = topk_ids.long()
    remote = (ids >= 0) & (ids // experts_per_rank != rank)
    routed = _ranks_routed(ids, experts_per_rank, world)
    routed[:, rank] = False
    return int(routed.sum()), int(remote.sum())


def link_bytes(topk_ids: list[torch.Tensor], rank: int, experts_per_rank: int, hidden: int,
               dtype: torch.dtype = torch.bfloat16, fp8_group: int | None = 128,
               row_bytes: int | None = None) -> tuple[int, int]:
    """Bytes that one dispatch and one combine must move over the links of rank `rank`: (dispatch, combine).

    `topk_ids` and the sizes as for ``hbm_bytes``; `row_bytes`, where given, is a dispatched row's bytes (a
    payload format's ``row_bytes(hidden)``) in place of FP8 with fp32 scales per `fp8_group` columns, or x
    as it is. A link carries each direction at its own rate, so each op counts the larger of what leaves
    the GPU and what enters it:

        sent      (token of this rank, other rank) pairs, one per other rank the token's experts live on
        received  (token of another rank, this rank) pairs

        dispatch = max(sent, received) (P + 8 K)   each token's row and scales, ids and weights, once a rank
        combine  = max(received, sent) H b         one partial sum a (token, rank) pair, back to the source
    """
    ids = [t.long() for t in topk_ids]
    world, topk = len(ids), ids[rank].shape[1]
    routed = [_ranks_routed(i, experts_per_rank, world) for i in ids]
    sent = int(routed[rank].sum() - routed[rank][:, rank].sum())
    received = sum(int(r[:, rank].sum()) for source, r in enumerate(routed) if source != rank)
    if row_bytes is None:
        row_bytes = hidden + 4 * (hidden // fp8_group) if fp8_group else hidden * dtype.itemsize
    return max(sent, received) * (row_bytes + 8 * topk), max(sent, received) * hidden * dtype.itemsize


def _ranks_routed(topk_ids: torch.Tensor, experts_per_rank: int, world: int) -> torch.Tensor:
    """[T, world] bool: whether token t has at least one expert on rank r (dropped slots, -1, on none)."""
    ids = topk_ids.long()
    dest = torch.where(ids >= 0, ids // experts_per_rank, -1)
    return (dest[:, :, None] == torch.arange(world, device=ids.device)).any(1)


def hbm_bytes(topk_ids: list[torch.Tensor], rank: int, experts_per_rank: int, hidden: int,
              dtype: torch.dtype = torch.bfloat16, fp8_group: int | None = 128) -> tuple[int, int]:
    """Bytes that one dispatch and one combine must move through the HBM of rank `rank`: (dispatch, combine).

    `topk_ids` holds every rank's [T_r, K] expert ids, in rank order (-1 = dropped slot); x, expert_out
    and y have `dtype` and H = `hidden` columns; fp8_group None means no FP8 dispatch. With this rank's
    T tokens, b bytes per element of `dtype`, and P bytes per dispatched row: H + 4 H / fp8_group (FP8
    bytes and fp32 scales) or H b (without FP8), counted from the routing:

        hits    (source token, k) slots whose expert lives on this rank: the rows of recv_x it fills
        staged  source tokens with at least one expert on this rank: the rows its dispatch staging receives
        routed  (token of this rank, rank) pairs, one per rank the token's experts live on: the partial
                sums its combine staging receives

        dispatch = T H b                 read x
                 + 8 T K                 read topk_ids and topk_weights (an int32 id, an fp32 weight a slot)
                 + 2 staged (P + 8 K)    rows, scales, ids and weights written to the staging, and read back
                 + hits P                the fan-out: each hit's row (and scales) written to recv_x
        combine  = hits H b              read the expert_out row of each hit
                 + 2 routed H b          the per-rank partial rows written to the staging, and read back
                 + T H b                 write y

    On one rank (the kernels loop back through the GPU's own memory) staged = routed = T less the
    tokens whose every slot is dropped, and hits = T K less the dropped slots.
    """
    ids = [t.long() for t in topk_ids]
    world, (tokens, topk) = len(ids), ids[rank].shape
    hits = sum(int(((i >= 0) & (i // experts_per_rank == rank)).sum()) for i in ids)
    staged = sum(int(_ranks_routed(i, experts_per_rank, world)[:, rank].sum()) for i in ids)
    routed = int(_ranks_routed(ids[rank], experts_per_rank, world).sum())
    b = dtype.itemsize
    row = hidden + 4 * (hidden // fp8_group) if fp8_group else hidden * b
    dispatch = tokens * hidden * b + 8 * tokens * topk + 2 * staged * (row + 8 * topk) + hits * row
    combine = hits * hidden * b + 2 * routed * hidden * b + tokens * hidden * b
    return dispatch, combine
