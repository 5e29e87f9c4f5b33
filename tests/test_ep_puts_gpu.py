"""The put path on GPUs: every peer reached through NVSHMEM puts and signals (EPAllToAll(puts="all")),
checked against the reference on NCCL exactly as the pointer path is (tests/test_ep_gpu.py): dispatch
and combine bit for bit, across configurations, random calls back to back in mixed modes, prefill
sizes, the UE8M0 and NVFP4 payload formats, receive hooks, CUDA graphs and bad input. On one node
NVSHMEM's puts go over NVLink (or, with ranks sharing a GPU, within it); across nodes the same kernels
put over the network transport."""
import os

import pytest
import torch.distributed as dist

from distributed import gpu_worlds, run
from moe_ep import EPAllToAll
from test_ep_gpu import (SWEEP, _back_to_back, _hooks_graphs_and_errors, _payload_formats, _prefill_sized,
                         _sweep)

pytestmark = pytest.mark.gpu


def _put_path(rank, world):
    for puts, path in (("all", "put"), ("auto", "nvlink")):
        ep = EPAllToAll(8, 256, 8, 2, puts=puts)
        assert ep.peer_paths == ["local" if r == rank else path for r in range(world)], (puts, ep.peer_paths)
        ep.destroy()
    dist.barrier()
    _hooks_graphs_and_errors(rank, world, puts="all")
    if os.environ.get("MOE_EP_TEST_QUICK") == "1":       # scripts/gpu_suite.sh quick and multi: fewer kernels to
        _back_to_back(rank, world, 100, puts="all")     # compile (each configuration compiles its own)
        return
    _sweep(rank, world, SWEEP[:2], puts="all")
    _back_to_back(rank, world, 300, puts="all")
    _prefill_sized(rank, world, puts="all")
    _payload_formats(rank, world, puts="all")


@gpu_worlds
def test_put_path(world):
    run(_put_path, world, gpu=True, timeout=600)
