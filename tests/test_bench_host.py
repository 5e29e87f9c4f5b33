"""benchmarks/bench_host.py runs on a CPU (the fake process group, a few rounds) and reports every row, cold and warm."""
import json
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
