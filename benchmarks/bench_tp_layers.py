"""The tensor-parallel layers in a decode step, on AsyncTP against the same layers on plain NCCL + cuBLAS.

    bash launch.sh benchmarks/bench_tp_layers.py --out OUTDIR [--tokens 1,4,16,64] [--iters 50]

Decode: every rank holds all M rows (M = --tokens, default 1, 4, 16 and 64; no sequence parallelism),
bf16, tp = the number of ranks. The MLP of a transformers Llama of each shape of MODELS (hidden H,
intermediate I; the same weights on every rank) is sharded twice by ``TPMLP.from_mlp(mlp, comm=...,
sequence_parallel=False)``: "ours" on an AsyncTP (its default overlap="auto"), "plain" without a
communicator (cuBLAS, then NCCL's all-reduce). Each layer of it is a row:
  column  gate_up_proj, ColumnParallelLinear   x [M, H] -> [M, 2I/tp]. Without sequence parallelism it
          communicates nothing forward, so ours and plain run the same code: its rows show the noise
  row     down_proj, RowParallelLinear         h [M, I/tp] (this rank's columns) -> [M, H], all-reduced
          (ours: AsyncTP.gemm_ar)
  mlp     TPMLP, down(silu(gate(x)) * up(x))   x [M, H] -> [M, H]
Before a row's timing, one call of each, on every rank: ours' first call of a shape makes overlap="auto"'s
choice of path for the all-reduce (`path`: "never" is cuBLAS then NCCL through AsyncTP's per-call checks,
"fused" its one Triton GEMM that pushes each tile to the peers; "none" for the column layer). Their
outputs are compared: `agree` = torch.allclose(ours, plain, rtol=TOLERANCE, atol=TOLERANCE * max |plain|)
on every rank, `max_abs_diff` = the largest |ours - plain| on any rank; a mismatch is reported in the row.
A first call of ours that raises on any rank leaves its failure in `ours_us` and only plain is timed.
Times in us (rank 0), under torch.no_grad:
  plain_us, ours_us              eager: the median of --iters calls, each timed alone with CUDA events after a
                                 barrier (every rank begins it together), the two interleaved, round after
                                 round in an order of the round's own, after WARMUP untimed calls each
  plain_graph_us, ours_graph_us  a CUDA graph of GRAPH_CALLS (10) back-to-back calls, captured after the
                                 eager calls, its replays timed as the eager calls are, over GRAPH_CALLS: no
                                 host time. A column whose capture fails on any rank holds the failure,
                                 "failed: <type>: <message>" (another rank's with "(rank R)"), and is not replayed
  speedup = plain_us / ours_us, graph_speedup = plain_graph_us / ours_graph_us: the target is that neither
  falls below 1 by more than the column rows' spread.
Each row is printed as it is measured (a line, and '... still on <row>' every 30 s while one takes longer);
tp_layers.json is rewritten as rows come in, tp_layers.md (the table and the slowest speedups) written at
the end; rank 0 prints them.
"""

import torch
import torch.distributed as dist
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from moe_ep import TPMLP, AsyncTP, RowParallelLinear, collectives
from moe_ep.timing import (GRAPH_CALLS, Progress, benchmark_args, call_after_barrier_us, environment, failure, finish,
                           graph_times, heading, interleaved_median_us, markdown_table, row_line, write_json,
                           write_report)

# (hidden, intermediate) of each model's MLP. The default run took 26 s on 2 x H200 and 29 s on 4 x H200 with the
# launch (benchmarks/NOTES.md, "The gate runs of 2026-11-27, morning"): startup with NCCL, NVSHMEM and AsyncTP's
# buffers most of it; then per row two first calls, 2 x (WARMUP + 50) eager calls after barriers and two graphs of
# 10 calls captured and replayed 51 times each.
MODELS = {"llama3-70b": (8192, 28672), "llama3-8b": (4096, 14336)}
ROWS = (1, 4, 16, 64)           # M, the rows of a decode step on every rank
WARMUP = 5                      # untimed calls of each before a row's timed rounds
TOLERANCE = 2e-2                # of `agree`: bf16 outputs; "fused" sums the partials in fp32 and NCCL in bf16, after
                                # GEMMs that accumulate in their own orders: a few bf16 roundings of the largest entries


