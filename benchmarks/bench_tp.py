"""Async TP: all-gather GEMM and GEMM reduce-scatter against the plain path and PyTorch's fused ops, in one run.

    bash launch.sh benchmarks/bench_tp.py --out OUTDIR

Every shape of SHAPES for each op: about 35-75 s on two H200s with cold compiles (estimated: the
numbers are beside SHAPES).

Shapes (M, K, N), bf16, tp = the number of ranks; weights as nn.Linear stores them (w = weight.t()):
  AG-GEMM  a_shard [M/tp, K] @ w [K, N/tp] -> [M, N/tp]   (column-parallel, sequence-parallel input)
  GEMM-RS  a [M, K/tp] @ w [K/tp, N] -> [M/tp, N]         (row-parallel, sequence-parallel output)
  GEMM-AR  a [M, K/tp] @ w [K/tp, N] -> [M, N]            (row-parallel, all rows: decode, M <= 512 only)
For each, the median of `--iters` CUDA-event times, in us: every column's call timed alone after a
barrier (every rank begins it together), the columns interleaved, round after round one call of each in
an order of the round's own (after WARMUP untimed calls each), so that drift over a row (clocks, NCCL's
state) and whatever a call leaves for the next fall on all alike:
  comm, gemm  the collective alone (NCCL) and the GEMM alone (cuBLAS)
  triton      the fused kernels' GEMM alone (moe_ep.kernels.matmul, their tile shapes): `triton_vs_cublas`
              = gemm / triton; the fused path cannot win where this falls much below 1. `triton_tma`:
              the same with the tile loop on tensor descriptors (AsyncTP's tile_loop="tma"); every
              variant on one GPU: benchmarks/bench_gemm.py. `triton_split`: the tile loop with its partial last
              wave split by K over every program (matmul's "tma_split_tail"; the fused kernels do not split)
  plain       NCCL then cuBLAS (or the reverse; for GEMM-AR cuBLAS then NCCL all-reduce), through
              torch.distributed's calls, as a model would make them: the baseline
  never       moe_ep.AsyncTP, overlap="never": plain's NCCL and cuBLAS through AsyncTP's public method (its
              per-call checks; the collectives as moe_ep.collectives makes them, the group's own methods),
              what `auto` keeps at small shapes: `never_speedup` under 1 is that method's cost
  torch       torch.ops.symm_mem.fused_all_gather_matmul / fused_matmul_reduce_scatter
  fused       moe_ep.AsyncTP, overlap="fused" (the persistent Triton GEMMs), tile_loop="pointer"; fused_tma:
              with tile_loop="tma" (AsyncTP's default, what never and auto run with)
  chunked     moe_ep.AsyncTP, overlap="chunked" (one cuBLAS GEMM per shard, copy-engine transfers; not GEMM-AR)
  auto        moe_ep.AsyncTP, overlap="auto" (what the layers get; `auto_path` names its choice for eager
              calls, which its first call makes by timing the candidate paths, and `auto_graph_path` its
              choice for calls captured into a CUDA graph, made by the same call from replays of graphs of
              them: `auto_first_call_ms` is that call's host time, kernels already compiled, and
              `auto_timed_*_us` and `auto_graph_timed_*_us` the times it chose by)
Every column is also timed back to back: `<x>_burst_us` is the median of GRAPH_CALLS (10) calls made in a row
after a barrier (interleaved as above), per call, as a training step or a model's eager layers make them: there
the host runs ahead of the GPU wherever a call's host time is below its GPU time, which a call timed alone pays
in full before its first kernel runs.
At decode sizes (M <= `--graph-rows`, default 512; 0: none) each column is also timed in a CUDA graph, as
inference engines run decode: `<x>_graph_us` (plain_graph_us, fused_graph_us, ...) is the median of a graph of
GRAPH_CALLS (10) back-to-back calls, captured after the eager warm-up (so auto has chosen its paths: its graph
takes auto_graph_path), its replays timed as the eager calls are (after a barrier, interleaved), over
GRAPH_CALLS: no host time, and the ranks' skew after the barrier shared by 10 calls. A column whose capture
fails on any rank holds the failure, "failed: <type>: <message>" (another rank's with "(rank R)"), and is not
replayed.
Speedups are plain / x; `<x>_burst_speedup` = plain_burst_us / x_burst_us, `<x>_graph_speedup` = plain_graph_us /
x_graph_us. Overlap efficiency =
(plain - best of ours) / min(comm, gemm): 1 is a perfect overlap. The cost model's predictions
(moe_ep.tp.cost.predicted_us) are printed beside.
Each row is printed as it is measured (a line, and '... still on <row>' every 30 s while one takes
longer); tp.json is rewritten as rows come in, tp.md written at the end; rank 0 prints the table.
tp.json's `torch_symm_mem_backend` says which symmetric-memory allocator PyTorch's ops ran on (its
CUDA one where this torch has it).
"""
import time
import warnings

