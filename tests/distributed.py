"""Run a test body in `world` spawned processes with torch.distributed (and, on GPU, NVSHMEM) up.

    run(fn, world, *args)   # fn(rank, world, *args) in every process; gloo on CPU
    run(fn, world, *args, gpu=True)   # GPU r % GPUs for rank r: NCCL with a GPU per rank, else gloo
                                      # (shared-GPU mode, under CUDA MPS); NVSHMEM finalized at the end
    run(fn, world, *args, lost=(3,))  # rank 3 dies on the way, by die(); nobody tears down, since
                                      # NVSHMEM's finalize and the group's barrier would wait for it
    refused_on_rank_0(comm, refuse, call, message)   # a call rank 0 refuses ends on rank 1, bounded
    waited_once(took, timeout_s)      # a simulated world's calls around a death: one timeout, then none

GPU tests run at each world size of GPU_WORLDS: every visible GPU (up to 8), or on one GPU 2 and 4
ranks sharing it; MOE_EP_TEST_WORLDS (e.g. "8" or "2,4") overrides.

The processes meet through a file store in a fresh temporary folder (no port to choose, so none
another job can take first). Everything a process prints, Python or native, goes to its own log.
Any exception in any process fails the caller with every rank's exit code and whole log, and the
other processes (likely waiting for the failed one) are killed a few seconds later; a process
that does not finish within `timeout` seconds is killed and fails it too.
"""
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_ep import CallRefusedError, CommTimeoutError, mps, runtime

GPUS = torch.cuda.device_count()
GPU_WORLDS = [int(w) for w in os.environ.get("MOE_EP_TEST_WORLDS", "").split(",") if w] or (
    [min(GPUS, 8)] if GPUS >= 2 else [2, 4])
gpu_worlds = pytest.mark.parametrize("world", GPU_WORLDS)   # a GPU test's world sizes


DIED = 75          # the exit code of a rank a test kills on purpose


def die() -> None:
    """End this rank now, as a crash would (no teardown, no flush of CUDA work), with the exit code `run`
    expects of the ranks in its `lost`."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(DIED)


# A refused call's waits on rank 1 are in at most two launches (EP's dispatch: its count wait, then its
# receive; async TP: its barrier, then its first wait), each bounded by timeout_s; the third is slack for the
# launches and the host on a machine busy with other jobs (at 4 GPUs beside six other test jobs, 5.2 s for
# two waits of 2 s).
REFUSAL_WAITS = 3


def waited_once(took: list[float], timeout_s: float) -> None:
    """Seconds of a simulated world's calls around a rank's death (call 0 with the rank, call 1 the one it stops
    in, the later ones without it): call 1 waits one timeout for it, plus the interpreter's work; the later
    calls wait for nothing, so each is faster than call 1 by about that timeout. The interpreter's own seconds
    vary with the CPU, so no later call has a bound of its own."""
    assert timeout_s <= took[1] < timeout_s + 30, took
    assert all(t < took[1] - timeout_s / 2 for t in took[2:]), took


def refused_on_rank_0(comm, refuse, call, message: str) -> None:
    """A call that rank 0 refuses ends on rank 1 (of two, the nvshmem backend): on `comm` (an EPAllToAll or
    AsyncTP whose kernels a first call compiled), rank 0's refuse() raises its own ValueError, rank 1 makes
    the call (call()) and its comm.check() raises CallRefusedError matching `message` and naming rank 0
    alone, within REFUSAL_WAITS waits of comm.timeout_s of the call; from then on its call() says what broke
    it. Then every rank destroys `comm`."""
    if comm.rank == 0:
        with pytest.raises(ValueError) as refused:
            refuse()
        assert type(refused.value) is ValueError
    else:
        started = time.monotonic()
        call()
        with pytest.raises(CallRefusedError, match=message) as refused:
            comm.check()
        elapsed = time.monotonic() - started
        within_s = REFUSAL_WAITS * comm.timeout_s
        assert list(refused.value.refusals) == [0] and elapsed < within_s, (refused.value.refusals, elapsed, within_s)
        with pytest.raises(CommTimeoutError, match="refused by rank 0"):
            call()
    dist.barrier()
    comm.destroy()


def assert_broken_by(comm, what: str, call) -> None:
    """`comm` (an EPAllToAll or AsyncTP) refuses every later call, naming the refusal that broke it (`what`,
    e.g. "dispatch call 1"): its check(), and call() (a call of it)."""
    for attempt in (comm.check, call):
        with pytest.raises(CommTimeoutError, match=f"{what} refused by rank 0"):
            attempt()


def _worker(fn, rank, world, folder, gpu, args, failed, teardown):
    log = os.open(Path(folder) / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    store = f"file://{Path(folder) / 'store'}"
    code = 0
    try:
        if gpu:
            per_gpu = mps.ranks_per_gpu(world, GPUS)
            # Ranks that share a GPU share its memory: 2 GiB each still holds the tests' largest buffers.
            os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", "8G" if per_gpu == 1 else "2G")
            os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
            runtime.init_distributed(init_method=store)
        else:
            dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
        fn(rank, world, *args)
        if teardown:
            runtime.finalize_distributed()   # NVSHMEM if it started, a barrier, the group
    except BaseException:
        traceback.print_exc()
        failed.put(rank)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: torch.distributed's worker threads may still be releasing the last
    # collective's tensors, and a thread that needs the GIL while Python finalizes aborts the process.
    os._exit(code)


def _read(log: Path) -> str:
    return log.read_text(errors="replace") if log.exists() else "(no output)\n"


def run(fn, world, *args, gpu=False, timeout=600, lost=()):
    ctx = mp.get_context("spawn")
    failed = ctx.SimpleQueue()
    folder = tempfile.mkdtemp(prefix="moe_ep_test_")
    try:
        procs = [ctx.Process(target=_worker, args=(fn, r, world, folder, gpu, args, failed, not lost))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if not failed.empty():                    # the others are probably waiting for the failed one
                deadline = min(deadline, time.monotonic() + 10)
            time.sleep(0.05)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        codes = [p.exitcode for p in procs]
        if codes != [DIED if r in lost else 0 for r in range(world)]:
            logs = "".join(f"\n--- rank {r}: exit code {code}{' (killed: did not finish)' if r in hung else ''} ---\n"
                           + _read(Path(folder) / f"rank{r}.log") for r, code in enumerate(codes))
            reason = f"ranks {hung} did not finish within {timeout}s" if hung and failed.empty() else "a rank failed"
            raise AssertionError(f"{reason}; every rank's output:{logs}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