def layer_pairs(hidden: int, intermediate: int, comm: AsyncTP) -> dict[str, tuple[nn.Module, nn.Module]]:
    """(plain, ours) of each layer of a transformers Llama MLP [H = hidden, I = intermediate], made on comm's
    device in its dtype with the same weights on every rank (seeded): "column" (gate_up_proj), "row" (down_proj)
    and "mlp" (the whole TPMLP); ours on `comm`, plain on the default group, both without sequence parallelism."""
    torch.manual_seed(0)
    with torch.device(comm.device):
        mlp = LlamaMLP(LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, hidden_act="silu"))
    mlp = mlp.to(comm.dtype)
    plain = TPMLP.from_mlp(mlp, sequence_parallel=False)
    ours = TPMLP.from_mlp(mlp, comm=comm, sequence_parallel=False)
    return {"column": (plain.gate_up_proj, ours.gate_up_proj), "row": (plain.down_proj, ours.down_proj),
            "mlp": (plain, ours)}


def layer_input(layer: nn.Module, m: int) -> torch.Tensor:
    """A decode step's input of `layer` (of layer_pairs), M rows seeded by M: activations [M, in_features], the same
    on every rank (x [M, H] of "column" and "mlp"), or of the row-parallel layer this rank's columns [M, I/tp] of
    activations [M, I] the same on every rank."""
    first = layer.gate_up_proj if isinstance(layer, TPMLP) else layer
    device = first.weight.device
    x = torch.randn(m, first.in_features, generator=torch.Generator(device).manual_seed(m), device=device)
    if isinstance(first, RowParallelLinear):
        x = x.chunk(first.world, dim=1)[first.rank].contiguous()
    return x.to(first.weight.dtype)


def comm_path(layer: nn.Module, m: int) -> str:
    """How `layer` (ours, after its first call of M rows) communicates: "none" (the column-parallel layer, which
    has nothing to communicate without sequence parallelism), "reference" (an AsyncTP on that backend), else
    overlap="auto"'s choice for its row-parallel gemm_ar of [M, I/tp] @ [I/tp, H]."""
    down = layer.down_proj if isinstance(layer, TPMLP) else layer
    if not isinstance(down, RowParallelLinear):
        return "none"
    if down.comm.backend == "reference":
        return "reference"
    choice = down.comm.choices.get(("gemm_ar", m, down.weight.shape[1], down.weight.shape[0]))
    return choice["path"] if choice else "never"       # no choice: M * tp exceeds max_rows, and gemm_ar takes "never"


def compared(got: torch.Tensor, expected: torch.Tensor) -> dict:
    """max_abs_diff: the largest |got - expected| on any rank; agree: whether torch.allclose(got, expected,
    rtol=TOLERANCE, atol=TOLERANCE * max |expected|) holds on every rank (collective)."""
    got, expected = got.float(), expected.float()
    close = torch.allclose(got, expected, rtol=TOLERANCE, atol=TOLERANCE * expected.abs().max().item())
    worst = torch.tensor([(got - expected).abs().max().item(), float(not close)], dtype=torch.float64,
                         device=got.device)
    collectives.all_reduce(worst, op=dist.ReduceOp.MAX)
    return {"max_abs_diff": worst[0].item(), "agree": not worst[1].item()}


