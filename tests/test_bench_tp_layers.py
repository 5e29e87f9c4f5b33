"""benchmarks/bench_tp_layers.py's rows on gloo at world 2: the layers without a communicator against the same
layers on AsyncTP's reference backend, fp32 on the CPU, the eager calls timed by the host's clock (the benchmark
itself refuses the CPU and times CUDA events)."""
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from distributed import run
from moe_ep import AsyncTP
from moe_ep.timing import Progress

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_tp_layers as bench  # noqa: E402

HIDDEN, INTERMEDIATE = 32, 64         # LlamaConfig wants hidden a multiple of its 32 heads
FIELDS = {"path", "max_abs_diff", "agree", "plain_us", "ours_us", "speedup"}


def host_us(fn) -> float:
    """Microseconds of one call of fn() on the host's clock, begun after a barrier."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def row(plain, ours, x) -> dict:
    with Progress("a tiny row") as p:
        return bench.measure(plain, ours, x, iters=3, graphs=False, progress=p, time_us=host_us)


def _rows(rank, world):
    comm = AsyncTP(max_rows=4 * world, max_features=HIDDEN, dtype=torch.float32, backend="reference")
    layers = bench.layer_pairs(HIDDEN, INTERMEDIATE, comm)
    assert list(layers) == ["column", "row", "mlp"]
    for m in (1, 3):
        for name, (plain, ours) in layers.items():
            x = bench.layer_input(ours, m)
            assert x.shape == (m, INTERMEDIATE // world if name == "row" else HIDDEN), (name, x.shape)
            got = row(plain, ours, x)
            assert set(got) == FIELDS, got
            assert got["path"] == ("none" if name == "column" else "reference"), got
            assert got["agree"] is True and got["max_abs_diff"] <= 1e-6, got   # fp32, two ranks: the same sums
            assert got["plain_us"] > 0 and got["ours_us"] > 0, got
            assert got["speedup"] == got["plain_us"] / got["ours_us"], got

    plain, ours = layers["column"]             # no communication: rank 1's output alone differs
    if rank == 1:
        with torch.no_grad():
            plain.weight.mul_(1.5)
    got = row(plain, ours, bench.layer_input(ours, 2))
    assert got["agree"] is False and got["max_abs_diff"] > 0.1, f"rank 1's mismatch is every rank's: {got}"

    def refused(x):
        if rank == 1:
            raise ValueError("too many rows\nand more")
        return ours(x)
    got = row(plain, refused, bench.layer_input(ours, 2))
    assert set(got) == {"plain_us", "ours_us"} and got["plain_us"] > 0, got
    assert got["ours_us"] == "failed: ValueError: too many rows (rank 1)", got


def test_rows_on_gloo():
    run(_rows, 2)
