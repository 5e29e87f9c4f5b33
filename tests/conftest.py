"""GPU tests (marked `gpu`) run when at least 2 CUDA GPUs are visible and are skipped otherwise.

Without a GPU, Triton kernels run in the interpreter (TRITON_INTERPRET=1), which has to be
set before any kernel is defined, so here, before the tests import moe_ep.
"""
import os

import pytest
import torch

GPUS = torch.cuda.device_count()
if GPUS == 0:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if GPUS >= 2:
        return
    skip = pytest.mark.skip(reason=f"needs >= 2 CUDA GPUs, {GPUS} visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
