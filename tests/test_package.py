"""The package imports and fails clearly where NVSHMEM or GPUs are missing."""
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import moe_ep
from moe_ep import runtime


def test_import_without_nvshmem():
    code = "import sys; sys.modules['nvshmem'] = None; import moe_ep; print(moe_ep.__version__, len(moe_ep.__all__))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == [moe_ep.__version__, str(len(moe_ep.__all__))]


def test_missing_nvshmem_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvshmem", None)
    monkeypatch.setitem(sys.modules, "nvshmem.core", None)
    with pytest.raises(runtime.NvshmemUnavailable, match="nvshmem4py"):
        runtime.device_library()


def test_init_needs_torch_distributed():
    with pytest.raises(RuntimeError, match="torch.distributed"):
        runtime.init()


def test_symmetric_memory_needs_init():
    with pytest.raises(RuntimeError, match="init"):
        runtime.symmetric_empty((4,), torch.float32)


@pytest.fixture
def gloo_world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_nvshmem_needs_a_gpu(gloo_world_of_one):
    with pytest.raises(runtime.NvshmemUnavailable, match="GPU"):
        runtime.init()
    with pytest.raises(runtime.NvshmemUnavailable, match="reference"):
        moe_ep.EPAllToAll(4, 128, 8, 2)
    assert not runtime.is_initialized()
    runtime.finalize()                           # a no-op when NVSHMEM never started



def test_heap_size_parsing(monkeypatch):
    for text, size in (("4G", 4 << 30), ("512m", 512 << 20), ("1073741824", 1 << 30), ("1.5G", 3 << 29)):
        monkeypatch.setenv(runtime.HEAP_VARIABLE, text)
        assert runtime.heap_size() == size
    monkeypatch.delenv(runtime.HEAP_VARIABLE)
    assert runtime.heap_size() == runtime.DEFAULT_HEAP
