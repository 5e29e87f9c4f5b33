"""EPMoE forward and its grouped GEMM, each against its baselines in the same run.

    bash launch.sh benchmarks/bench_moe_layer.py --out OUTDIR [--tokens N,N,...] [--full]

The default run times the layer at --tokens (128 and 2048 tokens per rank), 26 s on one H200 with a
warm compile cache (--tokens 128: 29 s warm, 42 s cold; each with the launch); --full adds the
grouped GEMM alone (bench_gemm.py --grouped times its candidates against torch's).

Layer: Qwen3-30B-A3B's MoE block (hidden 2048, expert intermediate 768, 128 experts, top-8, bf16),
split into dispatch / experts (launched) / combine; the forward eager (forward_us: replayed from the
layer's own CUDA graph of the forward, EPMoE's replay, up to the all-to-all's one_launch_tokens tokens, and
above them as the next column; forward_experts_replayed_us: dispatch and combine launched, the experts replayed
from their own graph; forward_launched_us: everything launched; the three interleaved; at the default
max_tokens the experts' buffers pass graphs.MAX_BYTES and all three launch) and the whole forward replayed
from the caller's CUDA graph (experts_floor_us: the weights of this rank's experts that received rows, read
once, and the flops of the rows this rank received, each at the datasheet peak, timing.floor_us): the
NVSHMEM backend with max_tokens = tokens and with EPMoE's default max_tokens (the cost of capacity that is
not used), FP8 and bf16 dispatch, FP8 experts; the reference backend (NCCL); and the transformers
block itself, all 128 experts on one GPU.

Grouped GEMM alone (--full; the gate_up GEMM: DeepSeek-V3 and Qwen3-30B-A3B shapes, decode and prefill
rows per expert): ours masked by counts on the device (bf16, FP8 rows into bf16 dots, FP8 rows and
128x128-block FP8 weights on FP8 dots), torch._grouped_mm,
torch._scaled_grouped_mm where this torch has it (FP8 rows and weights, row-wise scales), and a
per-expert torch loop. TFLOP/s over the counted rows; GB/s over the least
bytes the GEMM must move (rows in, each used expert's weights once, rows out).

Medians of CUDA-event times, each call (and each graph replay) begun after a barrier of the ranks
(timing.call_after_barrier_us): a call's time holds the skew a barrier leaves, not what the ranks' previous
calls left (timed back to back, an eager forward after a launched one waited on its peers' longer host time).
Each row is printed as it is measured (a line, and '... still on <row>' every 30 s while one takes longer);
moe_layer.json is rewritten as rows come in; a baseline that fails is recorded with its error.
"""
import functools
import inspect

import torch
import torch.distributed as dist

from moe_ep import EPMoE, quantize_fp8, random_topk
from moe_ep.kernels.grouped_gemm import grouped_gemm
from moe_ep.kernels.quant import quantize_weights_fp8
from moe_ep.timing import (Progress, benchmark_args, call_after_barrier_us, environment, finish, floor_us,
                           interleaved_median_us, markdown_table, median_us, row_line, write_json)

QWEN3 = dict(hidden=2048, intermediate=768, experts=128, topk=8)
DEEPSEEK = dict(hidden=7168, intermediate=2048, experts=256, topk=8)
# The default run: 26 s on one H200 with a warm cache, 16 s of it measuring (a layer row 1-2 s: 5 timings
# of 25 calls, a graph captured; the transformers block a few s). A cold cache adds about 25 kernels'
# compiles: the EP kernels, the grouped GEMMs on decode and prefill tiles, the quantizers.
LAYER_TOKENS = (128, 2048)
GEMM_CASES = [("deepseek_v3", DEEPSEEK, 8), ("deepseek_v3", DEEPSEEK, 256),
              ("qwen3_30b_a3b", QWEN3, 32), ("qwen3_30b_a3b", QWEN3, 512)]
DEFAULT_MAX_TOKENS = inspect.signature(EPMoE).parameters["max_tokens"].default


def attempt(fn) -> dict:
    """fn() or {"error": ...}: one failing baseline must not cost the others."""
    try:
        return fn()
    except Exception as error:                       # recorded, not hidden: it lands in the JSON
        return {"error": f"{type(error).__name__}: {error}"[:400]}


# ---------------------------------------------------------------------------------------------- layer

