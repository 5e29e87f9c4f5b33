"""moe_ep.collectives on gloo: what it remembers per group (the backend's devices, the size) follows the groups
as they are made and destroyed, and tensors on a device the group does not serve cross it as copies."""
import gc
import weakref

import pytest
import torch
import torch.distributed as dist

from distributed import run
from moe_ep import collectives


def _remembered_per_group(rank, world):
    """The default group's size and backend, a subgroup's, a non-member's (never remembered, refused as
    torch.distributed refuses it); a destroyed default group is not kept alive, and a new one is asked anew."""
    first = dist.group.WORLD
    sub = dist.new_group([0])                          # rank 0 alone; the others get NON_GROUP_MEMBER
    for _ in range(2):                                 # asked, then remembered
        assert collectives.world_size() == collectives.world_size(first) == world
        assert collectives.world_size(sub) == dist.get_world_size(sub) == (1 if rank == 0 else -1)
        summed = torch.ones(3)
        collectives.all_reduce(summed)
        assert torch.equal(summed, torch.full((3,), float(world)))
    if rank == 0:
        mine = torch.ones(2)
        collectives.all_reduce(mine, group=sub)
        assert torch.equal(mine, torch.ones(2))
    else:
        with pytest.raises(ValueError, match="Invalid process group"):
            collectives.all_reduce(torch.ones(2), group=sub)
    dist.barrier()

    first = weakref.ref(first)
    dist.destroy_process_group()
    gc.collect()
    assert first() is None, "a destroyed default group is kept alive"
    for ask in (collectives.world_size, lambda: collectives.all_reduce(torch.ones(1))):
        with pytest.raises(ValueError, match="Default process group has not been initialized"):
            ask()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)   # each rank a world of its own
    assert collectives.world_size() == 1
    gathered = torch.empty(2)
    collectives.all_gather_into_tensor(gathered, torch.full((2,), float(rank)))
    assert torch.equal(gathered, torch.full((2,), float(rank)))


def test_what_is_remembered_per_group_follows_the_groups():
    run(_remembered_per_group, 2)


def _unserved_tensors_cross_as_copies(rank, world):
    """With gloo taken as serving float64 tensors only (a dtype standing for a device), the float32 tensors of
    each collective cross as float64 copies, and the result lands in the caller's output; tensors it serves
    are handed over as they are."""
    collectives._about.clear()                         # forget the real gloo's entry, if asked before
    collectives._SERVED["gloo"] = (lambda t: t.dtype == torch.float64, torch.float64)
    seen = []

    def recording(*tensors, group=None):
        seen.append(tensors)
        dist.all_reduce(tensors[0], group=group)

    served = torch.ones(3, dtype=torch.float64)
    collectives._collective(recording, served, None, None)
    assert seen[-1][0] is served and torch.equal(served, torch.full((3,), float(world), dtype=torch.float64))

    unserved = torch.ones(3)
    collectives._collective(recording, unserved, None, None)
    assert seen[-1][0].dtype == torch.float64 and unserved.dtype == torch.float32
    assert torch.equal(unserved, torch.full((3,), float(world)))

    crossed, scatter = [], collectives._reduce_scatter

    def scatter_recording(output, input, group=None):
        crossed.append((output.dtype, input.dtype))
        scatter(output, input, group=group)

    collectives._reduce_scatter = scatter_recording
    rows = torch.arange(2 * world, dtype=torch.float32) * (rank + 1)
    mine = torch.empty(2)
    collectives.reduce_scatter_tensor(mine, rows)      # not to the group's method: the copies go to the wrapper
    expected = torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) * sum(range(1, world + 1))
    assert torch.equal(mine, expected) and crossed == [(torch.float64, torch.float64)]
    gathered = torch.empty(2 * world)
    collectives.all_gather_into_tensor(gathered, torch.full((2,), float(rank)), timeout_s=30)
    assert torch.equal(gathered, torch.arange(world, dtype=torch.float32).repeat_interleave(2))


def test_tensors_a_group_does_not_serve_cross_it_as_copies():
    run(_unserved_tensors_cross_as_copies, 2)


class _Sub(torch.Tensor):
    """A tensor subclass: torch.distributed's wrappers hand it to its torch-function handling."""


