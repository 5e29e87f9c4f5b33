"""Inputs and a brute-force oracle shared by the EP tests, and the model pieces the TP tests shard.

Every rank can rebuild every other rank's inputs from (seed, rank), so the expected result
of a dispatch or combine is computed token by token here, independently of moe_ep.reference.
"""
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from moe_ep.formats import PayloadFormat
from moe_ep.reference import dequantize_fp8, quantize_fp8
from moe_ep.routing import random_topk


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's bytes (uint8 [..., n * itemsize]): what bit-for-bit comparisons compare."""
    return t.contiguous().view(torch.uint8)


def make_inputs(rank, tokens, hidden, num_experts, topk, seed, dtype=torch.bfloat16, drop=0.0, one_expert=None,
                device="cpu"):
    """x [T, H], topk_ids [T, K] int64, topk_weights [T, K] f32 for `rank` (T = tokens[rank])."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    count = tokens[rank]
    x = (torch.randn(count, hidden, generator=g) * torch.rand(count, 1, generator=g) * 4).to(dtype)
    ids, weights = random_topk(count, num_experts, topk, generator=g)
    if one_expert is not None:          # every token picks this expert; its other experts stay distinct
        others = torch.argsort(torch.rand(count, num_experts - 1, generator=g), dim=1)[:, :topk - 1]
        ids = torch.cat([torch.full((count, 1), one_expert), others + (others >= one_expert).long()], dim=1)
    if drop:
        ids[torch.rand(count, topk, generator=g) < drop] = -1
    return x.to(device), ids.to(device), weights.to(device)


def moe_layer_inputs(rank, tokens, topk, drop, experts, hidden, intermediate, dtype=torch.float32, device="cpu"):
    """An engine MoE layer's inputs: weights the same on every rank (w13 [E, 2I, H]: gate rows, then up;
    w2 [E, H, I]); this rank's tokens [T, H], distinct expert ids per token [T, K] (some -1 with drop),
    router weights [T, K]."""
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(experts, 2 * intermediate, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, intermediate, generator=g) / intermediate ** 0.5
    g.manual_seed(100 + rank)
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.rand(tokens, experts, generator=g).argsort(dim=1)[:, :topk]
    if drop:
        ids[torch.rand(tokens, topk, generator=g) < 0.3] = -1
    weights = torch.rand(tokens, topk, generator=g)
    return [t.to(device, dtype) for t in (w13, w2, x)] + [ids.to(device), weights.to(device)]


# The amax the tests calibrate nvfp4's per-tensor scale for: make_inputs' tokens reach about 16, so groups above
# 8 saturate (block scale 448, elements 6) and the rest take the usual path.
CALIBRATED_AMAX = 8.0


def tensor_scale(group, device="cpu"):
    """The per-tensor scale dispatch takes for `group` (as ``quantize`` takes it): for a format with one (nvfp4)
    a calibrated one, float32 [1], the same on every rank (CALIBRATED_AMAX / (448 * 6)); None for the others."""
    if isinstance(group, PayloadFormat) and group.tensor_scale:
        return torch.tensor([CALIBRATED_AMAX / (448 * 6)], device=device)
    return None


def quantize(x, group):
    """x [T, H] as dispatch sends it: (payload, scales or None). group: the FP8 group (None: x as it is) or a
    PayloadFormat (its ``quantize``, under ``tensor_scale(group)``)."""
    if isinstance(group, PayloadFormat):
        return group.quantize(x, tensor_scale(group, x.device))
    return quantize_fp8(x, group) if group else (x, None)


def dequantize(payload, scales, group):
    """float32 of what ``quantize`` made (group as there)."""
    if isinstance(group, PayloadFormat):
        return group.dequantize(payload, scales, tensor_scale(group, payload.device))
    return payload.float() if scales is None else dequantize_fp8(payload, scales, group)


def expert_fn(recv_x, recv_scales, group, dtype):
    """A toy expert: dequantize (group: the FP8 group or a PayloadFormat, as ``quantize``) and scale each local
    expert e by (e + 1) / 2, in `dtype`."""
    rows = dequantize(recv_x, recv_scales, group)
    factor = (torch.arange(rows.shape[0], device=rows.device, dtype=torch.float32) + 1) / 2
    return (rows * factor[:, None, None]).to(dtype)


def on_ranks(ids, ranks, num_experts, world):
    """[T, K] bool: True where expert ids[t, k] (-1: none) lives on one of `ranks` (rank r holds experts
    [r * E / W, (r + 1) * E / W)): what an elastic all-to-all that lost `ranks` reports in handle.lost."""
    return (ids >= 0) & torch.isin(ids.div(num_experts // world, rounding_mode="floor"),
                                   torch.tensor(sorted(ranks), dtype=torch.long))


def expected_dispatch(rank, world, inputs, num_experts, max_tokens, group):
    """Per local expert: list of (payload row, scales row or None, source code) in contract order (group as
    ``quantize``)."""
    experts_per_rank = num_experts // world
    expected = [[] for _ in range(experts_per_rank)]
    for src, (x, ids, _) in enumerate(inputs):
        payload, scales = quantize(x, group)
        for t in range(x.shape[0]):
            for k in range(ids.shape[1]):
                e = int(ids[t, k])
                if e >= 0 and e // experts_per_rank == rank:
                    expected[e - rank * experts_per_rank].append(
                        (payload[t], None if scales is None else scales[t], (src * max_tokens + t) * ids.shape[1] + k))
    return expected


def expected_combine(rank, world, inputs, num_experts, group, dtype):
    """y [T, H] for `rank`: per-rank fp32 sums in k order, cast, then summed in rank order."""
    x, ids, weights = inputs[rank]
    experts_per_rank = num_experts // world
    tokens = dequantize(*quantize(x, group), group)
    y = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for r in range(world):
            acc, routed = torch.zeros(x.shape[1]), False
            for k in range(ids.shape[1]):
                e = int(ids[t, k])
                if e >= 0 and e // experts_per_rank == r:
                    local = e - r * experts_per_rank
                    out = (tokens[t] * ((local + 1) / 2)).to(dtype).float()
                    acc = acc + weights[t, k].float() * out
                    routed = True
            if routed:
                y[t] += acc.to(dtype).float()
    return y.to(dtype)


def llama_mlp(hidden, intermediate):
    """The MLP of a transformers Llama model (gate_proj, up_proj, down_proj, SiLU), as TPMLP takes it."""
    return LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, hidden_act="silu"))
