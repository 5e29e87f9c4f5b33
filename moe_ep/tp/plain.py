"""The plain tensor-parallel ops: one collective and one GEMM (cuBLAS on GPUs), nothing overlapped.

    out = ag_gemm(a_shard, w, group)    # a_shard [M/W, K], w [K, N] -> all_gather(a_shard) @ w    [M, N]
    out = gemm_rs(a, w, group)          # a [M, K], w [K, N]         -> reduce_scatter(a @ w)      [M/W, N]
    out = gemm_ar(a, w, group)          # a [M, K], w [K, N]         -> all_reduce(a @ w)          [M, N]

W is the group's size; rows are sharded in rank order, as all_gather and reduce_scatter do; w may have any
strides (``linear.weight.t()``). The collectives are ``moe_ep.collectives``' (NCCL, or gloo on CPU), so
tensors on a device the group does not serve cross it as copies; the GEMMs are ``torch.mm``, which ``a @ w``
reaches after 0.2 us of Python (development CPU: at decode sizes a call's host time shows in its time). This
is AsyncTP's "never" path, its ``backend="reference"``, and the TP layers' path without a communicator;
``moe_ep.reference`` states the same contracts as the tests' oracle.

What gemm_rs and gemm_ar sum: each rank's partial a @ w in a's dtype, added over the ranks

  - in a's dtype (``sum_dtype=None``, the default), as NCCL reduces: the plain path of AsyncTP and of the
    TP layers without a communicator; with three or more ranks each addition rounds to the dtype;
  - in ``sum_dtype=torch.float32``, cast back to a's dtype: ``moe_ep.reference``'s contract, which
    AsyncTP's ``backend="reference"`` keeps (an elementwise pass more, and twice the bytes of a
    half-precision partial on the wire).

Both are one computation for fp32 operands, and for any dtype at W = 2 (the two partials are added in
fp32 and rounded once either way).
"""
from __future__ import annotations

import torch

from .. import collectives


def _in_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t.to(dtype), and t itself where it is in `dtype` already, as Tensor.to returns it, without the 0.7 us
    torch's dispatcher takes to find that out."""
    return t if t.dtype == dtype else t.to(dtype)


def ag_gemm(a_shard: torch.Tensor, w: torch.Tensor, group=None, return_gathered: bool = False):
    """a_shard [M/W, K] (this rank's rows; copied first if not contiguous), w [K, N] -> out [M, N] in
    their dtype (and the gathered A [M, K], if asked)."""
    rows, k = a_shard.shape
    gathered = a_shard.new_empty((collectives.world_size(group) * rows, k))
    collectives.all_gather_into_tensor(gathered, a_shard.contiguous(), group=group)
    out = torch.mm(gathered, w)
    return (out, gathered) if return_gathered else out


def gemm_rs(a: torch.Tensor, w: torch.Tensor, group=None, sum_dtype: torch.dtype | None = None) -> torch.Tensor:
    """a [M, K] (this rank's columns of the activations), w [K, N] -> out [M/W, N] in a's dtype: this rank's
    rows of the sum over ranks of a @ w, summed in `sum_dtype` (None: a's dtype; see the module docstring).
    ValueError, before anything runs, if M is not a multiple of W."""
    world = collectives.world_size(group)
    if a.shape[0] % world:
        raise ValueError(f"gemm_rs: M={a.shape[0]} rows cannot be scattered evenly over {world} ranks")
    partial = torch.mm(a, w)              # launched first: the host work below runs beside it
    if sum_dtype is not None:
        partial = _in_dtype(partial, sum_dtype)
    out = partial.new_empty((partial.shape[0] // world, partial.shape[1]))
    collectives.reduce_scatter_tensor(out, partial, group=group)
    return _in_dtype(out, a.dtype)


def gemm_ar(a: torch.Tensor, w: torch.Tensor, group=None, sum_dtype: torch.dtype | None = None) -> torch.Tensor:
    """a [M, K] (this rank's columns of the activations), w [K, N] -> out [M, N] in a's dtype: the sum over
    ranks of a @ w, the same on every rank, summed in `sum_dtype` (None: a's dtype; see the module docstring)."""
    partial = torch.mm(a, w)
    if sum_dtype is not None:
        partial = _in_dtype(partial, sum_dtype)
    collectives.all_reduce(partial, group=group)
    return _in_dtype(partial, a.dtype)
