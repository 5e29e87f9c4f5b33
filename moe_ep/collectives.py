"""The torch.distributed collectives the host paths use, for tensors on any device and any group backend.

NCCL cannot run with several ranks on one GPU, so such a job's group is gloo, and GPU tensors cross it as
host copies; CPU tensors (a model not yet moved to its GPU) cross an NCCL group as copies on this process's
GPU. What they ask of a group (its backend, and its size: ``world_size``) is asked once per group object.
Production code (the plain ops of ``moe_ep.tp.plain``, the cost model and autograd functions of
``moe_ep.tp``, the checks of ``moe_ep.integrations``) and the oracle (``moe_ep.reference``) both call these.
"""
from __future__ import annotations

import datetime
import weakref
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

# What every call asks of its group, remembered per group object: dist.get_backend and dist.get_world_size take
# 0.3 to 0.5 us a call, in calls whose own host time is a few us. The keys are the groups' ids, each entry removed
# when its group goes (weakref.finalize), so that none keeps a destroyed group (and its gloo threads) alive or
# answers for a later object at its address; a lookup takes half a WeakKeyDictionary's time.
_served_by: dict[int, tuple | None] = {}    # id(group) -> _SERVED's entry, or None
_size_of: dict[int, int] = {}               # id(group) -> dist.get_world_size(group)


def _per_group(known: dict, ask, group):
    """ask(group), remembered in `known` per group object. None names the default group, looked up at every
    call: one destroyed and made again is a new object, asked anew. What cannot be remembered (None where there
    is no default group, a rank's GroupMember.NON_GROUP_MEMBER) is asked every time, and answered or refused
    as torch.distributed does. A group destroyed while its caller still holds it keeps its answer: a call on it
    is then refused by the collective, if at all, not here."""
    if group is None:
        group = dist.group.WORLD
    try:
        return known[id(group)]
    except KeyError:
        answer = ask(group)
    try:
        weakref.finalize(group, known.pop, id(group), None)
    except TypeError:             # not weakly referable: not a ProcessGroup
        return answer
    known[id(group)] = answer
    return answer


def world_size(group=None) -> int:
    """dist.get_world_size(group): the ranks of `group` (None: the default group), -1 where this rank is not
    in it."""
    return _per_group(_size_of, dist.get_world_size, group)


def _serves(group) -> tuple | None:
    """_SERVED's entry for `group`'s backend (None: it serves every device)."""
    return _SERVED.get(dist.get_backend(group))


def _collective(collective, output: torch.Tensor, input: torch.Tensor | None, group, timeout_s=None,
                **options) -> None:
    """collective(output, input, group=group, **options) (without `input` where it is None); tensors on a
    device the group's backend does not serve (GPU tensors on gloo, CPU tensors on NCCL) take part as copies
    on one it does, and the result is copied back into `output`. With `timeout_s`, RuntimeError if the
    collective has not completed within that many seconds (every rank must have entered it): the group then
    still holds it, and completes it if the missing ranks enter later."""
    tensors = (output,) if input is None else (output, input)
    served = _per_group(_served_by, _serves, group)
    if served is not None:
        on, stage = served
        if not (on(output) and (input is None or on(input))):     # all(map(on, tensors)) at half its cost
            tensors = tuple(t if on(t) else t.to(stage) for t in tensors)
    if timeout_s is None:
        collective(*tensors, group=group, **options)
    else:
        work = collective(*tensors, group=group, async_op=True, **options)
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    if tensors[0] is not output:
        output.copy_(tensors[0])


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None, input_split_sizes=None,
                      group=None) -> None:
    _collective(dist.all_to_all_single, output, input, group, output_split_sizes=output_split_sizes,
                input_split_sizes=input_split_sizes)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None, timeout_s=None) -> None:
    """output [W * n, ...] = every rank's input [n, ...], in rank order (within `timeout_s`, if given)."""
    _collective(_all_gather, output, input, group, timeout_s)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """output [n, ...] = rows [rank * n, (rank + 1) * n) of the sum over ranks of input [W * n, ...]."""
    _collective(_reduce_scatter, output, input, group)


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> None:
    _collective(dist.all_reduce, tensor, None, group, op=op)
