"""The GEMMs alone on one GPU: the async-TP tile loop and its small-M path against cuBLAS, and the grouped
GEMM against torch._grouped_mm and torch._scaled_grouped_mm.

    bash launch.sh --nproc 1 benchmarks/bench_gemm.py --out OUTDIR [--tile_loop] [--small_m] [--grouped] [--full]

The default run (every part; --tile_loop, --small_m, --grouped: those parts only) times what the library
runs: the tile loop's FUSED_VARIANTS ("pointer", "tma") and its fastest standalone variant (FASTEST_ALONE),
the small-M path, and the grouped GEMM's variants on the table's tiles, in about 30 s on one H200 with the
launch and a warm cache (the tile loop and small-M parts alone: 18 s). --full adds every other variant of
matmul.VARIANTS (after the fused ones are measured on every shape, one variant at a time, so that a variant
that hangs costs only itself) and every grouped-GEMM tile candidate.

Tile loop (moe_ep.kernels.matmul, every SM, its tile shapes): out [M, N] = a [M, K] @ w [K, N] bf16,
w = weight.t() as nn.Linear stores it, on the per-rank shapes of bench_tp.py's prefill cases a-d at
tp 2 and 4: all-gather GEMM (M, K, N / tp), GEMM reduce-scatter (M, K / tp, N). One column per
variant with its time, and `<variant>_vs_cublas` = cuBLAS time / its time (the target: >= 0.98 on
every shape); `floor_us`: the flops at the bf16 tensor cores' datasheet peak (timing.floor_us).

Small M (moe_ep.kernels.matmul.matmul_small_m, its split rule for this GPU's SMs): the same GEMM at
SMALL_M_ROWS_TIMED rows on the per-rank K x N of SMALL_M_SHAPES, where it reads the weights more than it
computes. cuBLAS; the tile loop's "tma" and FASTEST_ALONE on tile_config's tiles; `small_m_tma` and
`small_m_pointer`, the small-M path loading each way, with `small_m_config` (tile, K slices); `fused_tma`, the
tile loop on the fused kernels' tiles (`fused_config`: matmul.fused_tile_config, one shard). Each `_vs_cublas` is
cuBLAS time / its time (the target: >= 0.9 up to matmul.SMALL_M_ROWS rows, and for `fused_tma` up to
matmul.FUSED_SMALL_M_ROWS); `floor_us`: the larger of the flops at the tensor cores' peak and the bytes (weights,
rows in, rows out) at HBM's.

Grouped GEMM (moe_ep.kernels.grouped_gemm): the gate_up GEMM of DeepSeek-V3 (256 experts, hidden 7168,
2 x 2048) and Qwen3-30B-A3B (128 experts, hidden 2048, 2 x 768), all experts on this GPU, 8/256 and
32/512 rows per expert (bench_moe_layer.GEMM_CASES). Ours in bf16 and with FP8 rows and 128 x 128-block
FP8 weights, per candidate of GROUPED_CANDIDATES; torch._grouped_mm (bf16) and torch._scaled_grouped_mm
(FP8, row-wise scales: what this torch offers). TFLOP/s over the counted rows, TB/s over the least
bytes the GEMM must move (rows in, every weight once, rows out); `floor_us` = the larger of the flops
at the tensor cores' datasheet peak and those bytes at HBM's (timing.floor_us; `vs_floor` = floor /
time); `vs_torch` = torch's time / ours
against the baseline of the same precision, `vs_ours_bf16` = our best bf16 time / this one (FP8
rows), `rel_error` = |ours - torch._grouped_mm (bf16)| / |torch._grouped_mm| over all outputs.

Times: median of --iters calls, each timed alone with CUDA events, warm-up excluded, L2 flushed
before every call (a 256 MB write, outside the timing) so no operand is served from L2, and the
GPU kept busy while the call is launched so that the events time the GPU's work, not the host's.
Each row is printed as it is measured (a line, and '... still on <row>' every 30 s while one takes
longer); gemm.json is rewritten as rows come in (a cut run keeps them); gemm.md at the end.
"""

import torch
import torch.distributed as dist
from bench_moe_layer import GEMM_CASES, attempt, rowwise_fp8

