"""Drop-in nn.Modules built on the kernels: the expert-parallel MoE block."""
from .moe import EPMoE, swap_moe

__all__ = ["EPMoE", "swap_moe"]
