"""
Tutorial 01: a put-with-signal ring exchange
============================================

    bash launch.sh tutorials/01-ring-exchange.py

Every rank sends a block of floats to the next rank (rank + 1 mod world) with one NVSHMEM
call from a Triton kernel, ``putmem_signal_nbi_block``: the data lands in the same
symmetric buffer on the peer, and *after* it has landed the peer's signal word is set to
this round's number. The receiver waits for that signal with ``signal_wait_until`` and
can then read the data, with no host synchronization between the ranks at all.

The pieces, in the order they are used:

1. ``moe_ep.runtime.init()`` starts NVSHMEM on top of torch.distributed (the unique id
   travels over the process group; no MPI);
2. ``runtime.symmetric_zeros`` allocates tensors that exist at the same offset on every
   rank, which is what makes "the same buffer on the peer" addressable;
3. ``moe_ep.shmem`` holds the device functions; a kernel that calls them is launched
   with ``extern_libs=runtime.device_library()``;
4. rounds carry increasing signal values, so a signal left over from an earlier round
   can never be taken for a fresh one.

Without GPUs (launch.sh then starts CPU processes on gloo) the same exchange runs on the
reference path, an ``all_gather`` from which each rank keeps its predecessor's block.
"""
import torch
import torch.distributed as dist
import triton

from moe_ep import runtime, shmem
from moe_ep.timing import why_untimed


@triton.jit(do_not_specialize=["nbytes", "peer", "round_"])
def ring_kernel(dst, src, sig, nbytes, peer, round_):
    """Put my `src` into the symmetric `dst` on `peer`, signal it with the round number, wait for my own signal."""
    shmem.putmem_signal_nbi_block(dst, src, nbytes, sig, round_, shmem.SIGNAL_SET, peer)
    shmem.signal_wait_until(sig, shmem.CMP_EQ, round_)


def ring_reference(block: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """What the kernel computes, with a torch.distributed collective."""
    blocks = [torch.empty_like(block) for _ in range(world)]
    dist.all_gather(blocks, block)
    return blocks[(rank - 1) % world]


def main():
    device = runtime.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    n, rounds = 1 << 20, 5
    if device.type == "cpu":
        for r in range(1, rounds + 1):
            got = ring_reference(torch.full((n,), float(rank * 100 + r)), rank, world)
            assert torch.equal(got, torch.full((n,), float((rank - 1) % world * 100 + r)))
        print(f"rank {rank}: {rounds} rounds of the ring on the reference path (gloo), correct")
        return

    runtime.init()
    buf = runtime.symmetric_zeros((n,), torch.float32)      # what the previous rank puts here
    src = torch.empty(n, device=device)                      # what I send (any local memory)
    sig = runtime.symmetric_zeros((1,), torch.uint64)
    libs = runtime.device_library()
    runtime.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for r in range(1, rounds + 1):
        src.fill_(rank * 100 + r)
        runtime.barrier()                       # nobody overwrites a buffer its owner still reads
        start.record()
        ring_kernel[(1,)](buf, src, sig, n * 4, (rank + 1) % world, r, extern_libs=libs)
        end.record()
        torch.cuda.synchronize()
        expected = float((rank - 1) % world * 100 + r)
        assert bool((buf == expected).all()), f"round {r}: wrong data"
    reference = ring_reference(buf.clone(), rank, world)      # NCCL, the same exchange
    assert torch.equal(reference, torch.full_like(buf, float((rank - 2) % world * 100 + rounds)))
    skipped = why_untimed(device)
    took = f"took {start.elapsed_time(end) * 1e3:.0f} us" if skipped is None else f"was not timed: {skipped}"
    print(f"rank {rank}: {rounds} rounds correct; the last 4 MiB put with signal in one CTA {took}")


if __name__ == "__main__":
    main()
    runtime.finalize_distributed()
