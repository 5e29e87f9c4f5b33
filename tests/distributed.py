"""Run a test body in `world` spawned processes with torch.distributed (and, on GPU, NVSHMEM) up.

    run(fn, world, *args)   # fn(rank, world, *args) in every process; gloo on CPU
    run(fn, world, *args, gpu=True)   # NCCL, one GPU per process; NVSHMEM is finalized at the end

Any exception in any process fails the caller with that process's traceback, and the other
processes (likely waiting for the failed one) are killed a few seconds later; a process that
does not finish within `timeout` seconds is killed and fails it too.
"""
import os
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world, port, gpu, args, errors):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    try:
        if gpu:
            os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", "8G")
            os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
            torch.cuda.set_device(rank)
            dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
        else:
            dist.init_process_group("gloo", rank=rank, world_size=world)
        fn(rank, world, *args)
        if gpu:
            from moe_ep import runtime
            runtime.finalize()
        dist.destroy_process_group()
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise SystemExit(1)
    os._exit(0)      # done: skip interpreter teardown, where library threads have been seen to abort


def run(fn, world, *args, gpu=False, timeout=600):
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world, port, gpu, args, errors)) for r in range(world)]
    for p in procs:
        p.start()
    deadline, failures = time.monotonic() + timeout, []
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        while not errors.empty():
            failures.append(errors.get())
        if failures:                                  # the others are probably waiting for the failed one
            deadline = min(deadline, time.monotonic() + 10)
        time.sleep(0.05)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    while not errors.empty():
        failures.append(errors.get())
    if failures:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures)))
    if hung:
        raise AssertionError(f"ranks {hung} did not finish within {timeout}s")
    codes = [p.exitcode for p in procs]
    assert codes == [0] * world, f"exit codes {codes}"
