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


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="GPUs visible: scripts/gpu_suite.sh runs the tutorials")
@pytest.mark.parametrize("name", TUTORIALS)
def test_tutorial_runs_on_cpu(name):
    result = subprocess.run(["bash", str(ROOT / "launch.sh"), f"tutorials/{name}"], capture_output=True, text=True,
                            timeout=300, cwd=ROOT, env=os.environ)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "reference path" in result.stdout          # launch.sh said it fell back to CPU; the tutorial checked itself
