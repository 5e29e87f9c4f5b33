"""moe_ep: NVSHMEM-backed Triton kernels for expert-parallel MoE communication, with a torch.distributed reference.

Public API:
    EPAllToAll        low-latency dispatch/combine (FP8 inside dispatch, double-buffered signals)
    EPHandle          what dispatch hands to combine
    EPMoE             the expert-parallel MoE block
    swap_moe          puts EPMoE into a transformers model (moe_ep.integrations.transformers)
    AsyncTP           all-gather GEMM and GEMM reduce-scatter, communication overlapped with the GEMM
    ColumnParallelLinear, RowParallelLinear, TPMLP   sequence-parallel tensor-parallel linears on AsyncTP
    CommTimeoutError  raised when a device-side wait ran past its bound
    CallRefusedError  a collective call some rank refused, raised on every rank (a ValueError)
    quantize_fp8      the per-group FP8 quantization kernel dispatch applies
    random_topk, link_copies   routing helpers
    runtime           NVSHMEM lifetime (init, symmetric tensors, peer pointers, finalize)
    reference         the same contracts on torch.distributed collectives
"""
from . import reference, runtime
from .ep import EPAllToAll, EPHandle
from .runtime import CallRefusedError, CommTimeoutError
from .tp import AsyncTP
from .kernels.quant import quantize_fp8
from .integrations.transformers import swap_moe
from .layers import TPMLP, ColumnParallelLinear, EPMoE, RowParallelLinear
from .routing import link_copies, random_topk

__all__ = ["EPAllToAll", "EPHandle", "CommTimeoutError", "CallRefusedError", "EPMoE", "swap_moe", "AsyncTP",
           "ColumnParallelLinear", "RowParallelLinear", "TPMLP", "quantize_fp8", "random_topk", "link_copies",
           "runtime", "reference"]
__version__ = "0.1.0"