from moe_ep import quantize_fp8
from moe_ep.kernels.grouped_gemm import TILE_CANDIDATES, grouped_gemm
from moe_ep.kernels.matmul import (FUSED_VARIANTS, VARIANTS, fused_tile_config, matmul, matmul_small_m, small_m_config,
                                   tile_config)
from moe_ep.kernels.quant import quantize_weights_fp8
from moe_ep.timing import (Progress, benchmark_args, environment, finish, floor_us, heading, markdown_table,
                           median_us, row_line, write_json, write_report)

TP_CASES = {"a": (4096, 8192, 28672), "b": (8192, 8192, 28672), "c": (16384, 8192, 8192), "d": (2048, 4096, 14336)}
TP_SIZES = (2, 4)
# Small M: (label, K, N) per rank of a 28672-wide MLP on hidden 8192 (bench_tp.py's case a) and of case c
# (8192 x 8192), and the rows; tp 8's all-gather GEMM (N = 3584) has too few tiles of 64 columns for the
# SMs: the one shape where the split rule cuts K.
SMALL_M_SHAPES = [("a tp4 AG", 8192, 7168), ("a tp4 RS", 7168, 8192), ("c tp4 RS", 2048, 8192), ("c tp1", 8192, 8192),
                  ("a tp8 AG", 8192, 3584), ("tp2 AG", 8192, 14336), ("tp2 RS", 4096, 28672), ("tp4 RS", 2048, 28672)]
SMALL_M_ROWS_TIMED = (1, 16, 32, 64, 128, 256, 512)
L2_FLUSH_BYTES = 256 * 2**20     # over 5x the L2 of an H100 or H200 (50-60 MB)
BUSY_CYCLES = 1_000_000           # about 0.5 ms at the H200's 1.98 GHz: longer than any launch
FASTEST_ALONE = "tma_flat_store"  # matmul's fastest variant, which the fused kernels cannot run
# Grouped-GEMM candidates: (label, variant, tiles for the prefill class or None for the table's, precisions)
GROUPED_CANDIDATES = [*((v, v, None, ("bf16", "fp8")) for v in ("pointer", "tma", "tma_flat")),
                      *((f"tma {name}", "tma", tiles, precisions)
                        for name, (tiles, precisions) in TILE_CANDIDATES.items())]


# What the default run costs: the tile loop compiles once per variant (all 16 shapes take the same
# 128 x 256 x 64 tiles and specializations) and times 24 calls of at most 3 ms a shape and variant; the
# grouped GEMM compiles 20 kernels (K and N are constexpr: 2 shapes x decode/prefill tiles x bf16, 2
# shapes x FP8, x 3 variants, fewer where they share) and makes and quantizes DeepSeek-V3's 15 GB of
# weights. --full: the other tile-loop variants (tma_flat, tma_split_tail), and the grouped tile candidates at the
# prefill rows.
def tile_loop_passes(full: bool) -> list[tuple[str, ...]]:
    """The tile-loop variants measured together over every shape, pass after pass: the fused kernels'
    first, then each other variant of VARIANTS alone (without --full, only FASTEST_ALONE)."""
    return [FUSED_VARIANTS, *((v,) for v in VARIANTS if v not in FUSED_VARIANTS and (full or v == FASTEST_ALONE))]


def timer(iters: int):
    """median_us with the L2 flushed before every timed call and the GPU kept busy while the call is
    launched (BUSY_CYCLES of torch.cuda._sleep after the flush): the events time the kernels alone,
    not the host's launch, which a GEMM of 100 us would otherwise partly include."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")

    def before():
        flush.zero_()
        torch.cuda._sleep(BUSY_CYCLES)
    return lambda fn: median_us(fn, iters, 3, before=before)


# ---------------------------------------------------------------------------------------------- tile loop

def tp_shapes():
    """(label, M, K, N) of every per-rank GEMM of bench_tp.py's prefill cases at TP_SIZES."""
    for case, (m, k, n) in TP_CASES.items():
        for tp in TP_SIZES:
            yield f"{case} tp{tp} AG", m, k, n // tp
            yield f"{case} tp{tp} RS", m, k // tp, n


