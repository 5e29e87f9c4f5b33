"""The host-time benchmarks on a CPU: bench_host.py (the fake process group, a few rounds) reports every row, cold
and warm; bench_all_to_all.py --host-only every decode size."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_host_reports_every_row(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_host.py"), "--out", str(tmp_path),
                           "--rounds", "5"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "host.json").read_text())
    rows = report["rows"]
    assert [(r["op"], r["caches"]) for r in rows] == [
        (op, caches) for caches in ("cold", "warm") for op in ("ag_gemm", "gemm_rs", "gemm_ar", "row layer")]
    for row in rows:
        columns = ("inline", "plain", "never") if row["op"] != "row layer" else ("plain", "never")
        assert all(row[c] > 0 for c in columns), row          # each a call's time, the empty call's subtracted
        assert row["never_minus_plain"] == row["never"] - row["plain"], row
        if "inline" in row:
            assert row["never_over_inline"] == row["never"] / row["inline"], row
    assert "| ag_gemm | cold |" in (tmp_path / "host.md").read_text()


def test_all_to_all_host_only_reports_every_size():
    """bench_all_to_all.py --host-only (no GPU): a line per decode size with dispatch's and combine's host time,
    the front alone, through BoundKernel, and through BoundKernel from cold caches, the last the largest."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}       # launches through BoundKernel up to a no-op kernel, not run
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_all_to_all.py"), "--host-only"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line.split() for line in done.stdout.splitlines() if "tokens:" in line]
    assert [line[0] for line in lines] == ["16", "128", "512"], done.stdout
    for line in lines:                  # N tokens: dispatch F / B / C, combine F / B / C
        for at in (3, 9):
            front, bound, cold = float(line[at]), float(line[at + 2]), float(line[at + 4].rstrip(","))
            assert 0 < front < bound < cold, line
