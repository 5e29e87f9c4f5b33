"""EPMoE: an expert-parallel MoE block, and swap_moe, which puts it into a transformers model.

    layer = EPMoE(hidden=7168, intermediate=2048, num_experts=256, topk=8, router=my_router)
    y = layer(x)                                   # x [..., H]: route, dispatch, local experts, combine

    model = swap_moe(AutoModelForCausalLM.from_config(config), backend="nvshmem")

Each rank holds only its experts (rank r: experts [r*E/W, (r+1)*E/W)) as gated MLPs in the layout
transformers uses: gate_up_proj [E_loc, 2*I, H] (gate rows first, then up), down_proj [E_loc, H, I].
The experts run as two masked grouped GEMMs over dispatch's expert-major rows (FP8 rows are
dequantized as the GEMM loads them); combine does the weighted sum.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import reference
from ..ep import EPAllToAll
from ..kernels.grouped_gemm import grouped_gemm

ACTIVATIONS = {"silu": nn.functional.silu, "gelu": nn.functional.gelu}


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
        max_tokens: most tokens one forward may carry per rank.
        fp8_dispatch, fp8_group, backend: passed to EPAllToAll (backend "nvshmem" or "reference").
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, topk: int, group=None,
                 activation="silu", router: nn.Module | None = None, shared_experts: nn.Module | None = None,
                 max_tokens: int = 4096, fp8_dispatch: bool = True, fp8_group: int = 128, backend: str = "nvshmem",
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
        self.fp8_dispatch, self.fp8_group = fp8_dispatch, fp8_group
        self.experts_per_rank = num_experts // world
        self.first_expert = dist.get_rank(group) * self.experts_per_rank
        self.activation = ACTIVATIONS[activation] if isinstance(activation, str) else activation
        self.router, self.shared_experts = router, shared_experts
        self.gate_up_proj = nn.Parameter(torch.empty(self.experts_per_rank, 2 * intermediate, hidden,
                                                     dtype=dtype, device=device))
        self.down_proj = nn.Parameter(torch.empty(self.experts_per_rank, hidden, intermediate,
                                                  dtype=dtype, device=device))
        self._all_to_all: EPAllToAll | None = None

    @classmethod
    def from_block(cls, block: nn.Module, group=None, **options) -> "EPMoE":
        """This rank's share of a transformers sparse MoE block, with the block's own router
        (softmax, top-k, renormalization as the model defines them) and shared experts."""
        experts = getattr(block, "experts", None)
        gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
        router = getattr(block, "gate", None) or getattr(block, "router", None)
        if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3
                and down.dim() == 3 and callable(router)):
            raise ValueError(f"unsupported MoE block {type(block).__name__}: expected a router at .gate and "
                             ".experts with 3-D gate_up_proj [E, 2I, H] and down_proj [E, H, I]")
        num_experts, two_i, hidden = gate_up.shape
        topk = getattr(router, "top_k", None) or getattr(block, "top_k", None)
        if topk is None:
            raise ValueError(f"unsupported MoE block {type(block).__name__}: no top_k on the block or its router")
        layer = cls(hidden, two_i // 2, num_experts, topk, group=group,
                    activation=getattr(experts, "act_fn", "silu"), router=router,
                    shared_experts=_shared_experts(block), dtype=gate_up.dtype, device=gate_up.device, **options)
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
        tokens = x.reshape(-1, self.hidden).contiguous()
        if topk_ids is None:
            if self.router is None:
                raise ValueError("this EPMoE has no router: pass topk_ids and topk_weights")
            _, topk_weights, topk_ids = self.router(tokens)
        ep = self._ep()
        recv_x, recv_scales, recv_count, handle = ep.dispatch(tokens, topk_ids.contiguous(), topk_weights.contiguous())
        y = ep.combine(self.run_experts(recv_x, recv_scales, recv_count), handle)
        if self.shared_experts is not None:
            y = y + self.shared_experts(tokens)
        return y.reshape(x.shape)

    def run_experts(self, recv_x, recv_scales, recv_count) -> torch.Tensor:
        """The local gated MLPs on dispatch's layout [E_loc, R, H] -> [E_loc, R, H]; rows past the counts
        hold garbage that combine never reads."""
        gemm = grouped_gemm if recv_x.is_cuda else reference.grouped_gemm
        gate, up = gemm(recv_x, self.gate_up_proj, recv_count, recv_scales, self.fp8_group).chunk(2, dim=-1)
        return gemm((self.activation(gate) * up).contiguous(), self.down_proj, recv_count)

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
    return None


def swap_moe(model: nn.Module, group=None, **options) -> nn.Module:
    """Replace every sparse MoE block of `model` (a module with a router and .experts) by an EPMoE holding
    this rank's experts. Options go to EPMoE (backend, max_tokens, fp8_dispatch, ...). Returns the model."""
    blocks = [(name, module) for name, module in model.named_modules() if getattr(module, "experts", None) is not None]
    if not blocks:
        raise ValueError(f"no MoE block (a module with .experts) found in {type(model).__name__}")
    for name, block in blocks:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, EPMoE.from_block(block, group=group, **options))
    return model