import torch
import torch.distributed as dist

from moe_ep import AsyncTP
from moe_ep.kernels.matmul import DEFAULT_VARIANT, fused_tile_config, matmul
from moe_ep.tp.cost import predicted_us
from moe_ep.timing import (GRAPH_CALLS, Progress, benchmark_args, burst_after_barrier_us, call_after_barrier_us,
                           environment, failure, finish, graph_times, heading, interleaved_median_us, markdown_table,
                           row_line, write_json, write_report)

# prefill (a-d), then decode (M = 128 and 512 tokens). The run's time on two H200s (estimated until measured):
# startup with NVSHMEM, AsyncTP's workspace and PyTorch's symmetric memory 15-25 s; about 20 kernels to
# compile (the fused AG-GEMM, GEMM-RS and GEMM-AR and matmul, pointer and tma, on 128- and 64-row tiles),
# 0.5-2 s each for sm_90: 10-40 s; a row 10 timings of 35 calls, the longest 3-4 ms (b: 1.9 TFLOP a rank at
# ~700 TFLOP/s), so 1-1.5 s for b and under 0.5 s for the decode rows, 14 rows 5-10 s; the 6 rows with CUDA
# graphs (M <= 512) capture about 10 graphs of GRAPH_CALLS calls and replay each 31 times: about 1 s a row. 35-75 s.
SHAPES = [(4096, 8192, 28672), (8192, 8192, 28672), (16384, 8192, 8192), (2048, 4096, 14336),
          (128, 8192, 28672), (512, 8192, 28672)]
WARMUP = 5                  # untimed calls of each column before its row's timed rounds
DECODE_ROWS = 512           # GEMM-AR runs at M <= this: the row-parallel layer without sequence parallelism


def torch_fused_ops():
    """PyTorch's fused ops on the default group ((None, None) where this torch has none), and the
    symmetric-memory allocator they were set up with ("CUDA", or this torch's default where it has
    no CUDA allocator: some builds register only NVSHMEM's)."""
    try:
        from torch.distributed import _symmetric_memory as symm_mem
    except ImportError:
        return (None, None), "none"
    name = dist.group.WORLD.group_name
    backend = "default"
    if hasattr(symm_mem, "set_backend"):    # PyTorch's own allocator where it has one: NVSHMEM is moe_ep's here
        try:
            symm_mem.set_backend("CUDA")
            backend = "CUDA"
        except RuntimeError as e:
            backend = f"default (set_backend('CUDA'): {str(e).splitlines()[0][:80]})"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(name)
    if hasattr(symm_mem, "get_backend"):
        backend += f", get_backend: {symm_mem.get_backend(torch.device('cuda', torch.cuda.current_device()))}"
    ops = torch.ops.symm_mem
    return (lambda a, w: ops.fused_all_gather_matmul(a, [w], 0, name, return_A=False)[1][0],
            lambda a, w: ops.fused_matmul_reduce_scatter(a, w, "sum", 0, name)), backend


