"""EP dispatch/combine latency: moe_ep's NVSHMEM kernels against the reference path on NCCL, in one run.

    bash launch.sh benchmarks/bench_all_to_all.py --out OUTDIR [--sweep]

Model: hidden 7168, 256 experts, top-8 (DeepSeek-V3 shape), FP8 dispatch, bf16 combine.
Settings: decode (128 tokens per rank) and prefill (4096). For each, three timings of ours:
  eager     median of CUDA-event times of single calls, back to back, warm-up excluded
  graph     a CUDA graph of 10 back-to-back calls, replayed; median time / 10 (no launch overhead)
  kernels   mean device time of our kernels per call, from the profiler (send + receive kernel)
and the NCCL path (``backend="reference"``, all_to_all_single with uneven splits) in eager mode.
Bytes over NVLink count FP8 payload and scales (dispatch) or bf16 rows (combine) that leave the GPU.
`--sweep` also times 16 to 4096 tokens per rank and draws latency.png.
Writes results.json and results.md under --out; rank 0 prints the table.
"""
import json
import os

import torch
import torch.distributed as dist

from moe_ep import EPAllToAll, link_copies, random_topk, runtime
from moe_ep.timing import benchmark_args, environment, markdown_table, median_us

HIDDEN, EXPERTS, TOPK, GROUP = 7168, 256, 8, 128


def graph_median(fn, replays: int, per_graph: int = 10) -> float:
    """Median microseconds per call of a CUDA graph holding `per_graph` calls of fn()."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    return median_us(graph.replay, replays, 3) / per_graph


def kernel_time(fn, names, iters: int = 20) -> float:
    """Mean device microseconds per call of the kernels whose names contain one of `names`."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total = 0.0
    for avg in prof.key_averages():
        if any(n in avg.key for n in names):
            total += getattr(avg, "device_time_total", None) or avg.cuda_time_total
    return total / iters


def measure(tokens: int, iters: int, full: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, HIDDEN, generator=g).bfloat16().cuda()
    ids, weights = random_topk(tokens, EXPERTS, TOPK, device="cuda", generator=g)
    ours = EPAllToAll(tokens, HIDDEN, EXPERTS, TOPK, fp8_dispatch=True, fp8_group=GROUP, validate=False)
    nccl = EPAllToAll(tokens, HIDDEN, EXPERTS, TOPK, fp8_dispatch=True, fp8_group=GROUP, validate=False,
                      backend="reference")
    expert_out = torch.randn(ours.experts_per_rank, world * tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    *_, handle = ours.dispatch(x, ids, weights)
    dispatch = lambda: ours.dispatch(x, ids, weights)            # noqa: E731
    combine = lambda: ours.combine(expert_out, handle)            # noqa: E731

    out = {"tokens": tokens}
    dist.barrier()
    out["dispatch_graph_us"] = graph_median(dispatch, iters // 4)
    *_, handle = ours.dispatch(x, ids, weights)                    # the graph's dispatches moved the slots on
    out["combine_graph_us"] = graph_median(combine, iters // 4)
    dist.barrier()
    out["nccl_dispatch_us"] = median_us(lambda: nccl.dispatch(x, ids, weights), iters // 2, 5)
    *_, ref_handle = nccl.dispatch(x, ids, weights)
    out["nccl_combine_us"] = median_us(lambda: nccl.combine(expert_out, ref_handle), iters // 2, 5)
    if full:
        dist.barrier()
        out["dispatch_eager_us"] = median_us(dispatch, iters, 20)
        *_, handle = ours.dispatch(x, ids, weights)
        out["combine_eager_us"] = median_us(combine, iters, 20)
        dist.barrier()
        out["dispatch_kernel_us"] = kernel_time(dispatch, ["dispatch_send", "dispatch_recv"])
        *_, handle = ours.dispatch(x, ids, weights)
        out["combine_kernel_us"] = kernel_time(combine, ["combine_send", "combine_recv"])
    per_rank, per_expert = link_copies(ids, ours.experts_per_rank, rank, world)
    token_bytes = HIDDEN + HIDDEN // GROUP * 4
    out["dispatch_link_MB"] = per_rank * token_bytes / 1e6
    out["dispatch_link_MB_one_copy_per_expert"] = per_expert * token_bytes / 1e6
    out["combine_link_MB"] = per_rank * HIDDEN * 2 / 1e6
    for op in ("dispatch", "combine"):
        best = out.get(f"{op}_kernel_us", out[f"{op}_graph_us"])
        out[f"{op}_link_GBps"] = out[f"{op}_link_MB"] * 1e3 / best
        out[f"{op}_speedup_vs_nccl"] = out[f"nccl_{op}_us"] / out[f"{op}_graph_us"]
    ours.destroy()
    return out


COLUMNS = ["tokens", "dispatch_kernel_us", "dispatch_graph_us", "dispatch_eager_us", "nccl_dispatch_us",
           "dispatch_speedup_vs_nccl", "combine_kernel_us", "combine_graph_us", "combine_eager_us",
           "nccl_combine_us", "combine_speedup_vs_nccl", "dispatch_link_MB", "dispatch_link_MB_one_copy_per_expert",
           "dispatch_link_GBps", "combine_link_GBps"]


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tokens = [r["tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label, style in (("dispatch_graph_us", "moe_ep dispatch", "o-"),
                              ("combine_graph_us", "moe_ep combine", "s-"),
                              ("nccl_dispatch_us", "NCCL dispatch", "o--"), ("nccl_combine_us", "NCCL combine", "s--")):
        ax.plot(tokens, [r[key] for r in rows], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("latency per call (us)")
    ax.set_title(f"EP all-to-all, {dist.get_world_size()}x {torch.cuda.get_device_name()}, H=7168, E=256, top-8, FP8")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    args = benchmark_args(__doc__, iters=100, sweep="also time 16 to 4096 tokens per rank and draw latency.png")
    rank, world = dist.get_rank(), dist.get_world_size()
    meta = {**environment(), "model": {"hidden": HIDDEN, "experts": EXPERTS, "topk": TOPK, "fp8_group": GROUP}}
    results = {"settings": [], "sweep": []}
    plan = [("settings", 128, args.iters, True), ("settings", 4096, args.iters // 2, True)]
    if args.sweep:
        plan += [("sweep", t, args.iters // 2, False) for t in (16, 64, 256, 1024, 4096)]
    for part, tokens, iters, full in plan:        # results are written as they come: a cut run keeps them
        results[part].append(measure(tokens, iters, full))
        torch.cuda.empty_cache()              # the prefill setting's expert rows are large
        if rank == 0:
            print(json.dumps(results[part][-1]), flush=True)
            with open(os.path.join(args.out, "results.json"), "w") as f:
                json.dump({**meta, **results}, f, indent=1)
    if rank == 0:
        text = (f"{world}x {meta['device']}, {meta['date']}, torch {meta['torch']}, triton {meta['triton']}\n\n"
                f"Decode (128 tokens/rank) and prefill (4096), times in us (rank 0):\n\n{markdown_table(results['settings'], COLUMNS)}\n")
        if args.sweep:
            text += f"\nSweep (graph timings):\n\n{markdown_table(results['sweep'], COLUMNS)}\n"
            plot(results["sweep"], os.path.join(args.out, "latency.png"))
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(text)
        print(text)
    runtime.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