def tp_measure(row: dict, variants: tuple[str, ...], time_us, programs: int, progress: Progress,
               small_m: bool = False) -> None:
    """Add to `row` (shape, M, K, N) each variant's time, its ratio to cuBLAS and its relative error
    (its error instead where it fails), and cuBLAS's time where the row has none yet; with `small_m`,
    matmul_small_m's too, loading as each of FUSED_VARIANTS (`small_m_<variant>`), and its config."""
    m, k, n = row["M"], row["K"], row["N"]
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5).t()
    expected = (a @ w).float()
    if "cublas_us" not in row:
        progress.step("cuBLAS")
        row["cublas_us"] = time_us(lambda: a @ w)
        row["cublas_TFLOPs"] = 2 * m * k * n / row["cublas_us"] / 1e6
        row["floor_us"] = floor_us(2 * m * k * n, 2 * (m * k + k * n + m * n))
    config = tile_config(m, n, a.element_size())
    runs = {variant: lambda variant=variant: matmul(a, w, programs, config, variant=variant) for variant in variants}
    if small_m:
        small = small_m_config(m, n, k, a.element_size(), programs)
        row["small_m_config"] = f"{small['BLOCK_M']}x{small['BLOCK_N']}x{small['BLOCK_K']}, {small['splits']} slices"
        runs.update({f"small_m_{variant}": lambda variant=variant: matmul_small_m(a, w, programs, variant=variant)
                     for variant in FUSED_VARIANTS})
        fused = fused_tile_config(m, n, a.element_size(), programs)
        row["fused_config"] = "{BLOCK_M}x{BLOCK_N}x{BLOCK_K} w{num_warps} s{num_stages}".format(**fused)
        runs["fused_tma"] = lambda: matmul(a, w, programs, fused, variant="tma")
    for name, run in runs.items():
        progress.step(name)
        error = attempt(lambda: ((run().float() - expected).norm() / expected.norm()).item())
        if isinstance(error, dict):                    # a candidate that fails must not cost the others
            row[f"{name}_us"] = error["error"]
            continue
        row[f"{name}_us"] = time_us(run)
        row[f"{name}_vs_cublas"] = row["cublas_us"] / row[f"{name}_us"]
        row[f"{name}_rel_error"] = error


# ---------------------------------------------------------------------------------------------- grouped GEMM

def quantized_weights(w: torch.Tensor, experts_at_once: int = 16):
    """quantize_weights_fp8 over a few experts at a time: its fp32 temporaries for all 256 of
    DeepSeek-V3's experts would be 30 GB each."""
    parts = [quantize_weights_fp8(w[e:e + experts_at_once]) for e in range(0, w.shape[0], experts_at_once)]
    return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])


def grouped_rows(name: str, shape: dict, rows: int, candidates: list, time_us, progress: Progress) -> list[dict]:
    """Every one of `candidates` (entries of GROUPED_CANDIDATES) and the baselines on the gate_up GEMM of
    `shape` with `rows` rows per expert."""
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
        progress.step(kernel)
        row = {"shape": name, "rows_per_expert": rows, "kernel": kernel}
        out = attempt(fn)
        if isinstance(out, dict):
            return {**row, "us": out["error"]}
        us = time_us(fn)
        moved = experts * rows * k * row_bytes + experts * n * k * weight_bytes + experts * rows * n * 2
        error = (out.float().view(experts, rows, n) - expected).norm() / expected.norm()
        floor = floor_us(flops, moved, "fp8" if weight_bytes < 2 else "bf16")
        return {**row, "us": us, "TFLOPs": flops / us / 1e6, "TBs": moved / us / 1e6, "rel_error": error.item(),
                "floor_us": floor, "vs_floor": floor / us if floor else None}

    fp8_row_bytes = 1 + 4 / 128
    results = [entry("torch._grouped_mm", lambda: torch._grouped_mm(packed, w.transpose(1, 2), offs=offsets), 2, 2)]
    a8, a_scale = rowwise_fp8(packed)
    w8, w_scale = rowwise_fp8(w.reshape(-1, k))
    w8, w_scale = w8.view(experts, n, k).transpose(1, 2), w_scale.view(experts, n)
    results.append(entry("torch._scaled_grouped_mm", lambda: torch._scaled_grouped_mm(
        a8, w8, a_scale, w_scale, offs=offsets, out_dtype=torch.bfloat16), 1 + 4 / k, 1 + 4 / k))
    prefill = rows > 64
    for label, variant, tiles, precisions in candidates:
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


