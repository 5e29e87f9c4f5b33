"""GPU tests (marked `gpu`) run when at least 2 CUDA GPUs are visible, or on one GPU in shared-GPU mode
(their ranks share it under CUDA MPS: a daemon already running, or a private one started here for the
session and stopped at its end); they are skipped otherwise.

Without a GPU, Triton kernels run in the interpreter (TRITON_INTERPRET=1), which has to be
set before any kernel is defined, so here, before the tests import moe_ep.
"""
import contextlib
import os
import shutil

import pytest
import torch

GPUS = torch.cuda.device_count()       # counted without starting CUDA: this process can still become an MPS client
if GPUS == 0:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moe_ep import mps  # noqa: E402  (after TRITON_INTERPRET)

_session = contextlib.ExitStack()
_gpu_tests_run = GPUS >= 2


def pytest_configure(config):
    global _gpu_tests_run
    if GPUS == 1 and shutil.which(mps.CONTROL):
        if not mps.running():
            env = _session.enter_context(mps.daemon())
            os.environ.update({name: env[name] for name in (mps.PIPE_VARIABLE, mps.LOG_VARIABLE)})
        _gpu_tests_run = True


def pytest_unconfigure(config):
    _session.close()


def pytest_collection_modifyitems(config, items):
    if _gpu_tests_run:
        return
    reason = (f"needs >= 2 CUDA GPUs, {GPUS} visible" if GPUS == 0 else
              f"one GPU visible and no CUDA MPS daemon to share it ({mps.CONTROL} missing or not answering)")
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