def measure(op, shape, tp, fused, iters, graph_rows, progress: Progress):
    world = dist.get_world_size()
    m, k, n = shape
    g = torch.Generator(device="cuda").manual_seed(dist.get_rank())
    if op == "ag_gemm":
        a = torch.randn(m // world, k, device="cuda", generator=g, dtype=torch.bfloat16)
        w = (torch.randn(n // world, k, device="cuda", generator=g, dtype=torch.bfloat16) / k ** 0.5).t()
        gathered = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
        comm = lambda: dist.all_gather_into_tensor(gathered, a)          # noqa: E731
        gemm = lambda: gathered @ w                                        # noqa: E731

        def plain():
            rows = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
            dist.all_gather_into_tensor(rows, a)
            return rows @ w
    elif op == "gemm_ar":
        a = torch.randn(m, k // world, device="cuda", generator=g, dtype=torch.bfloat16)
        w = (torch.randn(n, k // world, device="cuda", generator=g, dtype=torch.bfloat16) / k ** 0.5).t()
        partial = a @ w
        comm = lambda: dist.all_reduce(partial)                           # noqa: E731

        def plain():
            out = a @ w
            dist.all_reduce(out)
            return out
        gemm = lambda: a @ w                                               # noqa: E731
    else:
        a = torch.randn(m, k // world, device="cuda", generator=g, dtype=torch.bfloat16)
        w = (torch.randn(n, k // world, device="cuda", generator=g, dtype=torch.bfloat16) / k ** 0.5).t()
        partial = a @ w
        scattered = torch.empty(m // world, n, device="cuda", dtype=torch.bfloat16)
        comm = lambda: dist.reduce_scatter_tensor(scattered, partial)      # noqa: E731

        def plain():
            out = torch.empty(m // world, n, device="cuda", dtype=torch.bfloat16)
            dist.reduce_scatter_tensor(out, a @ w)
            return out
        gemm = lambda: a @ w                                               # noqa: E731

    def with_overlap(mode, tile_loop=DEFAULT_VARIANT):      # the layers' tile loop, unless a column names one
        def call():
            tp.overlap, tp.tile_loop = mode, tile_loop
            return getattr(tp, op)(a, w)
        return call
    fused_op = {"ag_gemm": fused[0], "gemm_rs": fused[1]}.get(op)
    paths = {"fused": with_overlap("fused", "pointer"), "fused_tma": with_overlap("fused", "tma")}
    if op != "gemm_ar":
        paths["chunked"] = with_overlap("chunked")
    paths["never"] = with_overlap("never")
    row = {"op": op, "M": m, "K": k, "N": n}
    expected = plain().float()
    for path, run in paths.items():
        progress.step(f"{path}, first call")
        try:
            row[f"{path}_max_abs_diff"] = (run().float() - expected).abs().max().item()
        except Exception as e:
            row[f"{path}_max_abs_diff"] = failure(e)
    local_k, local_n = (k, n // world) if op == "ag_gemm" else (k // world, n)
    progress.step("auto, first call")
    torch.cuda.synchronize()
    start = time.perf_counter()
    try:
        with_overlap("auto")()
        torch.cuda.synchronize()
        row["auto_first_call_ms"] = (time.perf_counter() - start) * 1e3
        choice = tp.choices[(op, m, local_k, local_n)]
        row["auto_path"], row["auto_graph_path"] = choice["path"], choice["graph_path"]
        row.update({f"auto_timed_{path}_us": t for path, t in choice["times_us"].items()})
        row.update({f"auto_graph_timed_{path}_us": t for path, t in choice["graph_times_us"].items()})
    except Exception as e:
        row["auto_path"] = failure(e)
    gemm_a = gathered if op == "ag_gemm" else a
    shard_rows, shards = (m, 1) if op == "gemm_ar" else (m // world, world)    # the fused kernels' tiles:
    config = fused_tile_config(shard_rows, w.shape[1], 2, tp._programs, shards)
    if op == "gemm_rs":                                                      # over all rows where it takes them
        config = tp.launches.rs_rows(m, w.shape[1], 2) or config
    triton_gemm = lambda: matmul(gemm_a, w, tp._programs, config)            # noqa: E731
    triton_tma = lambda: matmul(gemm_a, w, tp._programs, config, variant="tma")   # noqa: E731
    triton_split = lambda: matmul(gemm_a, w, tp._programs, config, variant="tma_split_tail")   # noqa: E731
    timings = [("comm_us", comm), ("gemm_us", gemm), ("triton_us", triton_gemm), ("triton_tma_us", triton_tma),
               ("triton_split_us", triton_split),
               ("plain_us", plain), *((f"{path}_us", run) for path, run in paths.items()),
               ("auto_us", with_overlap("auto"))]
    if fused_op is not None:
        timings.append(("torch_us", lambda: fused_op(a, w)))
    timed = []
    for key, fn in timings:
        progress.step(f"{key}, warm-up")
        dist.barrier()
        try:
            for _ in range(WARMUP):
                fn()
            timed.append((key, fn))
        except Exception as e:            # a baseline this torch cannot run is reported, not fatal
            row[key] = failure(e)
    progress.step(f"{iters} rounds of {len(timed)} timed calls")
    medians = interleaved_median_us([fn for _, fn in timed], iters, 0, call_after_barrier_us)
    row.update(zip((key for key, _ in timed), medians))
    progress.step(f"{iters} rounds of {len(timed)} timed bursts of {GRAPH_CALLS} calls")
    bursts = interleaved_median_us([fn for _, fn in timed], iters, 0, burst_after_barrier_us)
    row.update((key.removesuffix("_us") + "_burst_us", t) for (key, _), t in zip(timed, bursts))
    if m <= graph_rows:
        progress.step(f"CUDA graphs of {GRAPH_CALLS} calls: capture, then {iters} rounds of replays")
        row.update(graph_times(timed, iters))
    for path in ("fused", "fused_tma", "chunked", "never", "auto", "torch"):
        for us, speedup in (("_us", "_speedup"), ("_burst_us", "_burst_speedup"), ("_graph_us", "_graph_speedup")):
            if all(isinstance(row.get(key), float) for key in (f"plain{us}", f"{path}{us}")):
                row[f"{path}{speedup}"] = row[f"plain{us}"] / row[f"{path}{us}"]
    for key in ("triton", "triton_tma", "triton_split"):
        if all(isinstance(row.get(k), float) for k in (f"{key}_us", "gemm_us")):
            row[f"{key}_vs_cublas"] = row["gemm_us"] / row[f"{key}_us"]
    ours = [row[key] for key in ("fused_us", "fused_tma_us", "chunked_us") if isinstance(row.get(key), float)]
    if ours and all(isinstance(row[key], float) for key in ("plain_us", "comm_us", "gemm_us")):
        row["overlap_efficiency"] = (row["plain_us"] - min(ours)) / min(row["comm_us"], row["gemm_us"])
    predicted = predicted_us(op, m, local_k, local_n, world)
    row.update({f"predicted_{path}_us": t for path, t in predicted.items()})
    return row


COLUMNS = ["op", "M", "K", "N", "comm_us", "gemm_us", "triton_us", "triton_vs_cublas", "triton_tma_us",
           "triton_tma_vs_cublas", "triton_split_us", "triton_split_vs_cublas", "plain_us", "torch_us", "fused_us",
           "fused_tma_us", "chunked_us", "never_us", "auto_us", "torch_speedup", "fused_speedup", "fused_tma_speedup",
           "chunked_speedup", "never_speedup", "auto_speedup", "overlap_efficiency", "auto_path", "auto_graph_path",
           "plain_burst_us", "torch_burst_us", "fused_burst_us", "fused_tma_burst_us", "chunked_burst_us",
           "never_burst_us", "auto_burst_us", "torch_burst_speedup", "fused_burst_speedup", "fused_tma_burst_speedup",
           "chunked_burst_speedup", "never_burst_speedup", "auto_burst_speedup",
           "comm_graph_us", "gemm_graph_us", "triton_graph_us", "triton_tma_graph_us", "triton_split_graph_us",
           "plain_graph_us", "torch_graph_us", "fused_graph_us", "fused_tma_graph_us", "chunked_graph_us",
           "never_graph_us", "auto_graph_us", "torch_graph_speedup", "fused_graph_speedup", "fused_tma_graph_speedup",
           "chunked_graph_speedup", "never_graph_speedup", "auto_graph_speedup", "auto_first_call_ms",
           "auto_timed_never_us", "auto_timed_fused_us", "auto_timed_chunked_us", "auto_graph_timed_never_us",
           "auto_graph_timed_fused_us", "auto_graph_timed_chunked_us", "predicted_never_us", "predicted_fused_us",
           "predicted_chunked_us", "fused_max_abs_diff", "fused_tma_max_abs_diff", "chunked_max_abs_diff",
           "never_max_abs_diff"]
# a row's line as it is measured
ROW_COLUMNS = ["op", "M", "K", "N", "comm_us", "gemm_us", "triton_us", "triton_tma_us", "triton_split_us", "plain_us",
               "torch_us", "fused_us", "fused_tma_us", "chunked_us", "never_us", "auto_us", "auto_path",
               "overlap_efficiency", "plain_burst_us", "fused_tma_burst_us", "chunked_burst_us", "never_burst_us",
               "auto_burst_us", "plain_graph_us", "torch_graph_us", "fused_graph_us", "fused_tma_graph_us",
               "chunked_graph_us", "never_graph_us", "auto_graph_us", "auto_graph_path"]


def main():
    args = benchmark_args(__doc__, iters=30, numbers={
        "graph-rows": (DECODE_ROWS, "rows with M <= this also get CUDA-graph columns (0: none)")})
    rank = dist.get_rank()
    meta = environment()
    max_rows = max(m for m, _, _ in SHAPES)
    max_features = max(max(k, n) for _, k, n in SHAPES)
    tp = AsyncTP(max_rows, max_features)
    fused, meta["torch_symm_mem_backend"] = torch_fused_ops()
    rows = []
    for op in ("ag_gemm", "gemm_rs", "gemm_ar"):
        for shape in (s for s in SHAPES if op != "gemm_ar" or s[0] <= DECODE_ROWS):
            with Progress(f"{op} M={shape[0]} K={shape[1]} N={shape[2]}") as p:
                rows.append(measure(op, shape, tp, fused, args.iters, args.graph_rows, p))
            write_json(args, "tp.json", {**meta, "rows": rows})
            p.report(row_line(rows[-1], ROW_COLUMNS))
    tp.check()
    if rank == 0:
        text = f"{heading(meta)}, bf16, times in us (rank 0)\n\n{markdown_table(rows, COLUMNS, '.3g')}\n"
        write_report(args, "tp.md", text)
    tp.destroy()
    finish(args)


if __name__ == "__main__":
    main()
