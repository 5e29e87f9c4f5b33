"""Drop-in nn.Modules: the expert-parallel MoE block and tensor-parallel linears."""
from .moe import EPMoE
from .tp_linear import TPMLP, ColumnParallelLinear, RowParallelLinear

__all__ = ["EPMoE", "ColumnParallelLinear", "RowParallelLinear", "TPMLP"]
