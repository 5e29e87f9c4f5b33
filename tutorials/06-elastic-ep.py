"""
Tutorial 06: elastic expert parallelism
=======================================

    bash launch.sh --nproc 4 tutorials/06-elastic-ep.py      # 4 ranks; on one GPU they share it

An expert-parallel layer normally stands or falls with every rank: each dispatch and combine waits
for a signal from every peer, so when one rank dies the others wait until their timeout and raise.
With ``EPAllToAll(..., elastic=True)`` they go on. Every rank keeps a mask of the ranks it counts
live, on the device, and every kernel reads it; a wait that runs past ``timeout_s`` on a peer clears
that peer in every rank's mask, and the call completes among the others. Later calls wait for
nobody: the dead rank is skipped on the device, with no sync with the host and no new CUDA graph.

What the dead rank held is gone: its experts. A token routed to one of them comes back without that
expert's term, and the weights of the others are not scaled up to make up for it. ``handle.lost``
[T, K] (valid once the combine's receive ran) says which of each token's experts were lost. What to
do about it is the engine's choice: scale the kept terms up by the router weight they lost (shown
here), route the token again, or drop the request.

The job: a few calls with every rank, then the last rank exits abruptly. The survivors' next call
completes after about ``timeout_s``; each prints who is left, how long that call took and how many
experts its tokens lost, checks y against the experts that are left, renormalizes it, and runs more
calls, as fast as before the loss.

Two things about the job around the layer:

* The first call of each kernel compiles it. A rank that finishes compiling more than ``timeout_s``
  after its peers would be counted dead, so the kernels are compiled first, on an all-to-all of the
  same shape with a generous timeout (the compiled kernels are shared: the timeout is a run-time
  argument), and the short timeout is used only after.
* A dead rank takes no part in anything collective any more, and NVSHMEM's finalize, freeing
  symmetric memory (``EPAllToAll.destroy`` refuses after a loss rather than hang) and
  torch.distributed's teardown all wait for every rank they started with. So the survivors end with
  ``os._exit`` once their output is flushed; a deployment restarts the job when it chooses to.

Without GPUs ``launch.sh`` runs CPU processes on the reference backend, which moves tokens with
torch.distributed's collectives: those need every rank, so it has no elastic mode, and this
tutorial shows its refusal and stops.
"""
import os
import sys
import time

import torch
import torch.distributed as dist

from moe_ep import EPAllToAll, random_topk, runtime

TOKENS, HIDDEN, TOPK = 128, 2048, 4
EXPERTS_PER_RANK = 8
TIMEOUT_S = 2.0              # how long a survivor waits for a silent peer before counting it dead
COMPILE_TIMEOUT_S = 120.0    # the first call compiles the kernels: room for the ranks to finish far apart
CALLS_BEFORE, CALLS_AFTER = 3, 5
TOLERANCE = 1e-2             # relative error: bf16 rounds each expert's output and each rank's sum (2^-8 each)


def toy_experts(recv_x, rank):
    """Expert e (its global id) multiplies its tokens by e + 1: recv_x [E_loc, R, H] bf16 -> [E_loc, R, H] bf16."""
    experts = torch.arange(recv_x.shape[0], device=recv_x.device) + rank * recv_x.shape[0]
    return (recv_x.float() * (experts + 1)[:, None, None]).bfloat16()


def expected_y(x, topk_ids, topk_weights, lost):
    """What combine returns when the experts marked in lost [T, K] are gone: the sum of the kept terms
    w[t, k] * (topk_ids[t, k] + 1) * x[t], the others not scaled up (fp32 [T, H])."""
    kept = topk_weights.masked_fill(lost, 0)
    outputs = (x.float()[:, None, :] * (topk_ids + 1)[:, :, None]).bfloat16().float()    # [T, K, H]
    return (kept[:, :, None] * outputs).sum(1)


def check(y, expected):
    """y against the fp32 `expected`, within TOLERANCE of its norm."""
    error = ((y.float() - expected).norm() / expected.norm()).item()
    assert error < TOLERANCE, error


def step(ep, rank, x, topk_ids, topk_weights):
    """One dispatch, toy experts, combine: (y [T, H] bf16, the dispatch's handle)."""
    recv_x, _, _, handle = ep.dispatch(x, topk_ids, topk_weights)
    return ep.combine(toy_experts(recv_x, rank), handle), handle