def layer_times(tokens: int, backend: str, max_tokens: int, fp8: bool, fp8_experts: bool, iters: int,
                progress: Progress) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    s = QWEN3
    layer = EPMoE(s["hidden"], s["intermediate"], s["experts"], s["topk"], max_tokens=max_tokens, backend=backend,
                  fp8_dispatch=fp8, fp8_experts=fp8_experts, device="cuda")
    torch.nn.init.normal_(layer.gate_up_proj, std=s["hidden"] ** -0.5)
    torch.nn.init.normal_(layer.down_proj, std=s["intermediate"] ** -0.5)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, s["hidden"], generator=g).bfloat16().cuda()
    ids, weights = random_topk(tokens, s["experts"], s["topk"], device="cuda", generator=g)
    hint = tokens * world * s["topk"] / s["experts"]
    ep = layer._ep()
    try:
        with torch.no_grad():
            progress.step("dispatch")
            times = {"dispatch_us": median_us(lambda: ep.dispatch(x, ids, weights), iters, 5, dist.barrier)}
            recv_x, recv_scales, recv_count, handle = ep.dispatch(x, ids, weights)
            times.update(experts_floor(recv_count, fp8_experts))
            progress.step("experts")
            out = layer.run_experts(recv_x, recv_scales, recv_count, hint)
            times["experts_us"] = median_us(lambda: layer.run_experts(recv_x, recv_scales, recv_count, hint), iters, 3,
                                            dist.barrier)
            progress.step("combine")
            times["combine_us"] = median_us(lambda: ep.combine(out, handle), iters, 5, dist.barrier)
            if fp8_experts:           # what FP8 weights cost: relative error of the counted rows against bf16 experts
                exact = layer.run_experts(recv_x, recv_scales, recv_count, hint, fp8_experts=False)
                counted = torch.arange(exact.shape[1], device="cuda")[None, :] < recv_count[:, None]
                times["fp8_experts_rel_error"] = ((out - exact)[counted].float().norm()
                                                  / exact[counted].float().norm()).item()
            progress.step("forward")
            for _ in range(4):                   # each of the all-to-all's two slots: a launch, then a capture
                layer(x, ids, weights)

            def forward(replay: bool):           # eager, the forward replayed or launched (EPMoE's replay)
                layer.replay = replay
                return layer(x, ids, weights)

            def experts_replayed():              # fp8_experts given: never replayed whole, its experts replayed
                return layer._forward(x, ids, weights, ep, fp8_experts=fp8_experts)
            try:
                times["forward_us"], times["forward_experts_replayed_us"], times["forward_launched_us"] = \
                    interleaved_median_us([functools.partial(forward, True), experts_replayed,
                                           functools.partial(forward, False)], iters, 1, call_after_barrier_us)
            finally:
                layer.replay = True
            if backend == "nvshmem":
                progress.step("CUDA graph")
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    layer(x, ids, weights)
                times["graph_us"] = median_us(graph.replay, iters, 3, dist.barrier)
    finally:
        if backend == "nvshmem":
            ep.destroy()
    return times


def experts_floor(recv_count: torch.Tensor, fp8_experts: bool) -> dict:
    """The floor of this rank's experts (timing.floor_us) from the rows it received: their flops (gate_up
    and down, 2 * 3 * H * I a row) and the weights of each local expert that got a row, read once."""
    s = QWEN3
    rows, used = int(recv_count.sum()), int((recv_count > 0).sum())
    weight_bytes = used * 3 * s["hidden"] * s["intermediate"] * (1 if fp8_experts else 2)
    return {"expert_rows": rows, "experts_floor_us": floor_us(2 * 3 * rows * s["hidden"] * s["intermediate"],
                                                              weight_bytes, "fp8" if fp8_experts else "bf16")}


