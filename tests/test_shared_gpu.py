"""Shared-GPU mode's choices, on CPU: device mapping, host backend, SM share, the MPS daemon's life
(with a stand-in for nvidia-cuda-mps-control), and the errors that say what to do."""
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import moe_ep
from moe_ep import mps, runtime, timing

ROOT = Path(__file__).resolve().parents[1]

# A stand-in control program: `-d` starts "the daemon" (the control pipe appears), `get_server_list`
# answers while it is up, `quit` stops it; every call is logged beside the pipe folder.
FAKE_CONTROL = """#!/usr/bin/env bash
pipe="${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}"
if [[ "${1:-}" == "-d" ]]; then echo "start $pipe" >> "$MPS_CALLS"; touch "$pipe/control"; exit 0; fi
read -r command
echo "$command $pipe" >> "$MPS_CALLS"
[[ -e "$pipe/control" ]] || exit 1
if [[ "$command" == quit ]]; then rm "$pipe/control"; fi
exit 0
"""


@pytest.fixture
def fake_control(tmp_path, monkeypatch):
    """nvidia-cuda-mps-control on PATH is the stand-in; returns the file its calls are logged to."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    program = bin_dir / mps.CONTROL
    program.write_text(FAKE_CONTROL)
    program.chmod(0o755)
    calls = tmp_path / "calls.txt"
    calls.touch()
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("MPS_CALLS", str(calls))
    monkeypatch.setenv(mps.PIPE_VARIABLE, str(tmp_path / "no-daemon-here"))
    return calls


@pytest.fixture
def one_gpu(monkeypatch):
    """torch sees one GPU of 132 SMs; set_device and init_process_group are recorded, not run; torchrun's RANK
    is set."""
    record = {}
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: record.update(device=device))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **options: record.update(backend=backend, **options))
    monkeypatch.delenv(mps.SHARE_VARIABLE, raising=False)
    return record


@pytest.mark.parametrize("ranks,gpus,per_gpu", [(2, 1, 2), (4, 1, 4), (8, 1, 8), (4, 2, 2), (3, 2, 2), (2, 2, 1),
                                                (8, 8, 1), (2, 0, 1)])
def test_ranks_per_gpu(ranks, gpus, per_gpu):
    assert mps.ranks_per_gpu(ranks, gpus) == per_gpu


@pytest.mark.parametrize("local_rank,local_world,backend,device,share", [
    (0, 1, "nccl", 0, None), (1, 4, "gloo", 0, "25"), (3, 4, "gloo", 0, "25"), (1, 2, "gloo", 0, "50")])
def test_init_distributed_picks_device_and_backend(one_gpu, monkeypatch, local_rank, local_world, backend, device,
                                                   share):
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    assert runtime.init_distributed() == torch.device("cuda", device)
    assert one_gpu["backend"] == backend and one_gpu["device"] == torch.device("cuda", device)
    assert ("device_id" in one_gpu) == (backend == "nccl")   # NCCL binds the GPU; gloo can't take ranks that share one
    assert os.environ.get(mps.SHARE_VARIABLE) == share


def test_init_distributed_maps_ranks_round_robin(one_gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    for local_rank, gpu in ((0, 0), (1, 1), (2, 0), (3, 1)):
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        assert runtime.init_distributed() == torch.device("cuda", gpu)
        assert one_gpu["backend"] == "gloo"
    assert os.environ[mps.SHARE_VARIABLE] == "50"


def test_usable_sms_is_the_share(one_gpu, monkeypatch):
    for local_world, sms in ((1, 132), (2, 66), (4, 33), (8, 16)):     # no MPS share given: a part of the count
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
        assert runtime.usable_sms() == sms
    monkeypatch.setenv(mps.SHARE_VARIABLE, "12")               # given: the device reports the share (seen on an H200)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(multi_processor_count=16))
    assert runtime.usable_sms() == 16


def test_running_asks_the_daemon(fake_control, tmp_path, monkeypatch):
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    monkeypatch.setenv(mps.PIPE_VARIABLE, str(pipe))
    assert not mps.running() and not mps.listening()          # no control pipe
    (pipe / "control").touch()
    assert mps.running() and mps.listening()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))          # no control program at all
    assert not mps.running()


def test_private_daemon_starts_and_always_stops(fake_control):
    with pytest.raises(KeyError):
        with mps.daemon() as env:
            folder = Path(env[mps.PIPE_VARIABLE]).parent
            assert mps.running(env) and not mps.running()      # this process's own environment is left alone
            raise KeyError("the job failed")
    assert not folder.exists()
    pipe = folder / "pipe"
    assert fake_control.read_text().splitlines() == [f"start {pipe}", f"get_server_list {pipe}",
                                                     f"get_server_list {pipe}", f"quit {pipe}"]


def test_running_daemon_is_reused(fake_control, tmp_path, monkeypatch):
    pipe = tmp_path / "theirs"
    pipe.mkdir()
    (pipe / "control").touch()
    monkeypatch.setenv(mps.PIPE_VARIABLE, str(pipe))
    with mps.daemon() as env:
        assert env[mps.PIPE_VARIABLE] == str(pipe)
    assert (pipe / "control").exists()                         # not ours to stop
    assert "start" not in fake_control.read_text() and "quit" not in fake_control.read_text()


def test_wrapper_runs_the_command_with_its_share(fake_control, tmp_path):
    seen = tmp_path / "seen.txt"
    code = (f"import os, pathlib; pathlib.Path({str(seen)!r}).write_text("
            f"os.environ[{mps.SHARE_VARIABLE!r}] + ' ' + os.environ[{mps.PIPE_VARIABLE!r}]); raise SystemExit(3)")
    result = subprocess.run([sys.executable, str(ROOT / "moe_ep" / "mps.py"), "--ranks-per-gpu", "4", "--",
                             sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 3, result.stderr                # the command's own exit code
    share, pipe = seen.read_text().split()
    assert share == "25" and pipe.startswith(tempfile.gettempdir())
    assert fake_control.read_text().splitlines()[-1] == f"quit {pipe}" and not Path(pipe).exists()


@pytest.fixture
def gloo_world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_nvshmem_without_mps_says_how_to_start_it(gloo_world_of_one, fake_control, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(runtime.NvshmemUnavailable, match=r"2 ranks share each GPU .* no MPS control daemon listens .*"
                                                         r"launch.sh --nproc N"):
        runtime.init()
    with pytest.raises(runtime.NvshmemUnavailable, match="no MPS control daemon listens"):
        moe_ep.EPAllToAll(4, 128, 8, 2)
    assert not runtime.is_initialized()


def test_benchmarks_refuse_shared_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(sys, "argv", ["bench_x.py"])
    with pytest.raises(SystemExit, match="bench_x.py refuses shared-GPU mode: 4 ranks share each GPU"):
        timing.benchmark_args("doc", iters=1)