class _Watching(torch.overrides.TorchFunctionMode):
    """A torch-function mode that records the torch.distributed calls it is shown."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", "").startswith("torch.distributed"):
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _direct_calls_and_what_torch_distributed_keeps(rank, world):
    """Blocking sums and gathers of plain tensors go to the group's own methods, torch.distributed's wrappers
    untouched; everything the wrappers handle themselves goes through them, for each op: a tensor subclass on
    either side, complex tensors, a torch-function mode, code being compiled, a coalescing context open on the
    group; and another reduce op, a timeout (an async call). The results are the collectives' either way."""
    wrapped = []
    originals = {"all_reduce": dist.all_reduce, "_all_gather": collectives._all_gather,
                 "_reduce_scatter": collectives._reduce_scatter}

    def recording(name, original):
        def call(*args, **kwargs):
            wrapped.append(name)
            return original(*args, **kwargs)
        return call

    def ops(kind=lambda t: t, dtype=torch.float32):
        """Each collective once on tensors made by kind(plain tensor), checked; where it takes the input
        and output apart, `kind` marks the input only."""
        one = torch.ones((), dtype=dtype)
        summed = kind(torch.full((3,), float(rank + 1), dtype=dtype))
        collectives.all_reduce(summed)
        assert torch.equal(summed.as_subclass(torch.Tensor), (world * (world + 1) // 2) * one.expand(3))
        gathered = torch.empty(2 * world, dtype=dtype)
        collectives.all_gather_into_tensor(gathered, kind(torch.full((2,), float(rank), dtype=dtype)))
        assert torch.equal(gathered, torch.arange(world).repeat_interleave(2) * one)
        mine = torch.empty(2, dtype=dtype)
        collectives.reduce_scatter_tensor(mine, kind(torch.arange(2 * world).to(dtype)))
        assert torch.equal(mine, torch.arange(2 * rank, 2 * rank + 2) * world * one)

    dist.all_reduce = recording("all_reduce", originals["all_reduce"])
    collectives._all_gather = recording("all_gather", originals["_all_gather"])
    collectives._reduce_scatter = recording("reduce_scatter", originals["_reduce_scatter"])
    each = ["all_reduce", "all_gather", "reduce_scatter"]
    try:
        ops()
        assert wrapped == [], wrapped                     # all three went to the group's methods

        for kind, dtype in ((lambda t: t.as_subclass(_Sub), torch.float32), (lambda t: t, torch.complex64)):
            ops(kind, dtype)
            assert wrapped == each, wrapped
            wrapped.clear()
        with _Watching() as mode:
            ops()
        assert wrapped == each and mode.seen == [f.__name__ for f in originals.values()], (wrapped, mode.seen)
        wrapped.clear()
        compiling, torch.compiler.is_compiling = torch.compiler.is_compiling, lambda: True
        try:
            ops()
        finally:
            torch.compiler.is_compiling = compiling
        assert wrapped == each, wrapped
        wrapped.clear()

        coalescing = collectives._c10d_world.pg_coalesce_state
        coalescing[dist.group.WORLD] = []                 # as an open coalescing context leaves it
        try:
            for op in (lambda: collectives.all_reduce(torch.ones(1)),
                       lambda: collectives.all_gather_into_tensor(torch.empty(world), torch.ones(1)),
                       lambda: collectives.reduce_scatter_tensor(torch.empty(1), torch.ones(world))):
                op()                                      # queued by the wrapper, not run
            assert len(coalescing[dist.group.WORLD]) == 3
        finally:
            del coalescing[dist.group.WORLD]
        assert wrapped == each, wrapped
        wrapped.clear()

        largest = torch.full((2,), float(rank))
        collectives.all_reduce(largest, op=dist.ReduceOp.MAX)
        assert torch.equal(largest, torch.full((2,), float(world - 1))) and wrapped.pop() == "all_reduce"
        gathered = torch.empty(world)
        collectives.all_gather_into_tensor(gathered, torch.full((1,), float(rank)), timeout_s=30)
        assert torch.equal(gathered, torch.arange(world, dtype=torch.float32)) and wrapped.pop() == "all_gather"
    finally:
        dist.all_reduce = originals["all_reduce"]
        collectives._all_gather, collectives._reduce_scatter = originals["_all_gather"], originals["_reduce_scatter"]


def test_plain_tensors_go_to_the_group_s_methods():
    run(_direct_calls_and_what_torch_distributed_keeps, 2)
