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
    collectives._served_by.clear()                     # forget the real gloo's entry, if asked before
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

    rows = torch.arange(2 * world, dtype=torch.float32) * (rank + 1)
    mine = torch.empty(2)
    collectives.reduce_scatter_tensor(mine, rows)
    expected = torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) * sum(range(1, world + 1))
    assert torch.equal(mine, expected)
    gathered = torch.empty(2 * world)
    collectives.all_gather_into_tensor(gathered, torch.full((2,), float(rank)), timeout_s=30)
    assert torch.equal(gathered, torch.arange(world, dtype=torch.float32).repeat_interleave(2))


def test_tensors_a_group_does_not_serve_cross_it_as_copies():
    run(_unserved_tensors_cross_as_copies, 2)