def timed_step(ep, rank, x, topk_ids, topk_weights):
    """step() and the seconds until its results were ready (no call waits for the GPU: synchronize)."""
    torch.cuda.synchronize()
    started = time.monotonic()
    y, handle = step(ep, rank, x, topk_ids, topk_weights)
    torch.cuda.synchronize()
    return y, handle, time.monotonic() - started


def main():
    device = runtime.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    experts = EXPERTS_PER_RANK * world
    if device.type != "cuda":
        try:
            EPAllToAll(TOKENS, HIDDEN, experts, TOPK, backend="reference", elastic=True)
        except ValueError as error:
            if rank == 0:
                print(f"refused: {error}. Elastic mode needs the nvshmem backend, on GPUs: "
                      "bash launch.sh --nproc 4 tutorials/06-elastic-ep.py (on one GPU, its 4 ranks share it)")
        runtime.finalize_distributed()
        return
    if world < 2:
        print("one rank has no peer to lose: bash launch.sh --nproc 4 tutorials/06-elastic-ep.py")
        runtime.finalize_distributed()
        return
    victim = world - 1

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g).bfloat16().to(device)
    topk_ids, topk_weights = random_topk(TOKENS, experts, TOPK, device=device, generator=g)
    shape = dict(max_tokens=TOKENS, hidden=HIDDEN, num_experts=experts, topk=TOPK, fp8_dispatch=False, elastic=True)

    compile_first = EPAllToAll(**shape, timeout_s=COMPILE_TIMEOUT_S)
    step(compile_first, rank, x, topk_ids, topk_weights)
    compile_first.destroy()

    ep = EPAllToAll(**shape, timeout_s=TIMEOUT_S)
    for _ in range(CALLS_BEFORE):
        y, handle, before_s = timed_step(ep, rank, x, topk_ids, topk_weights)
        assert not handle.lost.any()
        check(y, expected_y(x, topk_ids, topk_weights, handle.lost))
    dist.barrier()                   # every rank's calls so far are complete: the victim dies between two calls

    if rank == victim:
        print(f"rank {rank}: exiting now, without a word to the others")
        sys.stdout.flush()
        # os._exit: no cleanup at all (no NVSHMEM finalize, no teardown of the process group), as a crashed
        # process leaves none. Exit code 0: torchrun tears the whole job down when a worker fails (a non-zero
        # code), which would end the survivors too; with 0 it counts this worker done and waits for the others.
        os._exit(0)

    y, handle, first_s = timed_step(ep, rank, x, topk_ids, topk_weights)
    live = ep.live_ranks()
    lost = handle.lost                                             # [T, K] bool
    per_token = torch.bincount(lost.sum(1), minlength=TOPK + 1).tolist()
    assert live == [r for r in range(world) if r != victim]
    assert torch.equal(lost, topk_ids // EXPERTS_PER_RANK == victim)           # the victim's experts, no others
    check(y, expected_y(x, topk_ids, topk_weights, lost))
    print(f"rank {rank}: the first call after rank {victim} died took {first_s:.2f} s (timeout_s={TIMEOUT_S}, "
          f"{before_s:.3f} s before); live ranks {live}; of {TOKENS} tokens, "
          + ", ".join(f"{n} lost {k} of {TOPK} experts" for k, n in enumerate(per_token) if n)
          + "; y matches the kept experts' sum")

    # What an engine can do with the report: scale each token's kept terms up by the weight it lost. A token
    # that lost every expert has nothing to scale: it stays 0 (an engine would drop it, or route it again).
    total, kept = topk_weights.sum(1, keepdim=True), topk_weights.masked_fill(lost, 0).sum(1, keepdim=True)
    scale = torch.where(kept > 0, total / kept, 1.0)                           # [T, 1]
    renormalized = y.float() * scale
    check(renormalized, expected_y(x, topk_ids, topk_weights * scale, lost))

    after_s = [timed_step(ep, rank, x, topk_ids, topk_weights)[2] for _ in range(CALLS_AFTER)]
    print(f"rank {rank}: renormalized y by the weights kept; {CALLS_AFTER} more calls took at most "
          f"{max(after_s):.3f} s each: nobody waits for rank {victim} any more")
    sys.stdout.flush()
    sys.stderr.flush()
    # NVSHMEM's finalize and torch.distributed's teardown are collective over every rank they started with,
    # and would wait for the dead rank for ever: end this process without them.
    os._exit(0)


if __name__ == "__main__":
    main()
