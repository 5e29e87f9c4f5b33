"""EPMoE: an expert-parallel MoE block, and swap_moe, which puts it into a transformers model.

    layer = EPMoE(hidden=7168, intermediate=2048, num_experts=256, topk=8, router=my_router)
    y = layer(x)                                   # x [..., H]: route, dispatch, local experts, combine

    model = swap_moe(AutoModelForCausalLM.from_config(config), backend="nvshmem")

Each rank holds only its experts (rank r: experts [r*E/W, (r+1)*E/W)) as gated MLPs in the layout
transformers uses: gate_up_proj [E_loc, 2*I, H] (gate rows first, then up), down_proj [E_loc, H, I].
The experts run as two masked grouped GEMMs over dispatch's expert-major rows, whose work follows
the received counts: the first applies act(gate) * up in its epilogue and writes packed rows, the
second writes the capacity layout combine reads. FP8 rows are dequantized as the GEMM loads them,
or, with fp8_experts=True, multiplied as they are by FP8 weights on FP8 tensor cores.

swap_moe checks every new layer against the block it replaces before it swaps anything (every
rank still holds the whole block then): on PROBE_TOKENS random tokens per rank, the relative
L2 difference of the outputs must stay within VERIFY_EPS machine epsilons of the weights' dtype.
Beyond that it raises ValueError naming the block; a model is never changed silently.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import reference
from ..ep import EPAllToAll
from ..kernels.grouped_gemm import ACTIVATIONS, WEIGHT_BLOCK, grouped_gemm, grouped_gemm_reference
from ..kernels.quant import quantize_weights_fp8

PROBE_TOKENS = 32        # per rank: with top-k routing they reach most experts of a small model, and cost little
# The verification runs the new layer on unquantized rows (reference all-to-all), so the two outputs
# differ only by roundings to the weights' dtype: the gate/up, activation, product, down and
# weighted-sum results are each rounded at most once on either side (<= 10 roundings of eps / 2
# each, relative), times 2 for the cancellation in the top-k sum. A wrong expert, weight, scale or
# missing shared expert moves the output by tens of percent.
VERIFY_EPS = 10


class EPMoE(nn.Module):
    """Expert-parallel gated-MLP experts behind a router.

    Args:
        hidden, intermediate: H and I of every expert.
        num_experts, topk: E (a multiple of the world size) and K.
        group: the process group the experts are spread over (default: the world).
        activation: "silu", "gelu", or a callable applied to the gate projection.
        router: module mapping tokens [T, H] to (logits, topk_weights [T, K], topk_ids [T, K]);
            without one, forward needs topk_ids and topk_weights.
        shared_experts: module mapping tokens [T, H] to an output added to the experts' sum.
        routed_scaling_factor: the experts' weighted sum is multiplied by it (applied to the weights).
        max_tokens: most tokens one forward may carry per rank.
        fp8_dispatch, fp8_group, backend: passed to EPAllToAll (backend "nvshmem" or "reference").
        fp8_experts: run the experts on FP8 tensor cores: this rank's weights are quantized once, at
            the first forward (128 x 128 blocks, ``quantize_weights_fp8``; call ``quantize_experts()``
            again after changing them), FP8 rows from dispatch are used as they come, the
            intermediate is quantized per 128 columns as the second GEMM loads it. H and I must be
            multiples of 128.
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, topk: int, group=None,
                 activation="silu", router: nn.Module | None = None, shared_experts: nn.Module | None = None,
                 routed_scaling_factor: float = 1.0,
                 max_tokens: int = 4096, fp8_dispatch: bool = True, fp8_group: int = 128, backend: str = "nvshmem",
                 fp8_experts: bool = False,
                 dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        world = dist.get_world_size(group)
        if isinstance(activation, str) and activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)} or a callable, got {activation!r}")
        if not callable(activation) and not isinstance(activation, str):
            raise ValueError(f"activation must be a name or a callable, got {type(activation).__name__}")
        for name, value in (("hidden", hidden), ("intermediate", intermediate), ("num_experts", num_experts),
                            ("topk", topk), ("max_tokens", max_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if num_experts % world:
            raise ValueError(f"num_experts={num_experts} is not a multiple of the world size {world}")
        self.hidden, self.intermediate, self.num_experts, self.topk = hidden, intermediate, num_experts, topk
        self.group, self.max_tokens, self.backend = group, max_tokens, backend
        if fp8_experts and (hidden % WEIGHT_BLOCK.value or intermediate % WEIGHT_BLOCK.value):
            raise ValueError(f"fp8_experts needs hidden and intermediate multiples of {WEIGHT_BLOCK.value}, "
                             f"got {hidden} and {intermediate}")
        self.fp8_dispatch, self.fp8_group, self.fp8_experts = fp8_dispatch, fp8_group, fp8_experts
        self._fp8_weights: tuple | None = None     # (gate_up, its scales, down, its scales) once quantized
        self.experts_per_rank = num_experts // world
        self.first_expert = dist.get_rank(group) * self.experts_per_rank
        self.activation = ACTIVATIONS[activation] if isinstance(activation, str) else activation
        self._fused_activation = _kernel_activation(activation)   # the grouped GEMM applies it; None: torch does
        self.router, self.shared_experts, self.routed_scaling_factor = router, shared_experts, routed_scaling_factor
        self.gate_up_proj = nn.Parameter(torch.empty(self.experts_per_rank, 2 * intermediate, hidden,
                                                     dtype=dtype, device=device))
        self.down_proj = nn.Parameter(torch.empty(self.experts_per_rank, hidden, intermediate,
                                                  dtype=dtype, device=device))
        self._all_to_all: EPAllToAll | None = None

    @classmethod
    def from_block(cls, block: nn.Module, group=None, **options) -> "EPMoE":
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
        layer = cls(hidden, two_i // 2, num_experts, topk, group=group,
                    activation=getattr(experts, "act_fn", "silu"), router=router,
                    shared_experts=_shared_experts(block), routed_scaling_factor=float(scaling),
                    dtype=gate_up.dtype, device=gate_up.device, **options)
        mine = slice(layer.first_expert, layer.first_expert + layer.experts_per_rank)
        with torch.no_grad():
            layer.gate_up_proj.copy_(gate_up[mine])
            layer.down_proj.copy_(down[mine])
        return layer

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor | None = None,
                topk_weights: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., H] -> [..., H]; routes with the router unless topk_ids/topk_weights [T, K] are given."""
        if x.shape[-1] != self.hidden:
            raise ValueError(f"x has hidden size {x.shape[-1]}, this layer has {self.hidden}")
        if topk_ids is None and self.router is None:
            raise ValueError("this EPMoE has no router: pass topk_ids and topk_weights")
        tokens = x.reshape(-1, self.hidden).contiguous()
        return self._forward(tokens, topk_ids, topk_weights, self._ep()).reshape(x.shape)

    def _forward(self, tokens, topk_ids, topk_weights, ep: EPAllToAll, fp8_experts: bool | None = None):
        if topk_ids is None:
            _, topk_weights, topk_ids = self.router(tokens)
        if self.routed_scaling_factor != 1.0:
            topk_weights = topk_weights * self.routed_scaling_factor
        recv_x, recv_scales, recv_count, handle = ep.dispatch(tokens, topk_ids.contiguous(), topk_weights.contiguous())
        rows_per_expert = tokens.shape[0] * ep.world * self.topk / self.num_experts   # expected, for the tile shapes
        y = ep.combine(self.run_experts(recv_x, recv_scales, recv_count, rows_per_expert, fp8_experts), handle)
        if self.shared_experts is not None:
            y = y + self.shared_experts(tokens)
        return y

    def run_experts(self, recv_x, recv_scales, recv_count, rows_per_expert: float | None = None,
                    fp8_experts: bool | None = None) -> torch.Tensor:
        """The local gated MLPs on dispatch's layout: recv_x [E_loc, R, H] (FP8 with recv_scales
        [E_loc, R, H / fp8_group], or the weights' dtype), recv_count [E_loc] int32 -> [E_loc, R, H].

        Only rows below the counts are read or written (rows past them hold garbage combine never
        reads); the intermediate act(gate) * up is packed: [R * min(K, E_loc), I], the most rows
        dispatch can deliver. rows_per_expert (expected) picks the GEMM tile shapes; fp8_experts
        (default: the layer's) picks the FP8 weights.
        """
        fp8 = self.fp8_experts if fp8_experts is None else fp8_experts
        if fp8:
            gate_up, gate_up_scales, down, down_scales = self._fp8_weights or self.quantize_experts()
        else:
            gate_up, gate_up_scales, down, down_scales = self.gate_up_proj, None, self.down_proj, None
        weights = (gate_up, gate_up_scales, down, down_scales)
        if recv_x.is_cuda:
            return self._run_experts_on_kernels(recv_x, recv_scales, recv_count, rows_per_expert, *weights)
        return self._run_experts_in_torch(recv_x, recv_scales, recv_count, *weights)

    def _run_experts_in_torch(self, recv_x, recv_scales, recv_count, gate_up, gate_up_scales, down, down_scales):
        dtype = self.gate_up_proj.dtype
        h = grouped_gemm_reference(recv_x, gate_up, recv_count, recv_scales, self.fp8_group,
                                   self._fused_activation or self.activation, gate_up_scales, dtype)
        return grouped_gemm_reference(h, down, recv_count, w_scales=down_scales, out_dtype=dtype)

    def _run_experts_on_kernels(self, recv_x, recv_scales, recv_count, rows_per_expert, gate_up, gate_up_scales,
                                down, down_scales):
        experts, rows, _ = recv_x.shape
        dtype = self.gate_up_proj.dtype
        gemm = dict(counts=recv_count, rows_per_expert=rows_per_expert)
        first = dict(scales=recv_scales, group=self.fp8_group, w_scales=gate_up_scales, **gemm)
        packed_rows = rows * min(self.topk, experts)
        if self._fused_activation:
            h = torch.empty((packed_rows, self.intermediate), dtype=dtype, device=recv_x.device)
            grouped_gemm(recv_x, gate_up, out=h, activation=self._fused_activation, **first)
        else:
            gate_up_rows = torch.empty((packed_rows, 2 * self.intermediate), dtype=dtype, device=recv_x.device)
            gate, up = grouped_gemm(recv_x, gate_up, out=gate_up_rows, **first).chunk(2, dim=-1)
            h = self.activation(gate) * up
        out = torch.empty((experts, rows, self.hidden), dtype=dtype, device=recv_x.device)
        return grouped_gemm(h, down, out=out, w_scales=down_scales, **gemm)

    def quantize_experts(self) -> tuple:
        """Quantize this rank's expert weights to FP8 (128 x 128 blocks) for fp8_experts; returns and
        keeps (gate_up [E_loc, 2I, H] fp8, its scales, down [E_loc, H, I] fp8, its scales)."""
        with torch.no_grad():
            self._fp8_weights = (*quantize_weights_fp8(self.gate_up_proj.detach(), WEIGHT_BLOCK.value),
                                 *quantize_weights_fp8(self.down_proj.detach(), WEIGHT_BLOCK.value))
        return self._fp8_weights

    def _ep(self) -> EPAllToAll:
        if self._all_to_all is None:
            self._all_to_all = EPAllToAll(self.max_tokens, self.hidden, self.num_experts, self.topk, group=self.group,
                                          dtype=self.gate_up_proj.dtype, fp8_dispatch=self.fp8_dispatch,
                                          fp8_group=self.fp8_group, backend=self.backend)
        return self._all_to_all


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
    """Replace every sparse MoE block of `model` (a module with a router and .experts) by an EPMoE holding
    this rank's experts (collective: every rank calls it with the same model). Options go to EPMoE
    (backend, max_tokens, fp8_dispatch, ...). Returns the model.

    With verify (the default) every new layer is first compared with the block it replaces on
    PROBE_TOKENS random tokens per rank (see ``verify_layer``); if any differs beyond the rounding
    of its dtype, ValueError names the block and the difference, and the model is left unchanged.
    """
    blocks = [(name, module) for name, module in model.named_modules() if getattr(module, "experts", None) is not None]
    if not blocks:
        raise ValueError(f"no MoE block (a module with .experts) found in {type(model).__name__}")
    layers = [EPMoE.from_block(block, group=group, **options) for _, block in blocks]
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
                    fp8_dispatch=False, backend="reference")
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
    reference.all_reduce(error, op=dist.ReduceOp.MAX, group=layer.group)
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


def _kernel_activation(activation) -> str | None:
    """The grouped GEMM's name for `activation` ("silu", "gelu"), or None if only torch can apply it."""
    if isinstance(activation, str):
        return activation
    silu = activation is nn.functional.silu or isinstance(activation, nn.SiLU) \
        or type(activation).__name__ == "SiLUActivation"                       # transformers' SiLU
    gelu = activation is nn.functional.gelu or (isinstance(activation, nn.GELU) and activation.approximate == "none") \
        or type(activation).__name__ == "GELUActivation"                       # transformers' exact GELU
    return "silu" if silu else "gelu" if gelu else None