def measure(plain: nn.Module, ours: nn.Module, x: torch.Tensor, iters: int, graphs: bool, progress: Progress,
            time_us=call_after_barrier_us) -> dict:
    """One row of plain(x) against ours(x) (module docstring), every rank making the same calls in the same order:
    plain_us, ours_us, with `graphs` plain_graph_us and ours_graph_us, then speedup (and graph_speedup), path,
    max_abs_diff and agree. time_us(fn) -> us is the clock of the eager calls."""
    checks = {}
    with torch.no_grad():
        progress.step("first calls, outputs compared")
        expected = plain(x)
        try:
            got, error = ours(x), None
        except Exception as e:            # reported in the row on every rank, not fatal
            got, error = None, failure(e)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, error)
        failed = [f"{why} (rank {rank})" for rank, why in enumerate(everyone) if why is not None]
        timed = [("plain_us", lambda: plain(x))]
        if not failed:
            checks = {"path": comm_path(ours, x.shape[0]), **compared(got, expected)}
            timed.append(("ours_us", lambda: ours(x)))
        progress.step(f"{WARMUP} warm-up calls, then {iters} rounds of {len(timed)} timed calls")
        row = dict(zip((key for key, _ in timed), interleaved_median_us([fn for _, fn in timed], iters, WARMUP,
                                                                        time_us)))
        if failed:
            row["ours_us"] = failed[0]
        if graphs:
            progress.step(f"CUDA graphs of {GRAPH_CALLS} calls: capture, then {iters} rounds of replays")
            row.update(graph_times(timed, iters))
    for us, speedup in (("_us", "speedup"), ("_graph_us", "graph_speedup")):
        if all(isinstance(row.get(key), float) for key in (f"plain{us}", f"ours{us}")):
            row[speedup] = row[f"plain{us}"] / row[f"ours{us}"]
    return {**row, **checks}


def slowest(rows: list[dict], key: str) -> str:
    """'<key> <least value> (<model>, <layer>, M=<M>)' over the rows that hold a number under `key`."""
    timed = [row for row in rows if isinstance(row.get(key), float)]
    if not timed:
        return f"{key} -"
    row = min(timed, key=lambda row: row[key])
    return f"{key} {row[key]:.3g} ({row['model']}, {row['layer']}, M={row['M']})"


COLUMNS = ["model", "layer", "M", "plain_us", "ours_us", "speedup", "plain_graph_us", "ours_graph_us", "graph_speedup",
           "path", "agree", "max_abs_diff"]


def main():
    args = benchmark_args(__doc__, iters=50, tokens=ROWS)
    rank, world = dist.get_rank(), dist.get_world_size()
    meta = environment()
    comm = AsyncTP(max_rows=world * max(args.tokens), max_features=max(hidden for hidden, _ in MODELS.values()))
    rows = []
    for model, (hidden, intermediate) in MODELS.items():
        layers = layer_pairs(hidden, intermediate, comm)
        for m in args.tokens:
            for layer, (plain, ours) in layers.items():
                row = {"model": model, "layer": layer, "M": m}
                with Progress(row_line(row, list(row))) as p:
                    row.update(measure(plain, ours, layer_input(ours, m), args.iters, True, p))
                rows.append(row)
                write_json(args, "tp_layers.json", {**meta, "rows": rows})
                p.report(row_line(row, COLUMNS))
    comm.check()
    if rank == 0:
        mismatched = sum(row.get("agree") is False for row in rows)
        text = (f"{heading(meta)}, bf16, decode (no sequence parallelism), times in us (rank 0); ours: AsyncTP "
                f"(overlap='auto'), plain: no communicator (cuBLAS, NCCL)\n\n"
                f"{markdown_table(rows, COLUMNS, '.3g')}\n\n"
                f"Slowest against plain: {slowest(rows, 'speedup')}; {slowest(rows, 'graph_speedup')}. "
                f"Outputs disagree in {mismatched} rows (allclose, rtol {TOLERANCE}, atol {TOLERANCE} x max "
                f"|plain|).\n")
        write_report(args, "tp_layers.md", text)
    comm.destroy()
    finish(args)


if __name__ == "__main__":
    main()
