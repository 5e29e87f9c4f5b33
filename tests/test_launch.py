"""launch.sh: argument handling, the CPU fallback, and the environment it leaves alone."""
import os
import socket
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
MULTICAST = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def launch(*args, env=None, timeout=300):
    return subprocess.run(["bash", str(ROOT / "launch.sh"), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, cwd=ROOT)


@pytest.mark.parametrize("args,message", [
    ((), "no script given"),
    (("missing.py",), "no such script"),
    (("--nproc", "0", "launch.sh"), "positive integer"),
    (("--nproc", "two", "launch.sh"), "positive integer"),
    (("--heap", "lots", "launch.sh"), "--heap"),
    (("--bogus", "launch.sh"), "unknown option"),
    (("--log-dir",), "--log-dir needs a value"),
    (("--nnodes", "2", "launch.sh"), "--node-rank in 0..1"),
    (("--nnodes", "2", "--node-rank", "2", "--rdzv", "node0:29500", "launch.sh"), "--node-rank in 0..1"),
    (("--nnodes", "2", "--node-rank", "1", "launch.sh"), "--rdzv HOST:PORT"),
    (("--nnodes", "2", "--node-rank", "1", "--rdzv", "node0", "launch.sh"), "--rdzv HOST:PORT"),
    (("--rdzv", "node0:29500", "launch.sh"), "go with --nnodes"),
])
def test_bad_arguments(args, message):
    result = launch(*args)
    assert result.returncode == 2
    assert message in result.stderr and "usage:" in result.stderr


def test_help():
    result = launch("--help")
    assert result.returncode == 0 and "usage:" in result.stdout


def test_runs_every_rank_and_passes_multicast_settings_through(tmp_path):
    script = tmp_path / "probe.py"
    keys = sorted(MULTICAST) + ["NVSHMEM_SYMMETRIC_SIZE"]
    # One file per rank: two processes printing to one pipe may interleave their lines.
    script.write_text(
        "import os, pathlib, sys\n"
        "words = ['rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'],\n"
        f"         *(str(os.environ.get(k)) for k in {keys!r})]\n"
        "(pathlib.Path(sys.argv[1]) / f\"rank{os.environ['RANK']}.txt\").write_text(' '.join(words))\n"
        "print(' '.join(words))\n")
    result = launch("--nproc", 2, "--heap", "1G", "--log-dir", tmp_path / "logs", script, tmp_path, env=MULTICAST)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = sorted(path.read_text() for path in tmp_path.glob("rank*.txt"))
    values = [MULTICAST[k] for k in sorted(MULTICAST)] + ["1G"]
    assert lines == [f"rank {r} of 2 " + " ".join(values) for r in range(2)]
    logged = sorted(path.read_text().strip() for path in (tmp_path / "logs").rglob("stdout.log"))
    assert logged == lines                               # --log-dir kept each rank's own output
    if torch.cuda.device_count() == 0:
        assert "no GPU visible, running 2 CPU processes on gloo (reference path)" in result.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_meet_at_node_zero(tmp_path):
    """Two launches on this machine stand for two nodes: each starts one process, they meet at node 0's
    rendezvous, ranks come out node-major, an all-reduce spans both, and NVSHMEM's remote transport is left
    to the environment."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import os, pathlib, sys, torch, torch.distributed as dist\n"
        "from moe_ep import runtime\n"
        "device = runtime.init_distributed()\n"
        "total = torch.tensor([dist.get_rank() + 1.0], device=device)\n"
        "dist.all_reduce(total)\n"
        "words = [os.environ['RANK'], os.environ['WORLD_SIZE'], str(int(total.item())),\n"
        "         str(os.environ.get('NVSHMEM_REMOTE_TRANSPORT'))]\n"
        "(pathlib.Path(sys.argv[1]) / f\"rank{os.environ['RANK']}.txt\").write_text(' '.join(words))\n"
        "runtime.finalize_distributed()\n")
    env = {k: v for k, v in os.environ.items() if k != "NVSHMEM_REMOTE_TRANSPORT"}
    node = ["bash", str(ROOT / "launch.sh"), "--nproc", "1", "--nnodes", "2", "--rdzv", f"127.0.0.1:{free_port()}"]
    nodes = [subprocess.Popen([*node, "--node-rank", str(r), str(script), str(tmp_path)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (1, 0)]
    outputs = [p.communicate(timeout=240)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(outputs)
    assert sorted(path.read_text() for path in tmp_path.glob("rank*.txt")) == ["0 2 3 None", "1 2 3 None"]


def test_never_sets_multicast_variables():
    text = (ROOT / "launch.sh").read_text()
    assert not any(f"{name}=" in text for name in MULTICAST)
