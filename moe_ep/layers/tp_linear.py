"""Tensor-parallel linear layers with sequence parallelism: the all-gather before a column-parallel
GEMM and the reduce-scatter after a row-parallel one.

    up = ColumnParallelLinear.from_linear(nn.Linear(H, I), group)     # weight rows [I/tp, H] on this rank
    down = RowParallelLinear.from_linear(nn.Linear(I, H), group)      # weight columns [H, I/tp]
    y_shard = down(act(up(x_shard)))           # x_shard, y_shard: this rank's rows [M/tp, H]

Inputs and outputs are sequence-parallel: rank r holds rows [r*M/tp, (r+1)*M/tp) of the flattened
leading dimensions. ``backend="reference"`` runs on torch.distributed (all_gather_into_tensor /
reduce_scatter_tensor + matmul), on CPU with gloo or GPU with NCCL; it is the only backend so far.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .. import reference

BACKENDS = ("reference",)


def _split(total: int, world: int, what: str) -> int:
    if total % world:
        raise ValueError(f"{what}={total} is not a multiple of the tensor-parallel size {world}")
    return total // world


class _TPLinear(nn.Module):
    """An nn.Linear's weight [out, in] sharded along SPLIT_DIM over the group; the bias is [weight rows]."""

    SPLIT_DIM = 0

    def __init__(self, in_features: int, out_features: int, group=None, bias: bool = True,
                 backend: str = "reference", dtype=None, device=None):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.group, self.backend = group, backend
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.in_features, self.out_features = in_features, out_features
        shape = [out_features, in_features]
        name = ("out_features", "in_features")[self.SPLIT_DIM]
        shape[self.SPLIT_DIM] = _split(shape[self.SPLIT_DIM], self.world, name)
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(shape[0], dtype=dtype, device=device)) if bias else None

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.weight.shape[1]:
            raise ValueError(f"x has {x.shape[-1]} features, this layer takes {self.weight.shape[1]}")
        return x.reshape(-1, x.shape[-1])

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, backend: str = "reference"):
        """This rank's shard of linear.weight (and of its bias, when the bias is sharded too)."""
        layer = cls(linear.in_features, linear.out_features, group, linear.bias is not None, backend,
                    linear.weight.dtype, linear.weight.device)
        size = layer.weight.shape[cls.SPLIT_DIM]
        with torch.no_grad():
            layer.weight.copy_(linear.weight.narrow(cls.SPLIT_DIM, layer.rank * size, size))
            if linear.bias is not None:
                bias = linear.bias
                layer.bias.copy_(bias.narrow(0, layer.rank * size, size) if cls.SPLIT_DIM == 0 else bias)
        return layer


class ColumnParallelLinear(_TPLinear):
    """y = all_gather(x_shard) @ W_r.T (+ b_r): x_shard [..., in] holds this rank's rows, y [M, out/tp]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [M/tp rows, in] (leading dims flattened) -> [M, out/tp]."""
        y = reference.ag_gemm(self._rows(x), self.weight, self.group)
        return y if self.bias is None else y + self.bias


class RowParallelLinear(_TPLinear):
    """y_shard = reduce_scatter(x @ W_r.T) (+ b): x [M, in/tp], y_shard [M/tp, out] (this rank's rows).

    The weight is split by columns; the bias is whole and added once, after the reduction."""

    SPLIT_DIM = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in/tp] -> [M/tp, out]."""
        rows = self._rows(x)
        _split(rows.shape[0], self.world, "rows")
        y = reference.gemm_rs(rows, self.weight, self.group)
        return y if self.bias is None else y + self.bias


class TPMLP(nn.Module):
    """A Llama-style gated MLP, down(act(gate(x)) * up(x)), with gate/up column- and down row-parallel.

    Sequence-parallel in and out: x_shard [M/tp, H] -> [M/tp, H].
    """

    def __init__(self, gate: ColumnParallelLinear, up: ColumnParallelLinear, down: RowParallelLinear, act):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act = gate, up, down, act

    @classmethod
    def from_mlp(cls, mlp: nn.Module, group=None, backend: str = "reference") -> "TPMLP":
        """From a module with gate_proj, up_proj, down_proj (nn.Linear) and act_fn, as Llama's MLP."""
        for name in ("gate_proj", "up_proj", "down_proj"):
            if not isinstance(getattr(mlp, name, None), nn.Linear):
                raise ValueError(f"{type(mlp).__name__} has no nn.Linear {name}: not a Llama-style MLP")
        return cls(ColumnParallelLinear.from_linear(mlp.gate_proj, group, backend),
                   ColumnParallelLinear.from_linear(mlp.up_proj, group, backend),
                   RowParallelLinear.from_linear(mlp.down_proj, group, backend), getattr(mlp, "act_fn", nn.SiLU()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
