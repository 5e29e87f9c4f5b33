"""Measuring on the GPU, for the benchmarks and tutorials: medians of CUDA-event times (warm-up
excluded), the options and setup every benchmark shares, where it ran, and its table."""
import argparse
import datetime
import os
import statistics
import sys

import torch
import torch.distributed as dist
import triton

from . import runtime


def median_us(fn, iters: int = 50, warmup: int = 5, before=None) -> float:
    """Median microseconds of fn(), each call timed alone with CUDA events after `warmup` calls;
    `before()`, if given, runs ahead of each timed call, outside the timing (a barrier, say)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def benchmark_args(doc: str, iters: int, **flags: str) -> argparse.Namespace:
    """Parse --out DIR and --iters N (default `iters`) and the boolean `flags` (name -> help), make
    --out, and start torch.distributed with one GPU per process; exit when no GPU is visible or when
    ranks share a GPU."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/out")
    parser.add_argument("--iters", type=int, default=iters)
    for name, text in flags.items():
        parser.add_argument(f"--{name}", action="store_true", help=text)
    args = parser.parse_args()
    name = os.path.basename(sys.argv[0])
    if not torch.cuda.is_available():
        raise SystemExit(f"{name} needs GPUs")
    skipped = why_untimed(torch.device("cuda"))
    if skipped is not None:
        raise SystemExit(f"{name} refuses shared-GPU mode: {skipped}; run one rank per GPU")
    runtime.init_distributed()
    os.makedirs(args.out, exist_ok=True)
    return args


def why_untimed(device: torch.device) -> str | None:
    """Why timings taken on `device` in this job would mislead, or None when they would not."""
    if device.type != "cuda":
        return "gloo on CPU says nothing about GPU speed"
    per_gpu = runtime.ranks_per_gpu()
    if per_gpu > 1:
        return f"{per_gpu} ranks share each GPU, so times say nothing about NVLink or one GPU's speed"
    return None


def environment() -> dict:
    """Where a benchmark ran: device, world size, date, torch and triton versions."""
    return {"device": torch.cuda.get_device_name(), "world": dist.get_world_size(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": torch.__version__, "triton": triton.__version__}


def markdown_table(rows: list[dict], cols: list[str], fmt: str = ".1f") -> str:
    """A markdown table of `cols` of every row; floats as `fmt`, missing entries as '-'."""
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        lines.append("| " + " | ".join(format(row[c], fmt) if isinstance(row.get(c), float) else str(row.get(c, "-"))
                                       for c in cols) + " |")
    return "\n".join(lines)
