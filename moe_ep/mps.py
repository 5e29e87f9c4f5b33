"""Several ranks on one GPU: the CUDA MPS control daemon that lets their NVSHMEM kernels run at once.

NCCL refuses ranks that share a GPU, and two NVSHMEM processes on one GPU without MPS hang at
their first exchange; with MPS their kernels run side by side, and peers' memory is reachable
through peer pointers as between GPUs. So a job with more ranks than GPUs (shared-GPU mode) runs
its host group on gloo, rank r on GPU r % GPUs, every process an MPS client. Each process gets at
most 1 / (ranks per GPU) of the SMs (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, read when CUDA starts),
and kernels size their grids from that share (``moe_ep.runtime.usable_sms``), so the programs of
one rank that spin waiting for a peer can never hold the SMs the peer's senders need. A share caps a
process and reserves nothing, so that holds within one job: jobs side by side on one GPU must split it
between them (a smaller CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, which is kept where set).

    python moe_ep/mps.py --ranks-per-gpu 4 -- torchrun ... script.py     # what launch.sh runs

starts a private daemon (pipe and log folders in a fresh temporary folder) unless one already
answers, runs the command with the MPS variables set, and stops the daemon and removes the folder
when the command ends, however it ends. The daemon is an ordinary process: no GPU setting changes.

This module uses the standard library only, so that a launcher can run it as a plain script.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"
PIPE_VARIABLE = "CUDA_MPS_PIPE_DIRECTORY"
LOG_VARIABLE = "CUDA_MPS_LOG_DIRECTORY"
SHARE_VARIABLE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
DEFAULT_PIPE = "/tmp/nvidia-mps"      # where clients look when CUDA_MPS_PIPE_DIRECTORY is unset

HOW_TO_START = (
    "start one for the job: `bash launch.sh --nproc N script.py` does it by itself, `python moe_ep/mps.py "
    "--ranks-per-gpu N -- COMMAND` wraps any command, or by hand: export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) "
    "CUDA_MPS_LOG_DIRECTORY=$(mktemp -d); nvidia-cuda-mps-control -d; (run the job); "
    "echo quit | nvidia-cuda-mps-control")


def ranks_per_gpu(ranks: int, gpus: int) -> int:
    """How many of a node's `ranks` share each of its `gpus` (rank r uses GPU r % gpus): 1 with a GPU
    per rank, more in shared-GPU mode."""
    return -(-ranks // gpus) if gpus > 0 else 1


def share_percent(per_gpu: int) -> int:
    """The SM percentage each of `per_gpu` processes on one GPU may use, so that all fit at once."""
    return 100 // per_gpu


def pipe_directory(env=None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get(PIPE_VARIABLE) or DEFAULT_PIPE)


def listening(env=None) -> bool:
    """Whether an MPS control daemon's pipe is in the pipe folder of `env` (default: this process's).
    A cheap check that any number of ranks can make at once."""
    return (pipe_directory(env) / "control").exists()


def running(env=None) -> bool:
    """Whether an MPS control daemon answers at the pipe folder of `env` (default: this process's).
    The control program serves one caller at a time: ask from one process, not from every rank."""
    env = dict(os.environ if env is None else env)
    if not listening(env):
        return False
    try:
        answer = subprocess.run([CONTROL], input="get_server_list\n", env=env, capture_output=True, text=True,
                                timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return answer.returncode == 0


@contextlib.contextmanager
def daemon(env=None):
    """Yield an environment in which CUDA processes are MPS clients: `env` itself if a daemon already
    answers there, else `env` pointing at a private daemon started here and stopped on exit."""
    env = dict(os.environ if env is None else env)
    if running(env):
        yield env
        return
    if shutil.which(CONTROL) is None:
        raise RuntimeError(f"several ranks per GPU need CUDA MPS, and {CONTROL} is not on PATH")
    folder = Path(tempfile.mkdtemp(prefix="moe_ep_mps_"))
    env.update({PIPE_VARIABLE: str(folder / "pipe"), LOG_VARIABLE: str(folder / "log")})
    for name in ("pipe", "log"):
        (folder / name).mkdir()
    try:
        subprocess.run([CONTROL, "-d"], env=env, check=True, timeout=30)
        deadline = time.monotonic() + 15
        while not running(env):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the MPS control daemon did not answer within 15 s (log: {folder / 'log'})")
            time.sleep(0.1)
        yield env
    finally:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run([CONTROL], input="quit\n", env=env, capture_output=True, text=True, timeout=30)
        shutil.rmtree(folder, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description="Run COMMAND with a CUDA MPS daemon up (private unless one answers).")
    parser.add_argument("--ranks-per-gpu", type=int, required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.ranks_per_gpu < 1:
        parser.error("needs --ranks-per-gpu N >= 1 and -- COMMAND")
    try:
        with daemon() as env:
            env.setdefault(SHARE_VARIABLE, str(share_percent(args.ranks_per_gpu)))
            child = subprocess.Popen(command, env=env)
            forward = lambda signum, _frame: child.send_signal(signum)  # noqa: E731  (the job ends, then the daemon)
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(signum, forward)
            return child.wait()
    except (RuntimeError, OSError, subprocess.SubprocessError) as error:   # no MPS here, or no such command
        parser.exit(1, f"{parser.prog}: {error}\n")


if __name__ == "__main__":
    sys.exit(main())
