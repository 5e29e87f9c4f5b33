"""launch.sh: argument handling, the CPU fallback, and the environment it leaves alone."""
import os
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


def test_never_sets_multicast_variables():
    text = (ROOT / "launch.sh").read_text()
    assert not any(f"{name}=" in text for name in MULTICAST)
