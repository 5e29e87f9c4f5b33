"""EPMoE forward: NVSHMEM backend against the NCCL reference backend, split into dispatch / experts / combine.

    bash launch.sh benchmarks/bench_moe_layer.py --out OUTDIR

Layer: hidden 7168, intermediate 2048, 256 experts, top-8, bf16 weights, FP8 dispatch, at 128 and
4096 tokens per rank. Also the masked grouped GEMM alone: TFLOP/s over the counted rows, against a
per-expert torch matmul loop on the same rows. Medians of CUDA-event times; writes moe_layer.json.
"""
import json
import os

import torch
import torch.distributed as dist

from moe_ep import EPMoE, random_topk, runtime
from moe_ep.kernels.grouped_gemm import grouped_gemm
from moe_ep.timing import benchmark_args, environment, median_us

HIDDEN, INTERMEDIATE, EXPERTS, TOPK = 7168, 2048, 256, 8


def layer_times(backend: str, tokens: int, iters: int) -> dict:
    rank = dist.get_rank()
    layer = EPMoE(HIDDEN, INTERMEDIATE, EXPERTS, TOPK, max_tokens=tokens, backend=backend, device="cuda")
    torch.nn.init.normal_(layer.gate_up_proj, std=HIDDEN ** -0.5)
    torch.nn.init.normal_(layer.down_proj, std=INTERMEDIATE ** -0.5)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, HIDDEN, generator=g).bfloat16().cuda()
    ids, weights = random_topk(tokens, EXPERTS, TOPK, device="cuda", generator=g)
    ep = layer._ep()
    with torch.no_grad():
        recv_x, recv_scales, recv_count, handle = ep.dispatch(x, ids, weights)
        out = layer.run_experts(recv_x, recv_scales, recv_count)
        times = {"dispatch_us": median_us(lambda: ep.dispatch(x, ids, weights), iters, 5)}
        recv_x, recv_scales, recv_count, handle = ep.dispatch(x, ids, weights)
        times["experts_us"] = median_us(lambda: layer.run_experts(recv_x, recv_scales, recv_count), iters, 3)
        times["combine_us"] = median_us(lambda: ep.combine(out, handle), iters, 5)
        times["forward_us"] = median_us(lambda: layer(x, ids, weights), iters, 3)
    if backend == "nvshmem":
        ep.destroy()
    return times


def grouped_gemm_times(tokens: int, iters: int) -> dict:
    """gate_up GEMM over a dispatch-like layout: TFLOP/s of our kernel and of a torch loop over experts."""
    world = dist.get_world_size()
    local, rows = EXPERTS // world, world * tokens
    counts = torch.full((local,), tokens * world * TOPK // EXPERTS, dtype=torch.int32, device="cuda")
    a = torch.randn(local, rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(local, 2 * INTERMEDIATE, HIDDEN, device="cuda", dtype=torch.bfloat16) * HIDDEN ** -0.5
    n = counts.tolist()
    flops = 2 * sum(n) * HIDDEN * 2 * INTERMEDIATE
    ours = median_us(lambda: grouped_gemm(a, w, counts), iters, 3)
    loop = median_us(lambda: [a[e, :n[e]] @ w[e].t() for e in range(local)], iters, 3)
    return {"rows_per_expert": n[0], "grouped_gemm_us": ours, "grouped_gemm_TFLOPs": flops / ours / 1e6,
            "torch_loop_us": loop, "torch_loop_TFLOPs": flops / loop / 1e6}


def main():
    args = benchmark_args(__doc__, iters=30)
    rank = dist.get_rank()
    results = {**environment(), "rows": []}
    for tokens in (128, 4096):
        row = {"tokens": tokens, "grouped_gemm": grouped_gemm_times(tokens, args.iters)}
        for backend in ("nvshmem", "reference"):
            row[backend] = layer_times(backend, tokens, args.iters)
        results["rows"].append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
            with open(os.path.join(args.out, "moe_layer.json"), "w") as f:
                json.dump(results, f, indent=1)
    runtime.finalize()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
