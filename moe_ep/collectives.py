"""The torch.distributed collectives the host paths use, for tensors on any device and any group backend.

NCCL cannot run with several ranks on one GPU, so such a job's group is gloo, and GPU tensors cross it as
host copies; CPU tensors (a model not yet moved to its GPU) cross an NCCL group as copies on this process's
GPU. What they ask of a group (its backend, and its size: ``world_size``) is asked once per group object.
A blocking call on plain tensors goes to the group's own method (``_direct``), not through torch.distributed's
wrapper of it: the wrapper's checks took 1.4-2.2 us a call on the development CPU, as long as the call, ours 0.7.
Production code (the plain ops of ``moe_ep.tp.plain``, the cost model and autograd functions of
``moe_ep.tp``, the checks of ``moe_ep.integrations``) and the oracle (``moe_ep.reference``) both call these.
"""
from __future__ import annotations

import datetime
import weakref
from operator import attrgetter

import torch
import torch.distributed as dist
from torch.overrides import has_torch_function

# Newer torch renames the single-tensor collectives and deprecates the old names (a FutureWarning on 2.13);
# older torch has only the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# Whether a tensor is on a device a group backend serves, and where the others cross it; a backend not
# named here (a "cpu:gloo,cuda:nccl" pair) serves both.
_SERVED = {"gloo": (attrgetter("is_cpu"), "cpu"), "nccl": (attrgetter("is_cuda"), "cuda")}

# The process groups' own methods, which torch.distributed's collectives call after their checks: an
# all-reduce, an all-gather and a reduce-scatter into one tensor, under each name a torch version gives them.
_METHODS = (("allreduce",), ("all_gather_single", "_allgather_base"),
            ("reduce_scatter_single", "_reduce_scatter_base"))
_ALL_REDUCE, _ALL_GATHER, _REDUCE_SCATTER = range(3)
_SUM = dist.ReduceOp.SUM
_c10d = dist.distributed_c10d
_c10d_world = getattr(_c10d, "_world", None)     # where torch.distributed keeps the calls of a coalescing context

# What every call asks of its group, remembered per group object: dist.get_backend and dist.get_world_size take
# 0.3 to 0.5 us a call, in calls whose own host time is a few us. The keys are the groups' ids, each entry removed
# when its group goes (weakref.finalize), so that none keeps a destroyed group (and its gloo threads) alive or
# answers for a later object at its address; a lookup takes half a WeakKeyDictionary's time.
_about: dict[int, tuple] = {}               # id(group) -> ``_ask_about(group)``
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


def _ask_about(group) -> tuple:
    """What a call on `group` needs of it: (on, stage), its backend's _SERVED entry ((None, None): it serves
    every device), and the unbound _METHODS of its class where calls may go to them (on a torch whose
    coalescing contexts this module can see), else None. dist.get_backend refuses what is not a group this
    rank is in. Unbound methods, so that remembering them keeps no group alive."""
    on, stage = _SERVED.get(dist.get_backend(group), (None, None))
    methods = None
    if hasattr(_c10d_world, "pg_coalesce_state"):
        found = tuple(next(filter(None, (getattr(type(group), name, None) for name in names)), None)
                      for names in _METHODS)
        methods = None if None in found else found
    return on, stage, methods


def _options(make, reduce_op=None):
    """Options of a blocking call (asyncOp False where this torch has the field, as torch.distributed's
    blocking calls set it), made once: torch's process groups copy what they need of them in the call."""
    options = make()
    if reduce_op is not None:
        options.reduceOp = reduce_op
    if hasattr(options, "asyncOp"):
        options.asyncOp = False
    return options


_OPTIONS = (_options(_c10d.AllreduceOptions, _SUM), _options(_c10d.AllgatherOptions),
            _options(_c10d.ReduceScatterOptions, _SUM))


def _direct(which: int, tensors: tuple, group) -> bool:
    """Collective `which` (_ALL_REDUCE: tensors (t,); the others (output, input)) run as its group's own method,
    blocking as torch.distributed's call does, and True; or False, having run nothing, where the call must go
    through ``_collective``: a tensor on a device the group does not serve (crossed as a copy), tensors with
    torch-function handling (subclasses, or any tensor under a TorchFunctionMode: the wrapper's own test), complex
    tensors (which the wrapper takes apart), code being compiled (which it maps to functional collectives), a
    coalescing context open on the group, a torch whose coalescing contexts this module cannot see. On the
    development CPU the checks take 0.7 us, the group's method and its wait 1.2, and torch.distributed's wrapper
    1.5 more than the method."""
    if group is None:
        group = dist.group.WORLD
    on, _, methods = _per_group(_about, _ask_about, group)
    output, input = tensors[0], tensors[-1]          # the same tensor for _ALL_REDUCE
    if (methods is None or has_torch_function(tensors) or output.is_complex()
            or (input is not output and input.is_complex()) or (on is not None and not (on(output) and on(input)))
            or torch.compiler.is_compiling() or group in _c10d_world.pg_coalesce_state):
        return False
    arguments = ([output],) if which == _ALL_REDUCE else tensors                # allreduce takes a list of tensors
    work = methods[which](group, *arguments, _OPTIONS[which])
    if work is not None:
        work.wait()
    return True


def _collective(collective, output: torch.Tensor, input: torch.Tensor | None, group, timeout_s=None,
                **options) -> None:
    """collective(output, input, group=group, **options) (without `input` where it is None); tensors on a device
    the group's backend does not serve (GPU tensors on gloo, CPU tensors on NCCL) take part as copies on one it
    does, and the result is copied back into `output`. With `timeout_s`, RuntimeError if the collective has not
    completed within that many seconds (every rank must have entered it): the group then still holds it, and
    completes it if the missing ranks enter later."""
    if group is None:
        group = dist.group.WORLD
    on, stage, _ = _per_group(_about, _ask_about, group)
    tensors = (output,) if input is None else (output, input)
    if on is not None and not (on(output) and (input is None or on(input))):   # all(map(on, tensors)) at half
        tensors = tuple(t if on(t) else t.to(stage) for t in tensors)          # its cost
    if timeout_s is not None:
        work = collective(*tensors, group=group, async_op=True, **options)
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    else:
        collective(*tensors, group=group, **options)
    if tensors[0] is not output:
        output.copy_(tensors[0])


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None, input_split_sizes=None,
                      group=None) -> None:
    _collective(dist.all_to_all_single, output, input, group, output_split_sizes=output_split_sizes,
                input_split_sizes=input_split_sizes)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None, timeout_s=None) -> None:
    """output [W * n, ...] = every rank's input [n, ...], in rank order (within `timeout_s`, if given)."""
    if timeout_s is not None or not _direct(_ALL_GATHER, (output, input), group):
        _collective(_all_gather, output, input, group, timeout_s)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group=None) -> None:
    """output [n, ...] = rows [rank * n, (rank + 1) * n) of the sum over ranks of input [W * n, ...]."""
    if not _direct(_REDUCE_SCATTER, (output, input), group):
        _collective(_reduce_scatter, output, input, group)


def all_reduce(tensor: torch.Tensor, op=_SUM, group=None) -> None:
    """tensor = the `op` of every rank's tensor (SUM: the sum), in place."""
    if not ((op is _SUM or op == _SUM) and _direct(_ALL_REDUCE, (tensor,), group)):    # `is` first: ReduceOp's ==
        _collective(dist.all_reduce, tensor, None, group, op=op)                          # takes 0.26 us
