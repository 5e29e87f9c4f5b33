"""Tensor-parallel linear layers, with sequence parallelism (the default: the all-gather before a
column-parallel GEMM and the reduce-scatter after a row-parallel one) or without it (decode).

    comm = AsyncTP(max_rows=8192, max_features=14336)                      # shared by every layer
    up = ColumnParallelLinear.from_linear(nn.Linear(H, I), comm=comm)      # weight rows [I/tp, H] here
    down = RowParallelLinear.from_linear(nn.Linear(I, H), comm=comm)       # weight columns [H, I/tp] here
    y_shard = down(act(up(x_shard)))          # x_shard, y_shard: this rank's rows [M/tp, H]

Inputs and outputs are sequence-parallel: rank r holds rows [r*M/tp, (r+1)*M/tp) of the flattened
leading dimensions. The communication runs through ``comm``, an ``moe_ep.AsyncTP`` (all-gather
GEMM and GEMM reduce-scatter, overlapped where that pays). Without one, a layer runs the plain ops
of ``moe_ep.tp.plain`` on torch.distributed over ``group`` (CPU with gloo, or NCCL): one collective
and one GEMM, the partials reduced in the dtype as NCCL does, which is AsyncTP's "never" path.

With ``sequence_parallel=False`` every rank holds all M rows of the layers' inputs and outputs:
a column-parallel layer needs no communication forward (its input gradient is all-reduced), a
row-parallel one all-reduces its output (``AsyncTP.gemm_ar``): the decode case, where M need not
be a multiple of tp and one all-reduce per MLP replaces a gather and a scatter.

    up = ColumnParallelLinear.from_linear(nn.Linear(H, I), comm=comm, sequence_parallel=False)
    down = RowParallelLinear.from_linear(nn.Linear(I, H), comm=comm, sequence_parallel=False)
    y = down(act(up(x)))                      # x, y: [M, H], the same on every rank

The layers train: the gradient of an all-gather GEMM's input is a GEMM reduce-scatter and the
other way round (``moe_ep.tp.autograd.AllGatherGemm``, ``GemmReduceScatter``), on the same backend as
the forward. With sequence parallelism a row-parallel layer's bias is whole on every rank and
added to this rank's rows, so its gradient holds this rank's rows' share: all-reduce it over the
group before the optimizer step, as any parameter replicated under sequence parallelism.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from ..tp import AsyncTP, plain
from ..tp.autograd import AllGatherGemm, AllReduceGrad, GemmAllReduce, GemmReduceScatter, tracked


def _split(total: int, world: int, what: str) -> int:
    if total % world:
        raise ValueError(f"{what}={total} is not a multiple of the tensor-parallel size {world}")
    return total // world


class _TPLinear(nn.Module):
    """An nn.Linear's weight [out, in] sharded along SPLIT_DIM over the group; the bias is [weight rows]."""

    SPLIT_DIM = 0

    def __init__(self, in_features: int, out_features: int, group=None, bias: bool = True,
                 comm: AsyncTP | None = None, dtype=None, device=None, sequence_parallel: bool = True):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        if comm is not None and not isinstance(comm, AsyncTP):
            raise ValueError(f"comm must be an moe_ep.AsyncTP or None, got {type(comm).__name__}")
        self.group = comm.group if comm is not None else group
        self.comm = comm
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
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

    def _plain_ops(self):
        """(all-gather GEMM, GEMM reduce-scatter) of moe_ep.tp.plain on this layer's group."""
        return partial(plain.ag_gemm, group=self.group), partial(plain.gemm_rs, group=self.group)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, tp={self.world}, "
                f"sequence_parallel={self.sequence_parallel}")

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, comm: AsyncTP | None = None, sequence_parallel: bool = True):
        """This rank's shard of linear.weight (and of its bias, when the bias is sharded too)."""
        return cls.from_linears([linear], group, comm, sequence_parallel)

    @classmethod
    def from_linears(cls, linears: list[nn.Linear], group=None, comm: AsyncTP | None = None,
                     sequence_parallel: bool = True):
        """One layer for several linears of the same input (e.g. gate and up): this rank's shards,
        stacked in order. Column-parallel only; a row-parallel layer takes one linear."""
        if len(linears) != 1 and cls.SPLIT_DIM != 0:
            raise ValueError(f"{cls.__name__} takes one nn.Linear")
        first = linears[0]
        if any(lin.in_features != first.in_features for lin in linears):
            raise ValueError("the linears must take the same input size")
        layer = cls(first.in_features, sum(lin.out_features for lin in linears), group, first.bias is not None,
                    comm, first.weight.dtype, first.weight.device, sequence_parallel)
        with torch.no_grad():
            weights, biases = [], []
            name = ("out_features", "in_features")[cls.SPLIT_DIM]
            for lin in linears:
                size = _split(lin.weight.shape[cls.SPLIT_DIM], layer.world, name)
                weights.append(lin.weight.narrow(cls.SPLIT_DIM, layer.rank * size, size))
                if lin.bias is not None:
                    biases.append(lin.bias.narrow(0, layer.rank * size, size) if cls.SPLIT_DIM == 0 else lin.bias)
            layer.weight.copy_(torch.cat(weights, dim=cls.SPLIT_DIM))
            if layer.bias is not None:
                layer.bias.copy_(torch.cat(biases))
        return layer


