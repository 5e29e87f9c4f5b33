"""Routing helpers on the host: random top-k routing for tests and benchmarks, link accounting."""
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
    dest = torch.where(ids >= 0, ids // experts_per_rank, -1)
    remote = (ids >= 0) & (dest != rank)
    ranks = torch.arange(world, device=ids.device)
    routed = (dest[:, :, None] == ranks).any(1) & (ranks != rank)
    return int(routed.sum()), int(remote.sum())
