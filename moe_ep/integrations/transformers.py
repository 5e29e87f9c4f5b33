"""transformers: swap_moe puts an EPMoE into every sparse MoE block of a model, and checks it first.

    model = swap_moe(AutoModelForCausalLM.from_config(config), backend="nvshmem")

A sparse MoE block is a module with a router at ``.gate`` or ``.router`` and ``.experts`` holding
3-D ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] (Mixtral, Qwen2/3-MoE, DeepSeek-V3,
HunYuan-MoE and others). ``from_block`` builds this rank's EPMoE from one, with the block's own
router and shared experts.

swap_moe checks every new layer against the block it replaces before it swaps anything (every
rank still holds the whole block then): on PROBE_TOKENS random tokens per rank, the relative
L2 difference of the outputs must stay within VERIFY_EPS machine epsilons of the weights' dtype.
Beyond that it raises ValueError naming the block; a model is never changed silently.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import collectives
from ..ep import EPAllToAll
from ..layers.moe import EPMoE

PROBE_TOKENS = 32        # per rank: with top-k routing they reach most experts of a small model, and cost little
# The verification runs the new layer on unquantized rows (reference all-to-all), so the two outputs
# differ only by roundings to the weights' dtype: the gate/up, activation, product, down and
# weighted-sum results are each rounded at most once on either side (<= 10 roundings of eps / 2
# each, relative), times 2 for the cancellation in the top-k sum. A wrong expert, weight, scale or
# missing shared expert moves the output by tens of percent.
VERIFY_EPS = 10


def from_block(block: nn.Module, group=None, **options) -> EPMoE:
    """This rank's share of a transformers sparse MoE block, with the block's own router
    (softmax, top-k, renormalization as the model defines them) and shared experts."""
    name = type(block).__name__
    experts = getattr(block, "experts", None)
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    router = getattr(block, "gate", None) or getattr(block, "router", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3
            and down.dim() == 3 and callable(router)):
        raise ValueError(f"unsupported MoE block {name}: expected a router at .gate or .router and "
                         ".experts with 3-D gate_up_proj [E, 2I, H] and down_proj [E, H, I]")
    biases = [n for n in ("gate_up_proj_bias", "down_proj_bias") if getattr(experts, n, None) is not None]
    if biases:
        raise ValueError(f"unsupported MoE block {name}: experts with biases ({', '.join(biases)}; GPT-OSS-style "
                         "interleaved gate/up with a clamped activation) are not supported")
    num_experts, two_i, hidden = gate_up.shape
    if two_i % 2 or down.shape != (num_experts, hidden, two_i // 2):
        raise ValueError(f"unsupported MoE block {name}: expert weights gate_up_proj {tuple(gate_up.shape)} and "
                         f"down_proj {tuple(down.shape)} are not in the layout [E, 2I, H], [E, H, I] "
                         "(transposed layouts, as Llama 4 stores them, are not supported)")
    topk = getattr(router, "top_k", None) or getattr(block, "top_k", None)
    if topk is None:
        raise ValueError(f"unsupported MoE block {name}: no top_k on the block or its router")
    # A routed scaling factor on the block but not on its router: the block scales the experts' sum itself.
    scaling = 1.0 if hasattr(router, "routed_scaling_factor") else getattr(block, "routed_scaling_factor", 1.0)
    layer = EPMoE(hidden, two_i // 2, num_experts, topk, group=group,
                  activation=getattr(experts, "act_fn", "silu"), router=router,
                  shared_experts=_shared_experts(block), routed_scaling_factor=float(scaling),
                  dtype=gate_up.dtype, device=gate_up.device, **options)
    mine = slice(layer.first_expert, layer.first_expert + layer.experts_per_rank)
    with torch.no_grad():
        layer.gate_up_proj.copy_(gate_up[mine])
        layer.down_proj.copy_(down[mine])
    return layer


class _GatedSharedExpert(nn.Module):
    """A shared expert scaled by sigmoid(gate(x)), as Qwen2-MoE-style blocks add it."""

    def __init__(self, expert: nn.Module, gate: nn.Module):
        super().__init__()
        self.expert, self.gate = expert, gate

    def forward(self, x):
        return torch.sigmoid(self.gate(x)) * self.expert(x)


def _shared_experts(block: nn.Module) -> nn.Module | None:
    if getattr(block, "shared_experts", None) is not None:             # DeepSeek-style
        return block.shared_experts
    if getattr(block, "shared_expert", None) is not None:              # Qwen2-MoE-style
        gate = getattr(block, "shared_expert_gate", None)
        return block.shared_expert if gate is None else _GatedSharedExpert(block.shared_expert, gate)
    return getattr(block, "shared_mlp", None)                          # HunYuan-MoE-style


def swap_moe(model: nn.Module, group=None, verify: bool = True, **options) -> nn.Module:
    """Replace, in place, every sparse MoE block of `model` (a module with a router and .experts) by an EPMoE
    holding this rank's experts, and return the model (the same object). Collective: every rank calls it
    with the same model, weights loaded, and then runs every forward.

    Each EPMoE keeps the block's router and shared experts (the same modules) and copies this rank's
    share of the block's expert weights (experts [r * E / W, (r + 1) * E / W) of rank r), in their dtype and
    on their device: swap a model whose weights are loaded, on the CPU or on this process's GPU (a model
    swapped on the CPU may be moved to the GPU afterwards). The other ranks' experts are no longer held.

    Args:
        group: the process group the experts are spread over (default: the world).
        verify: first compare every new layer with the block it replaces on PROBE_TOKENS random tokens per
            rank (``verify_layer``); if any differs beyond the rounding of its dtype, ValueError names the
            block and the difference.
        options: EPMoE's: backend ("nvshmem", the default: NVSHMEM kernels on this process's GPU, one per
            rank; "reference": torch.distributed collectives, CPU too), max_tokens (most tokens per rank in
            one forward, default 4096), fp8_dispatch, fp8_group, fp8_experts, elastic.

    Whatever it refuses (a block it cannot reproduce, an option EPMoE refuses, a backend that cannot run in
    this process, a failed verification) raises ValueError before any block is replaced: a model is never
    changed in part, nor silently.
    """
    blocks = [(name, module) for name, module in model.named_modules() if getattr(module, "experts", None) is not None]
    if not blocks:
        raise ValueError(f"no MoE block (a module with .experts) found in {type(model).__name__}")
    layers = [from_block(block, group=group, **options) for _, block in blocks]
    if verify:
        for (name, block), layer in zip(blocks, layers):
            verify_layer(block, layer, name)
    for (name, _), layer in zip(blocks, layers):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, layer)
    return model


def verify_layer(block: nn.Module, layer: EPMoE, name: str = "") -> float:
    """Compare `layer` with the whole `block` it stands for (collective); returns the relative error.

    Every rank draws PROBE_TOKENS tokens x [P, H] (seeded by its rank) in the weights' dtype and
    computes block(x[None]) and the layer's output through an unquantized reference all-to-all
    (its router, expert GEMMs, activation, shared experts and weights; FP8 dispatch and the NVSHMEM
    kernels are checked bit for bit against the reference by their own tests). The error is
    |y - y_block| / max(|y_block|, |y|) (L2 norms), the largest over ranks; beyond VERIFY_EPS
    machine epsilons of the dtype it raises ValueError naming the block class and the error.
    """
    dtype, device = layer.gate_up_proj.dtype, layer.gate_up_proj.device
    what = f"{type(block).__name__}{f' at {name}' if name else ''}"
    generator = torch.Generator().manual_seed(1000 + dist.get_rank(layer.group))
    probe = torch.randn(PROBE_TOKENS, layer.hidden, generator=generator).to(device, dtype)
    ep = EPAllToAll(PROBE_TOKENS, layer.hidden, layer.num_experts, layer.topk, group=layer.group, dtype=dtype,
                    fp8_dispatch=False, backend="reference", device=device)
    training = block.training
    block.eval()                    # no router jitter or dropout: the block as it runs in inference
    try:
        with torch.no_grad():
            expected = _block_output(block, probe, what)
            try:
                got = layer._forward(probe, None, None, ep, fp8_experts=False).float()
            except Exception as error:
                raise ValueError(f"unsupported MoE block {what}: the EPMoE built from it failed on probe tokens "
                                 f"(its router must map tokens [T, H] to (logits, weights [T, K], ids [T, K])): "
                                 f"{error}") from error
    finally:
        block.train(training)
    scale = torch.maximum(expected.norm(), got.norm()).clamp_min(torch.finfo(torch.float32).tiny)
    error = ((got - expected).norm() / scale).reshape(1).to(ep.device)
    collectives.all_reduce(error, op=dist.ReduceOp.MAX, group=layer.group)
    error, tolerance = error.item(), VERIFY_EPS * torch.finfo(dtype).eps
    if not error <= tolerance:
        raise ValueError(f"swap_moe refuses {what}: the EPMoE differs from it by {error:.3g} (relative L2 error "
                         f"on {PROBE_TOKENS} probe tokens per rank; {dtype} rounding allows {tolerance:.3g})")
    return error


def _block_output(block: nn.Module, probe: torch.Tensor, what: str) -> torch.Tensor:
    """block(probe [P, H] as [1, P, H]) -> float32 [P, H] (the first output of blocks that return a tuple)."""
    try:
        y = block(probe[None])
    except Exception as error:
        raise ValueError(f"swap_moe cannot verify {what}: its forward failed on probe tokens "
                         f"[1, {probe.shape[0]}, {probe.shape[1]}]: {error}") from error
    return (y[0] if isinstance(y, tuple) else y).reshape(probe.shape).float()
