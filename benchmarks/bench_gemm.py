"""The GEMMs alone on one GPU: every candidate of the async-TP tile loop against cuBLAS, and every
grouped-GEMM candidate against torch._grouped_mm and torch._scaled_grouped_mm, in one run.

    bash launch.sh --nproc 1 benchmarks/bench_gemm.py --out OUTDIR   [--tile_loop | --grouped: that part only]

Tile loop (moe_ep.kernels.matmul, every SM, its tile shapes): out [M, N] = a [M, K] @ w [K, N] bf16,
w = weight.t() as nn.Linear stores it, on the per-rank shapes of bench_tp.py's prefill cases a-d at
tp 2 and 4: all-gather GEMM (M, K, N / tp), GEMM reduce-scatter (M, K / tp, N). One column per
variant of matmul.VARIANTS with its time, and `<variant>_vs_cublas` = cuBLAS time / its time (the
target: >= 0.98 on every shape).

Grouped GEMM (moe_ep.kernels.grouped_gemm): the gate_up GEMM of DeepSeek-V3 (256 experts, hidden 7168,
2 x 2048) and Qwen3-30B-A3B (128 experts, hidden 2048, 2 x 768), all experts on this GPU, 8/256 and
32/512 rows per expert (bench_moe_layer.GEMM_CASES). Ours in bf16 and with FP8 rows and 128 x 128-block
FP8 weights, per candidate of GROUPED_CANDIDATES; torch._grouped_mm (bf16) and torch._scaled_grouped_mm
(FP8, row-wise scales: what this torch offers). TFLOP/s over the counted rows, TB/s over the least
bytes the GEMM must move (rows in, every weight once, rows out); `vs_torch` = torch's time / ours
against the baseline of the same precision, `vs_ours_bf16` = our best bf16 time / this one (FP8
rows), `rel_error` = |ours - torch._grouped_mm (bf16)| / |torch._grouped_mm| over all outputs.

Times: median of --iters calls, each timed alone with CUDA events, warm-up excluded, L2 flushed
before every call (a 256 MB write, outside the timing) so no operand is served from L2.
Writes gemm.json (rows appended as they are measured: a cut run keeps them) and gemm.md.
"""
import json
import os

import torch
import torch.distributed as dist
from bench_moe_layer import GEMM_CASES, attempt, rowwise_fp8

from moe_ep import quantize_fp8, runtime
from moe_ep.kernels.grouped_gemm import TILE_CANDIDATES, grouped_gemm
from moe_ep.kernels.matmul import VARIANTS, matmul, tile_config
from moe_ep.kernels.quant import quantize_weights_fp8
from moe_ep.timing import benchmark_args, environment, markdown_table, median_us

TP_CASES = {"a": (4096, 8192, 28672), "b": (8192, 8192, 28672), "c": (16384, 8192, 8192), "d": (2048, 4096, 14336)}
TP_SIZES = (2, 4)
L2_FLUSH_BYTES = 256 * 2**20     # over 5x the L2 of an H100 or H200 (50-60 MB)
# Grouped-GEMM candidates: (label, variant, tiles for the prefill class or None for the table's, precisions)
GROUPED_CANDIDATES = [("pointer", "pointer", None, ("bf16", "fp8")), ("tma", "tma", None, ("bf16", "fp8")),
                      *((f"tma {name}", "tma", tiles, precisions)
                        for name, (tiles, precisions) in TILE_CANDIDATES.items())]


def timer(iters: int):
    """median_us with the L2 flushed before every timed call."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    return lambda fn: median_us(fn, iters, 3, before=flush.zero_)


# ---------------------------------------------------------------------------------------------- tile loop

def tp_shapes():
    """(label, M, K, N) of every per-rank GEMM of bench_tp.py's prefill cases at TP_SIZES."""
    for case, (m, k, n) in TP_CASES.items():
        for tp in TP_SIZES:
            yield f"{case} tp{tp} AG", m, k, n // tp
            yield f"{case} tp{tp} RS", m, k // tp, n


def tp_row(label: str, m: int, k: int, n: int, time_us, programs: int) -> dict:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5).t()
    expected = (a @ w).float()
    row = {"shape": label, "M": m, "K": k, "N": n, "cublas_us": time_us(lambda: a @ w)}
    row["cublas_TFLOPs"] = 2 * m * k * n / row["cublas_us"] / 1e6
    config = tile_config(m, n, a.element_size())
    for variant in VARIANTS:
        def run(variant=variant):
            return matmul(a, w, programs, config, variant=variant)
        error = attempt(lambda: ((run().float() - expected).norm() / expected.norm()).item())
        if isinstance(error, dict):                    # a candidate that fails must not cost the others
            row[f"{variant}_us"] = error["error"]
            continue
        row[f"{variant}_us"] = time_us(run)
        row[f"{variant}_vs_cublas"] = row["cublas_us"] / row[f"{variant}_us"]
        row[f"{variant}_rel_error"] = error
    return row


# ---------------------------------------------------------------------------------------------- grouped GEMM

def quantized_weights(w: torch.Tensor, experts_at_once: int = 16):
    """quantize_weights_fp8 over a few experts at a time: its fp32 temporaries for all 256 of
    DeepSeek-V3's experts would be 30 GB each."""
    parts = [quantize_weights_fp8(w[e:e + experts_at_once]) for e in range(0, w.shape[0], experts_at_once)]
    return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])


