"""The torch.distributed collectives the host paths use, for tensors on any device and any group backend.

NCCL cannot run with several ranks on one GPU, so such a job's group is gloo, and GPU tensors cross it as
host copies; CPU tensors (a model not yet moved to its GPU) cross an NCCL group as copies on this process's
GPU. Production code (the plain ops of ``moe_ep.tp.plain``, the cost model and autograd functions of
``moe_ep.tp``, the checks of ``moe_ep.integrations``) and the oracle (``moe_ep.reference``) both call these.
"""
from __future__ import annotations

import datetime
from operator import attrgetter

import torch
import torch.distributed as dist

# Newer torch renames the single-tensor collectives and deprecates the old names (a FutureWarning on 2.13);
# older torch has only the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# Whether a tensor is on a device a group backend serves, and where the others cross it; a backend not
# named here (a "cpu:gloo,cuda:nccl" pair) serves both.
_SERVED = {"gloo": (attrgetter("is_cpu"), "cpu"), "nccl": (attrgetter("is_cuda"), "cuda")}


def _collective(collective, outputs: list[torch.Tensor], inputs: list[torch.Tensor], group, timeout_s=None,
                **options) -> None:
    """collective(*outputs, *inputs, group=group, **options); tensors on a device the group's backend does
    not serve (GPU tensors on gloo, CPU tensors on NCCL) take part as copies on one it does, and the
    results are copied back into `outputs`. With `timeout_s`, RuntimeError if the collective has not
    completed within that many seconds (every rank must have entered it): the group then still holds it,
    and completes it if the missing ranks enter later."""
    staged = outputs + inputs
    served = _SERVED.get(dist.get_backend(group))
    if served is not None:
        on, stage = served
        staged = [t if on(t) else t.to(stage) for t in staged]
    if timeout_s is None:
        collective(*staged, group=group, **options)
    else:
        work = collective(*staged, group=group, async_op=True, **options)
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    for t, s in zip(outputs, staged):
        if s is not t:
            t.copy_(s)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None, input_split_sizes=None,
                      group=None) -> None:
    _collective(dist.all_to_all_single, [output], [input], group, output_split_sizes=output_split_sizes,
                input_split_sizes=input_split_sizes)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None, timeout_s=None) -> None:
    """output [W * n, ...] = every rank's input [n, ...], in rank order (within `timeout_s`, if given)."""
    _collective(_all_gather, [output], [input], group, timeout_s)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """output [n, ...] = rows [rank * n, (rank + 1) * n) of the sum over ranks of input [W * n, ...]."""
    _collective(_reduce_scatter, [output], [input], group)


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> None:
    _collective(dist.all_reduce, [tensor], [], group, op=op)
