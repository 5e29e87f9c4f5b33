"""Where the EP kernels of this tree stop: each step synchronized and printed; Python stacks every 20 s."""
import faulthandler
import sys
import time

import torch
import torch.distributed as dist

from moe_ep import runtime
from moe_ep.ep import EPAllToAll

faulthandler.dump_traceback_later(20, repeat=True)
runtime.init_distributed()
rank, world = dist.get_rank(), dist.get_world_size()
dev = torch.device("cuda", torch.cuda.current_device())
t0 = time.time()


def say(*a):
    print(f"[rank {rank} {time.time() - t0:6.1f}s]", *a, flush=True)


def step(name, fn):
    say("start", name)
    out = fn()
    torch.cuda.synchronize()
    say("done ", name)
    return out


for mode, tokens in (("low_latency", 64), ("bulk", 512)):
    ep = step(f"{mode} build", lambda: EPAllToAll(tokens, 2048, 32, 4, mode=mode, timeout_s=3.0))
    g = torch.Generator(device=dev).manual_seed(rank)
    x = torch.randn(tokens, 2048, device=dev, dtype=torch.bfloat16, generator=g)
    ids = torch.stack([torch.randperm(32, device=dev, generator=g)[:4] for _ in range(tokens)])
    w = torch.rand(tokens, 4, device=dev, generator=g)
    for i in range(3):
        recv_x, scales, count, handle, hook = step(f"{mode} dispatch send {i}", lambda: ep.dispatch(x, ids, w, return_recv_hook=True))
        step(f"{mode} dispatch recv {i}", hook)
        out = recv_x.to(torch.bfloat16) if recv_x.dtype != torch.bfloat16 else recv_x
        y, hook = step(f"{mode} combine send {i}", lambda: ep.combine(out, handle, return_recv_hook=True))
        step(f"{mode} combine recv {i}", hook)
    for i in range(3):
        recv_x, scales, count, handle = step(f"{mode} dispatch one-launch {i}", lambda: ep.dispatch(x, ids, w))
        out = recv_x.to(torch.bfloat16) if recv_x.dtype != torch.bfloat16 else recv_x
        step(f"{mode} combine one-launch {i}", lambda: ep.combine(out, handle))
    say(mode, "counts", count.tolist()[:8])
runtime.finalize_distributed()
say("all done")
