"""Every tutorial runs through launch.sh on CPU (2 gloo processes, the reference path) and checks itself.

On GPU machines scripts/gpu_suite.sh runs them on the GPUs instead (part `tutorials`).
"""
import os
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = sorted(p.name for p in (ROOT / "tutorials").glob("[0-9][0-9]-*.py"))


def rank_logs(log_dir: Path) -> str:
    """Every rank's whole stdout and stderr, as torchrun kept them under `log_dir` (<run>/attempt_<n>/<rank>/)."""
    return "".join(f"\n--- {path.relative_to(log_dir)} ---\n{path.read_text(errors='replace')}"
                   for path in sorted(log_dir.rglob("std*.log")))


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="GPUs visible: scripts/gpu_suite.sh runs the tutorials")
@pytest.mark.parametrize("name", TUTORIALS)
def test_tutorial_runs_on_cpu(name, tmp_path):
    result = subprocess.run(["bash", str(ROOT / "launch.sh"), "--log-dir", str(tmp_path), f"tutorials/{name}"],
                            capture_output=True, text=True, timeout=600, cwd=ROOT, env=os.environ)
    assert result.returncode == 0, (f"exit code {result.returncode}\n--- launcher ---\n{result.stdout}{result.stderr}"
                                    + rank_logs(tmp_path))
    assert "reference path" in result.stdout          # launch.sh said it fell back to CPU; the tutorial checked itself
    assert "Warning:" not in result.stdout + result.stderr, result.stdout + result.stderr


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="checks the gloo (CPU) path")
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from /proc")
def test_destroy_process_group_stops_gloo_threads(tmp_path):
    """After runtime.init_distributed, torch.distributed.nn imported later (transformers does, when it
    builds a model) does not keep the group alive: gloo's worker threads stop at destroy_process_group,
    so none can be left releasing tensors while Python exits (which aborts the process)."""
    script = tmp_path / "teardown.py"
    script.write_text(
        "import os\n"
        "import torch.distributed as dist\n"
        "from moe_ep import runtime\n"
        "runtime.init_distributed()\n"
        "import torch.distributed.nn\n"
        "dist.destroy_process_group()\n"
        "threads = [open(f'/proc/self/task/{t}/comm').read().strip() for t in os.listdir('/proc/self/task')]\n"
        "assert not any(name.startswith('pt_gloo') for name in threads), threads\n")
    result = subprocess.run(["bash", str(ROOT / "launch.sh"), "--nproc", "1", "--log-dir", str(tmp_path / "logs"),
                             str(script)], capture_output=True, text=True, timeout=300, cwd=ROOT, env=os.environ)
    assert result.returncode == 0, result.stdout + result.stderr + rank_logs(tmp_path / "logs")
