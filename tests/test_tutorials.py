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
