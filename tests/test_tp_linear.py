"""Tensor-parallel linears on the reference backend (gloo) against the unsharded modules."""
import pytest
import torch
from torch import nn

from distributed import run
from moe_ep import TPMLP, ColumnParallelLinear, RowParallelLinear


class LlamaStyleMLP(nn.Module):
    def __init__(self, hidden, intermediate):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _layers_match(rank, world):
    torch.manual_seed(0)                                  # the same full modules on every rank
    m, hidden, inner = 4 * world, 32, 16 * world
    x = torch.randn(m, hidden)
    mine = slice(rank * m // world, (rank + 1) * m // world)

    column = nn.Linear(hidden, inner)
    tp_column = ColumnParallelLinear.from_linear(column)
    width = inner // world
    torch.testing.assert_close(tp_column(x[mine]), column(x)[:, rank * width:(rank + 1) * width])

    row = nn.Linear(inner, hidden)
    tp_row = RowParallelLinear.from_linear(row)
    h = torch.randn(m, inner)
    torch.testing.assert_close(tp_row(h[:, rank * width:(rank + 1) * width]), row(h)[mine], rtol=1e-5, atol=1e-5)

    mlp = LlamaStyleMLP(hidden, inner)
    tp_mlp = TPMLP.from_mlp(mlp)
    torch.testing.assert_close(tp_mlp(x[mine].reshape(2, -1, hidden)).reshape(-1, hidden), mlp(x)[mine],
                               rtol=1e-5, atol=1e-5)

    with pytest.raises(ValueError, match="multiple"):
        ColumnParallelLinear(hidden, inner + 1)
    with pytest.raises(ValueError, match="multiple"):
        tp_row(torch.randn(m + 1, width))
    with pytest.raises(ValueError, match="features"):
        tp_column(torch.randn(2, hidden + 1))
    with pytest.raises(ValueError, match="backend"):
        RowParallelLinear(inner, hidden, backend="cuda")
    with pytest.raises(ValueError, match="Llama-style"):
        TPMLP.from_mlp(nn.Linear(4, 4))


@pytest.mark.parametrize("world", [2, 4])
def test_tp_layers_match_unsharded(world):
    run(_layers_match, world)
