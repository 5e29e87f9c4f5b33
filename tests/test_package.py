"""The package imports and fails clearly where NVSHMEM or GPUs are missing; a script started without a
launcher runs as one process; moe_ep/mps.py without MPS ends with a message."""
import os
import subprocess
import sys
from pathlib import Path

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
    with pytest.raises(ValueError, match="nvshmem backend needs this process's GPU.*use backend='reference'"):
        moe_ep.EPAllToAll(4, 128, 8, 2)
    assert not runtime.is_initialized()
    runtime.finalize()                           # a no-op when NVSHMEM never started



def test_heap_size_parsing(monkeypatch):
    for text, size in (("4G", 4 << 30), ("512m", 512 << 20), ("1073741824", 1 << 30), ("1.5G", 3 << 29)):
        monkeypatch.setenv(runtime.HEAP_VARIABLE, text)
        assert runtime.heap_size() == size
    monkeypatch.delenv(runtime.HEAP_VARIABLE)
    assert runtime.heap_size() == runtime.DEFAULT_HEAP


LAUNCHED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
ONE_PROCESS = """
import torch, torch.distributed as dist
from moe_ep import EPAllToAll, random_topk, runtime
device = runtime.init_distributed()
ep = EPAllToAll(8, 128, 4, 2, fp8_dispatch=False, backend="reference", dtype=torch.float32)
x = torch.randn(5, 128, device=device)
recv_x, _, _, handle = ep.dispatch(x, *random_topk(5, 4, 2, device=device))
torch.testing.assert_close(ep.combine(recv_x, handle), x)
print(dist.get_rank(), dist.get_world_size())
runtime.finalize_distributed()
"""


def test_a_script_started_without_a_launcher_runs_as_one_process():
    """`python script.py`, no torchrun: init_distributed makes a world of one process and says how to start
    more, instead of torch's "environment variable RANK expected"."""
    env = {name: value for name, value in os.environ.items() if name not in LAUNCHED}
    done = subprocess.run([sys.executable, "-c", ONE_PROCESS], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["0", "1"]
    assert "RANK is not set" in done.stderr and "bash launch.sh script.py" in done.stderr


def test_mps_script_without_mps_ends_with_a_message(tmp_path):
    """moe_ep/mps.py where no MPS control program is installed: one line saying so and exit code 1, no
    traceback."""
    env = {**os.environ, "PATH": str(tmp_path)}
    env.pop("CUDA_MPS_PIPE_DIRECTORY", None)
    script = Path(moe_ep.__file__).parent / "mps.py"
    done = subprocess.run([sys.executable, str(script), "--ranks-per-gpu", "2", "--", "true"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr == "mps.py: several ranks per GPU need CUDA MPS, and nvidia-cuda-mps-control is not on PATH\n"
