"""The autograd functions of the async-TP ops: each op's backward is another op (or a local GEMM),
so the gradients overlap their communication as the forward does. Each takes the non-differentiable
ops as callables: an ``AsyncTP``'s, or the plain ones of ``moe_ep.tp.plain`` on a process group.
"""
import torch

from .. import collectives


def tracked(a: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether autograd records an op on a and w: only then do the ops go through the functions below, whose
    apply costs 2-3 us of host time a call even where nothing is recorded (development CPU, gloo, a decode
    step's TP layers without a communicator under torch.no_grad, collectives stubbed out: the row-parallel layer
    11.8-12.0 -> 8.4-9.2 us a call, its op alone 5.0-5.4; the column-parallel one 10.7-11.2 -> 7.6-8.1, its GEMM
    alone 4.8-5.1)."""
    return torch.is_grad_enabled() and (a.requires_grad or w.requires_grad)


class AllGatherGemm(torch.autograd.Function):
    """out [M, N] = all_gather(a_shard [M/W, K]) @ w [K, N] (and the gathered A [M, K] if asked), with

        grad a_shard = reduce_scatter(grad_out @ w.T)     a GEMM reduce-scatter, overlapped as the forward is
        grad w       = all_gather(a_shard).T @ grad_out   the gathered A, kept from the forward

    ``ag(a_shard, w, return_gathered=...)`` and ``rs(a, w)`` are the two non-differentiable ops
    (an AsyncTP's, or ``plain``'s on a process group). The gathered A is kept only when
    w needs a gradient; grad_out is made contiguous (the ops take row-major activations).
    """

    @staticmethod
    def forward(ctx, a_shard, w, ag, rs, return_gathered: bool = False):
        keep = ctx.needs_input_grad[1]
        if keep or return_gathered:
            out, gathered = ag(a_shard, w, return_gathered=True)
        else:
            out, gathered = ag(a_shard, w), None
        ctx.save_for_backward(gathered if keep else None, w)
        ctx.rs = rs
        if return_gathered:
            ctx.mark_non_differentiable(gathered)
            return out, gathered
        return out

    @staticmethod
    def backward(ctx, grad_out, *_):
        gathered, w = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_a = ctx.rs(grad_out, w.t()) if ctx.needs_input_grad[0] else None
        grad_w = gathered.t() @ grad_out if ctx.needs_input_grad[1] else None
        return grad_a, grad_w, None, None, None


class GemmReduceScatter(torch.autograd.Function):
    """out [M/W, N] = reduce_scatter(a [M, K] @ w [K, N]), with

        grad a = all_gather(grad_out) @ w.T               an all-gather GEMM, overlapped as the forward is
        grad w = a.T @ all_gather(grad_out)               the gathered grad_out that GEMM hands back

    ``rs(a, w)`` and ``ag(a_shard, w, return_gathered=...)`` as in ``AllGatherGemm``.
    """

    @staticmethod
    def forward(ctx, a, w, rs, ag):
        ctx.save_for_backward(a if ctx.needs_input_grad[1] else None, w)
        ctx.ag = ag
        return rs(a, w)

    @staticmethod
    def backward(ctx, grad_out):
        a, w = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        if not ctx.needs_input_grad[1]:
            return ctx.ag(grad_out, w.t()), None, None, None
        grad_a, gathered = ctx.ag(grad_out, w.t(), return_gathered=True)
        return (grad_a if ctx.needs_input_grad[0] else None), a.t() @ gathered, None, None


class GemmAllReduce(torch.autograd.Function):
    """out [M, N] = all_reduce(a [M, K] @ w [K, N]), the same on every rank, with

        grad a = grad_out @ w.T,  grad w = a.T @ grad_out   no communication: every rank's grad_out
                                                             is the gradient of the whole output

    ``ar(a, w)`` is the non-differentiable op (an AsyncTP's, or ``plain.gemm_ar`` on a process group).
    """

    @staticmethod
    def forward(ctx, a, w, ar):
        ctx.save_for_backward(a if ctx.needs_input_grad[1] else None, w)
        return ar(a, w)

    @staticmethod
    def backward(ctx, grad_out):
        a, w = ctx.saved_tensors
        grad_a = grad_out @ w.t() if ctx.needs_input_grad[0] else None
        grad_w = a.t() @ grad_out if ctx.needs_input_grad[1] else None
        return grad_a, grad_w, None


class AllReduceGrad(torch.autograd.Function):
    """x unchanged; its gradient summed over the group's ranks: the input of a column-parallel layer
    without sequence parallelism, whose every rank's output depends on the whole, replicated x."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        collectives.all_reduce(grad, group=ctx.group)
        return grad, None