def grouped_rows(name: str, shape: dict, rows: int, time_us) -> list[dict]:
    """Every candidate and baseline on the gate_up GEMM of `shape` with `rows` rows per expert."""
    experts, k, n = shape["experts"], shape["hidden"], 2 * shape["intermediate"]
    counts = torch.full((experts,), rows, dtype=torch.int32, device="cuda")
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    a = torch.randn(experts, rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    q, q_scales = quantize_fp8(a.view(-1, k))
    q, q_scales = q.view(experts, rows, k), q_scales.view(experts, rows, k // 128)
    w_q, w_scales = quantized_weights(w)
    packed = a.view(-1, k)
    expected = torch._grouped_mm(packed, w.transpose(1, 2), offs=offsets).float().view(experts, rows, n)
    flops = 2 * experts * rows * n * k

    def entry(kernel: str, fn, row_bytes: float, weight_bytes: float) -> dict:
        row = {"shape": name, "rows_per_expert": rows, "kernel": kernel}
        out = attempt(fn)
        if isinstance(out, dict):
            return {**row, "us": out["error"]}
        us = time_us(fn)
        moved = experts * rows * k * row_bytes + experts * n * k * weight_bytes + experts * rows * n * 2
        error = (out.float().view(experts, rows, n) - expected).norm() / expected.norm()
        return {**row, "us": us, "TFLOPs": flops / us / 1e6, "TBs": moved / us / 1e6, "rel_error": error.item()}

    fp8_row_bytes = 1 + 4 / 128
    results = [entry("torch._grouped_mm", lambda: torch._grouped_mm(packed, w.transpose(1, 2), offs=offsets), 2, 2)]
    a8, a_scale = rowwise_fp8(packed)
    w8, w_scale = rowwise_fp8(w.reshape(-1, k))
    w8, w_scale = w8.view(experts, n, k).transpose(1, 2), w_scale.view(experts, n)
    results.append(entry("torch._scaled_grouped_mm", lambda: torch._scaled_grouped_mm(
        a8, w8, a_scale, w_scale, offs=offsets, out_dtype=torch.bfloat16), 1 + 4 / k, 1 + 4 / k))
    prefill = rows > 64
    for label, variant, tiles, precisions in GROUPED_CANDIDATES:
        if tiles is not None and not prefill:
            continue
        if "bf16" in precisions:
            results.append(entry(f"ours bf16, {label}", lambda: grouped_gemm(
                a, w, counts, rows_per_expert=rows, variant=variant, tiles=tiles), 2, 2))
        if "fp8" in precisions:
            results.append(entry(f"ours FP8, {label}", lambda: grouped_gemm(
                q, w_q, counts, q_scales, 128, rows_per_expert=rows, w_scales=w_scales, variant=variant, tiles=tiles),
                fp8_row_bytes, 1))
    torch_us = {r["kernel"]: r["us"] for r in results if r["kernel"].startswith("torch")}
    ours_bf16 = [r["us"] for r in results if r["kernel"].startswith("ours bf16") and isinstance(r["us"], float)]
    for r in results:
        if r["kernel"].startswith("ours") and isinstance(r["us"], float):
            baseline = torch_us["torch._scaled_grouped_mm" if "FP8" in r["kernel"] else "torch._grouped_mm"]
            if isinstance(baseline, float):
                r["vs_torch"] = baseline / r["us"]
            if "FP8" in r["kernel"] and ours_bf16:
                r["vs_ours_bf16"] = min(ours_bf16) / r["us"]
    return results


TP_COLUMNS = ["shape", "M", "K", "N", "cublas_us", "cublas_TFLOPs",
              *(f"{v}_{c}" for c in ("us", "vs_cublas") for v in VARIANTS), *(f"{v}_rel_error" for v in VARIANTS)]
GROUPED_COLUMNS = ["shape", "rows_per_expert", "kernel", "us", "TFLOPs", "TBs", "vs_torch", "vs_ours_bf16",
                   "rel_error"]


def main():
    args = benchmark_args(__doc__, iters=20, tile_loop="the tile loop only", grouped="the grouped GEMM only")
    if dist.get_world_size() != 1:
        raise SystemExit("bench_gemm.py runs on one GPU: bash launch.sh --nproc 1 benchmarks/bench_gemm.py")
    results = {**environment(), "tile_loop": [], "grouped_gemm": []}
    time_us = timer(args.iters)
    programs = torch.cuda.get_device_properties(0).multi_processor_count

    def save():
        with open(os.path.join(args.out, "gemm.json"), "w") as f:
            json.dump(results, f, indent=1)

    if not args.grouped:
        for label, m, k, n in tp_shapes():
            results["tile_loop"].append(tp_row(label, m, k, n, time_us, programs))
            print(json.dumps(results["tile_loop"][-1]), flush=True)
            save()
    if not args.tile_loop:
        for name, shape, rows in GEMM_CASES:
            results["grouped_gemm"] += grouped_rows(name, shape, rows, time_us)
            save()
            torch.cuda.empty_cache()
    text = (f"{results['device']}, {results['date']}, torch {results['torch']}, triton {results['triton']}\n\n"
            f"{markdown_table(results['tile_loop'], TP_COLUMNS, '.3g')}\n\n"
            f"{markdown_table(results['grouped_gemm'], GROUPED_COLUMNS, '.3g')}\n")
    with open(os.path.join(args.out, "gemm.md"), "w") as f:
        f.write(text)
    print(text)
    runtime.finalize_distributed()


if __name__ == "__main__":
    main()