class ColumnParallelLinear(_TPLinear):
    """y = all_gather(x_shard) @ W_r.T (+ b_r): x_shard [..., in] holds this rank's rows, y [M, out/tp].
    Without sequence parallelism: y = x @ W_r.T (+ b_r), x [..., in] all rows on every rank."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [M/tp rows, in] (leading dims flattened; all M rows without sequence parallelism) -> [M, out/tp]."""
        rows, weight = self._rows(x), self.weight
        if not self.sequence_parallel:
            y = (AllReduceGrad.apply(rows, self.group) if tracked(rows, weight) else rows) @ weight.t()
        elif self.comm is not None:
            y = self.comm.ag_gemm(rows.contiguous(), weight.t())
        elif tracked(rows, weight):
            y = AllGatherGemm.apply(rows.contiguous(), weight.t(), *self._plain_ops())
        else:
            y = plain.ag_gemm(rows.contiguous(), weight.t(), self.group)
        return y if self.bias is None else y + self.bias


class RowParallelLinear(_TPLinear):
    """y_shard = reduce_scatter(x @ W_r.T) (+ b): x [M, in/tp], y_shard [M/tp, out] (this rank's rows).
    Without sequence parallelism: y = all_reduce(x @ W_r.T) (+ b), y [M, out] on every rank.

    The weight is split by columns; the bias is whole and added once, after the reduction."""

    SPLIT_DIM = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in/tp] -> [M/tp, out] ([M, out] without sequence parallelism)."""
        a, w = self._rows(x).contiguous(), self.weight.t()
        if self.sequence_parallel:
            _split(a.shape[0], self.world, "rows")
        if self.comm is not None:
            y = self.comm.gemm_rs(a, w) if self.sequence_parallel else self.comm.gemm_ar(a, w)
        elif not tracked(a, w):
            y = plain.gemm_rs(a, w, self.group) if self.sequence_parallel else plain.gemm_ar(a, w, self.group)
        elif self.sequence_parallel:
            ag, rs = self._plain_ops()
            y = GemmReduceScatter.apply(a, w, rs, ag)
        else:
            y = GemmAllReduce.apply(a, w, partial(plain.gemm_ar, group=self.group))
        return y if self.bias is None else y + self.bias


class TPMLP(nn.Module):
    """A Llama-style gated MLP, down(act(gate(x)) * up(x)), tensor- and sequence-parallel.

    gate and up are one column-parallel layer (one all-gather GEMM for both, this rank's gate
    columns then its up columns), down is row-parallel. x_shard [M/tp, H] -> [M/tp, H]; without
    sequence parallelism x [M, H] -> [M, H], the same on every rank.
    """

    def __init__(self, gate_up: ColumnParallelLinear, down: RowParallelLinear, act):
        super().__init__()
        self.gate_up_proj, self.down_proj, self.act = gate_up, down, act

    @classmethod
    def from_mlp(cls, mlp: nn.Module, group=None, comm: AsyncTP | None = None,
                 sequence_parallel: bool = True) -> "TPMLP":
        """From a module with gate_proj, up_proj, down_proj (nn.Linear) and act_fn, as Llama's MLP."""
        for name in ("gate_proj", "up_proj", "down_proj"):
            if not isinstance(getattr(mlp, name, None), nn.Linear):
                raise ValueError(f"{type(mlp).__name__} has no nn.Linear {name}: not a Llama-style MLP")
        return cls(ColumnParallelLinear.from_linears([mlp.gate_proj, mlp.up_proj], group, comm, sequence_parallel),
                   RowParallelLinear.from_linear(mlp.down_proj, group, comm, sequence_parallel),
                   getattr(mlp, "act_fn", nn.SiLU()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)
