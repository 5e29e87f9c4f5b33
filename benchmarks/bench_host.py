"""Host time of the tensor-parallel host paths with cold caches, on a CPU: what an eager call costs on the GPU hosts.

    python benchmarks/bench_host.py --out OUTDIR [--rounds 300]

The multi-GPU benchmarks time an eager call alone, after a barrier that blocks the host (bench_tp.py,
bench_tp_layers.py), and on the GPU machines its Python then runs as if from cold caches: NCCL's all-gather
and a cuBLAS GEMM at M = 128 took 156-163 us of host time on an H200 host (rank 0 of 2, the GPU kept busy),
where the same calls in a tight loop take a tenth of that. This benchmark makes that regime on a CPU: every
call begins after a sweep of SWEEP_BYTES has evicted the caches (``moe_ep.timing.cold_caches``), and the host
paths run on tiny CPU tensors over a fake process group of 2 ranks (PyTorch's test backend: its collectives
return at once), so the time is the host's alone: Python, torch's dispatcher, the group's calls. The same
calls then run warm, back to back, for comparison. On the development machine (AMD EPYC, 2 cores) the cold
calls take 140-200 us, near the GPU host's figures for the same paths; what costs there is each distinct
piece of code and data a call touches, not the bytecode count a warm loop measures.

Rows (bf16, a [4, 64] @ w [64, 64] as nn.Linear stores it, ag_gemm's shard [2, 64]), us a call, the empty
call's time subtracted, medians over --rounds rounds, the calls of a round in an order of the round's own:
  inline   the op as a model writes it: torch.distributed's collective and `a @ w`
  plain    moe_ep.tp.plain (AsyncTP's "never" path and the TP layers' path without a communicator)
  never    AsyncTP.<op>, overlap="never": plain behind the object's checks and choice of path
  layer    RowParallelLinear without sequence parallelism (decode), on AsyncTP (ours) and without a
           communicator (plain layer)
`never_over_inline` = never / inline, the ratio bench_tp.py's eager `never_speedup` inverts.
"""
import argparse
import json
import os
import statistics
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from moe_ep import AsyncTP
from moe_ep.layers.tp_linear import RowParallelLinear
from moe_ep.timing import SWEEP_BYTES, cold_caches, markdown_table
from moe_ep.tp import plain

ROWS, FEATURES = 4, 64


def times_us(fns: dict, rounds: int, cold: bool) -> dict:
    """Median microseconds of each of `fns` (name -> callable), interleaved round after round in an order drawn
    per round, each call after a sweep of the caches when `cold`; the empty call's median subtracted."""
    fns = {"empty": lambda: None, **fns}
    samples = {name: [] for name in fns}
    for r in range(rounds):
        for name in np.random.default_rng(r).permutation(list(fns)):
            if cold:
                cold_caches()
            start = time.perf_counter()
            fns[name]()
            samples[name].append((time.perf_counter() - start) * 1e6)
    empty = statistics.median(samples.pop("empty"))
    return {name: statistics.median(s) - empty for name, s in samples.items()}


def calls() -> dict:
    """(op, column) -> the call, over the default group (2 ranks, every collective returning at once)."""
    tp = AsyncTP.simulated(2, 2 * ROWS, FEATURES, dtype=torch.bfloat16, overlap="never")[0]
    a = torch.randn(ROWS, FEATURES, dtype=torch.bfloat16)
    w = torch.randn(FEATURES, FEATURES, dtype=torch.bfloat16).t()
    shard = a[:ROWS // 2]

    def inline_ag_gemm():
        rows = torch.empty(ROWS, FEATURES, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(rows, shard)
        return rows @ w

    def inline_gemm_rs():
        out = torch.empty(ROWS // 2, FEATURES, dtype=torch.bfloat16)
        dist.reduce_scatter_tensor(out, a @ w)
        return out

    def inline_gemm_ar():
        out = a @ w
        dist.all_reduce(out)
        return out

    layers = {}
    for name, comm in (("layer_ours", tp), ("layer_plain", None)):
        layers[name] = RowParallelLinear(2 * FEATURES, FEATURES, bias=False, comm=comm, dtype=torch.bfloat16,
                                         sequence_parallel=False)
        torch.nn.init.normal_(layers[name].weight)
    return {("ag_gemm", "inline"): inline_ag_gemm, ("ag_gemm", "plain"): lambda: plain.ag_gemm(shard, w),
            ("ag_gemm", "never"): lambda: tp.ag_gemm(shard, w),
            ("gemm_rs", "inline"): inline_gemm_rs, ("gemm_rs", "plain"): lambda: plain.gemm_rs(a, w),
            ("gemm_rs", "never"): lambda: tp.gemm_rs(a, w),
            ("gemm_ar", "inline"): inline_gemm_ar, ("gemm_ar", "plain"): lambda: plain.gemm_ar(a, w),
            ("gemm_ar", "never"): lambda: tp.gemm_ar(a, w),
            ("row layer", "plain"): lambda: layers["layer_plain"](a),
            ("row layer", "never"): lambda: layers["layer_ours"](a)}


def cpu_name() -> str:
    """The CPU's model name (Linux), or "unknown"."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/out")
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    warnings.simplefilter("ignore", FutureWarning)     # newer torch's renames of the inline column's collectives
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    fns = calls()
    rows = []
    with torch.no_grad():
        for cold in (True, False):
            measured = times_us({f"{op}/{column}": fn for (op, column), fn in fns.items()}, args.rounds, cold)
            for op in dict.fromkeys(op for op, _ in fns):
                row = {"op": op, "caches": "cold" if cold else "warm"}
                row.update({column: measured[f"{op}/{column}"] for o, column in fns if o == op})
                if "inline" in row:
                    row["never_over_inline"] = row["never"] / row["inline"]
                row["never_minus_plain"] = row["never"] - row["plain"]
                rows.append(row)
    meta = {"cpu": cpu_name(), "torch": torch.__version__, "rounds": args.rounds, "sweep_bytes": SWEEP_BYTES}
    with open(os.path.join(args.out, "host.json"), "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=1)
    columns = ["op", "caches", "inline", "plain", "never", "never_minus_plain", "never_over_inline"]
    text = (f"host time a call, us ({meta['cpu']}, torch {meta['torch']}, {args.rounds} rounds)\n\n"
            f"{markdown_table(rows, columns, '.2f')}\n")
    with open(os.path.join(args.out, "host.md"), "w") as f:
        f.write(text)
    print(text)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