def transformers_block_times(tokens: int, iters: int) -> dict:
    """The model's own block with all experts on this GPU (what every rank runs before the swap)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    s = QWEN3
    config = Qwen3MoeConfig(hidden_size=s["hidden"], moe_intermediate_size=s["intermediate"], num_experts=s["experts"],
                            num_experts_per_tok=s["topk"], norm_topk_prob=True)
    block = Qwen3MoeSparseMoeBlock(config).to("cuda", torch.bfloat16)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(1, tokens, s["hidden"], device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        return {"forward_us": median_us(lambda: block(x), iters, 3),
                "experts_implementation": str(getattr(config, "_experts_implementation", None))}


def layer_configs(tokens: int) -> list[tuple]:
    """(backend, max_tokens, fp8_dispatch, fp8_experts) of every layer row at `tokens` tokens per rank."""
    return [("nvshmem", tokens, True, False), ("nvshmem", tokens, False, False),
            ("nvshmem", DEFAULT_MAX_TOKENS, True, False), ("nvshmem", tokens, True, True),
            ("reference", tokens, True, False)]


# ---------------------------------------------------------------------------------------------- grouped GEMM

def gemm_rows(name: str, shape: dict, rows: int, iters: int, progress: Progress) -> list[dict]:
    """The gate_up GEMM of one rank's experts with `rows` rows each."""
    local = shape["experts"] // dist.get_world_size()
    k, n = shape["hidden"], 2 * shape["intermediate"]
    capacity = 2 * rows + 64                   # rows past the counts are never touched: any capacity will do
    counts = torch.full((local,), rows, dtype=torch.int32, device="cuda")
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    a = torch.randn(local, capacity, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(local, n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    packed = a[:, :rows].reshape(-1, k).contiguous()
    q, q_scales = quantize_fp8(a.view(-1, k))
    q, q_scales = q.view(local, capacity, k), q_scales.view(local, capacity, k // 128)
    w_q, w_scales = quantize_weights_fp8(w)
    flops = 2 * local * rows * n * k

    def entry(kernel: str, fn, in_bytes: float, w_bytes: float) -> dict:
        progress.step(kernel)

        def timed():
            us = median_us(fn, iters, 3)
            moved = local * rows * k * in_bytes + local * n * k * w_bytes + local * rows * n * 2
            return {"us": us, "TFLOPs": flops / us / 1e6, "GBs": moved / us / 1e3}
        return {"shape": name, "rows_per_expert": rows, "kernel": kernel, **attempt(timed)}

    results = [
        entry("ours", lambda: grouped_gemm(a, w, counts, rows_per_expert=rows), 2, 2),
        entry("ours, FP8 rows", lambda: grouped_gemm(q, w, counts, q_scales, 128, rows_per_expert=rows),
              1 + 4 / 128, 2),
        entry("ours, FP8 rows and weights", lambda: grouped_gemm(q, w_q, counts, q_scales, 128, rows_per_expert=rows,
                                                                  w_scales=w_scales), 1 + 4 / 128, 1),
        entry("torch._grouped_mm", lambda: torch._grouped_mm(packed, w.transpose(1, 2), offs=offsets), 2, 2),
        entry("per-expert torch loop", lambda: [packed[e * rows:(e + 1) * rows] @ w[e].t() for e in range(local)],
              2, 2),
    ]
    if hasattr(torch, "_scaled_grouped_mm"):
        def scaled():
            a8, a_scale = rowwise_fp8(packed)
            w8, w_scale = rowwise_fp8(w.reshape(-1, k))
            w8, w_scale = w8.view(local, n, k).transpose(1, 2), w_scale.view(local, n)
            return lambda: torch._scaled_grouped_mm(a8, w8, a_scale, w_scale, offs=offsets, out_dtype=torch.bfloat16)
        setup = attempt(lambda: {"fn": scaled()})
        if "error" in setup:
            results.append({"shape": name, "rows_per_expert": rows, "kernel": "torch._scaled_grouped_mm", **setup})
        else:
            results.append(entry("torch._scaled_grouped_mm", setup["fn"], 1 + 4 / k, 1))
    return results


def rowwise_fp8(x: torch.Tensor, chunk: int = 65536):
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M]), one scale a row (what torch's scaled GEMMs take);
    `chunk` rows at a time, so that the fp32 temporaries of 256 DeepSeek-V3 experts' weights (30 GB
    each) never exist at once."""
    scale = torch.cat([x[i:i + chunk].abs().amax(-1).float() for i in range(0, x.shape[0], chunk)])
    scale = scale.clamp(min=1e-4) / 448.0
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    for i in range(0, x.shape[0], chunk):
        q[i:i + chunk] = (x[i:i + chunk].float() / scale[i:i + chunk, None]).to(torch.float8_e4m3fn)
    return q, scale


LAYER_COLUMNS = ["tokens", "backend", "max_tokens", "fp8_dispatch", "fp8_experts", "dispatch_us", "experts_us",
                 "expert_rows", "experts_floor_us", "combine_us", "forward_us", "forward_experts_replayed_us",
                 "forward_launched_us", "graph_us", "fp8_experts_rel_error", "error"]
GEMM_COLUMNS = ["shape", "rows_per_expert", "kernel", "us", "TFLOPs", "GBs", "error"]


def main():
    args = benchmark_args(__doc__, iters=20, tokens=LAYER_TOKENS,
                          full="also the grouped GEMM alone against torch's (DeepSeek-V3 and Qwen3-30B-A3B shapes)")
    rank = dist.get_rank()
    results = {**environment(), "default_max_tokens": DEFAULT_MAX_TOKENS, "layer": [], "grouped_gemm": []}

    def save():
        write_json(args, "moe_layer.json", results)

    for tokens in args.tokens:
        for backend, max_tokens, fp8, fp8_experts in layer_configs(tokens):
            row = {"tokens": tokens, "backend": backend, "max_tokens": max_tokens, "fp8_dispatch": fp8,
                   "fp8_experts": fp8_experts}
            with Progress(f"layer, {row_line(row, list(row))}") as p:
                row.update(attempt(lambda: layer_times(tokens, backend, max_tokens, fp8, fp8_experts, args.iters, p)))
            results["layer"].append(row)
            save()
            p.report(row_line(row, LAYER_COLUMNS))
        with Progress(f"layer, {tokens} tokens, the transformers block") as p:
            row = {"tokens": tokens, "backend": "transformers block, all experts on one GPU",
                   **attempt(lambda: transformers_block_times(tokens, args.iters))}
        results["layer"].append(row)
        save()
        p.report(row_line(row, LAYER_COLUMNS))
    if args.full:
        for name, shape, rows in GEMM_CASES:
            with Progress(f"grouped GEMM, {name}, {rows} rows per expert") as p:
                case = gemm_rows(name, shape, rows, args.iters, p)
            results["grouped_gemm"] += case
            save()
            p.report("\n".join(row_line(row, GEMM_COLUMNS) for row in case))
    if rank == 0:
        print(markdown_table(results["layer"], LAYER_COLUMNS))
        if results["grouped_gemm"]:
            print()
            print(markdown_table(results["grouped_gemm"], GEMM_COLUMNS))
    finish(args)


if __name__ == "__main__":
    main()