def tp_columns(variants) -> list[str]:
    """The tile loop's table: cuBLAS, then the time, ratio to cuBLAS and error of each of `variants`."""
    return ["shape", "M", "K", "N", "floor_us", "cublas_us", "cublas_TFLOPs",
            *(f"{v}_{c}" for c in ("us", "vs_cublas") for v in variants), *(f"{v}_rel_error" for v in variants)]


SMALL_M_VARIANTS = ("tma", FASTEST_ALONE, *(f"small_m_{v}" for v in FUSED_VARIANTS), "fused_tma")
SMALL_M_COLUMNS = [*tp_columns(SMALL_M_VARIANTS), "small_m_config", "fused_config"]
GROUPED_COLUMNS = ["shape", "rows_per_expert", "kernel", "us", "floor_us", "vs_floor", "TFLOPs", "TBs", "vs_torch",
                   "vs_ours_bf16", "rel_error"]


def main():
    args = benchmark_args(__doc__, iters=20, tile_loop="the tile loop (with the other parts asked for)",
                          small_m="the small-M path (with the other parts asked for)",
                          grouped="the grouped GEMM (with the other parts asked for)",
                          full="every tile-loop variant and every grouped-GEMM tile candidate (minutes)")
    if dist.get_world_size() != 1:
        raise SystemExit("bench_gemm.py runs on one GPU: bash launch.sh --nproc 1 benchmarks/bench_gemm.py")
    parts = [part for part in ("tile_loop", "small_m", "grouped") if getattr(args, part)] or ["tile_loop", "small_m",
                                                                                               "grouped"]
    results = {**environment(), "tile_loop": [], "small_m": [], "grouped_gemm": []}
    time_us = timer(args.iters)
    programs = torch.cuda.get_device_properties(0).multi_processor_count

    def save():
        write_json(args, "gemm.json", results)

    passes = tile_loop_passes(args.full)
    if "tile_loop" in parts:
        rows = results["tile_loop"]
        for variants in passes:
            print(f"tile loop, {', '.join(variants)}: every shape (the first compiles them)", flush=True)
            for i, (label, m, k, n) in enumerate(tp_shapes()):
                if i == len(rows):
                    rows.append({"shape": label, "M": m, "K": k, "N": n})
                with Progress(f"tile loop, {label}") as p:
                    tp_measure(rows[i], variants, time_us, programs, p)
                save()
                p.report(row_line(rows[i], ["shape", "cublas_us", *(f"{v}_{c}" for v in variants
                                                                    for c in ("us", "vs_cublas"))]))
    if "small_m" in parts:
        print(f"small M, {', '.join(SMALL_M_VARIANTS)}: every shape (the first compiles them)", flush=True)
        for label, k, n in SMALL_M_SHAPES:
            for m in SMALL_M_ROWS_TIMED:
                row = {"shape": f"{label} M{m}", "M": m, "K": k, "N": n}
                with Progress(f"small M, {row['shape']}") as p:
                    tp_measure(row, SMALL_M_VARIANTS[:2], time_us, programs, p, small_m=True)
                results["small_m"].append(row)
                save()
                p.report(row_line(row, ["shape", "cublas_us", *(f"{v}_vs_cublas" for v in SMALL_M_VARIANTS),
                                        "small_m_config", "fused_config"]))
    if "grouped" in parts:
        candidates = [c for c in GROUPED_CANDIDATES if args.full or c[2] is None]
        for name, shape, rows_per_expert in GEMM_CASES:
            with Progress(f"grouped GEMM, {name}, {rows_per_expert} rows per expert") as p:
                case = grouped_rows(name, shape, rows_per_expert, candidates, time_us, p)
            results["grouped_gemm"] += case
            save()
            p.report("\n".join(row_line(row, GROUPED_COLUMNS) for row in case))
            torch.cuda.empty_cache()
    tables = [markdown_table(results[part], columns, ".3g") for part, columns in (
        ("tile_loop", tp_columns([v for variants in passes for v in variants])), ("small_m", SMALL_M_COLUMNS),
        ("grouped_gemm", GROUPED_COLUMNS)) if results[part]]
    text = f"{heading(results)}\n\n" + "\n\n".join(tables) + "\n"
    write_report(args, "gemm.md", text)
    finish(args)


if __name__ == "__main__":
    main()
