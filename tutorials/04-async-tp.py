"""
Tutorial 04: async tensor parallelism, the all-gather and reduce-scatter hidden behind the GEMMs
===============================================================================================

    bash launch.sh tutorials/04-async-tp.py

With tensor and sequence parallelism, each of W ranks holds M/W rows of the activations.
A Llama-style MLP then needs, per layer:

* an all-gather of the rows before the column-parallel gate/up GEMM (each rank holds a
  block of the weight's output columns), and
* a reduce-scatter after the row-parallel down GEMM (each rank holds a block of its input
  columns, so each rank's product is a partial sum of the whole output).

Done naively the GEMM waits for the whole gather, and the reduce-scatter waits for the
whole GEMM. ``moe_ep.AsyncTP`` overlaps them (Looped CollectiveEinsum):

* all-gather GEMM: each rank pushes its rows into its peers' symmetric buffers on the copy
  engine and raises a flag per shard; the GEMM starts on the local rows and takes each
  other shard once its flag is up;
* GEMM reduce-scatter: the rows bound for the next rank are computed first and sent to it
  while the rest is computed; each rank computes its own rows last and adds the peers'
  partials in fp32.

Two ways to run the GEMM side: "fused", one persistent Triton GEMM that waits per tile
(reduce-scatter: stores its partial tiles straight into the peer over NVLink), and
"chunked", one cuBLAS GEMM per shard. ``overlap="auto"`` times the paths on the first call of
each shape and keeps the fastest (the plain path included, so overlap never costs).

The layers train: the gradient of the all-gather GEMM's input is a GEMM reduce-scatter, and
the other way round. For decode, ``sequence_parallel=False`` keeps all rows on every rank and
all-reduces the down projection's output instead (``AsyncTP.gemm_ar``).

This tutorial shards the MLP of a ``transformers`` Llama with ``TPMLP.from_mlp``, checks its
output and its gradients against the unsharded module, runs a decode step without sequence
parallelism, and, on GPUs, times the overlapped layer against the plain path (NCCL, then cuBLAS).
Without GPUs it runs the reference path on gloo and times nothing: gloo on CPU says nothing about
GPU speed.
"""
import torch
import torch.distributed as dist
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from moe_ep import TPMLP, AsyncTP, runtime
from moe_ep.timing import median_us, why_untimed


def main():
    device = runtime.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    gpu = device.type == "cuda"
    hidden, intermediate, rows = (4096, 14336, 8192) if gpu else (64, 256, 32)
    dtype = torch.bfloat16 if gpu else torch.float32

    torch.manual_seed(0)                                         # the same full MLP on every rank
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, hidden_act="silu")
    mlp = LlamaMLP(config).to(device, dtype)                     # the MLP of a transformers Llama model
    x = torch.randn(rows, hidden, device=device, dtype=dtype)
    mine = slice(rank * rows // world, (rank + 1) * rows // world)   # sequence parallel: my rows

    comm = AsyncTP(max_rows=rows, max_features=hidden, dtype=dtype) if gpu else None   # K: gather, N: scatter
    tp_mlp = TPMLP.from_mlp(mlp, comm=comm)
    with torch.no_grad():
        y = tp_mlp(x[mine])
        expected = mlp(x)[mine]
    tol = 3e-2 if gpu else 1e-5
    torch.testing.assert_close(y, expected, rtol=tol, atol=tol)
    print(f"rank {rank}: TP MLP over {world} ranks matches the unsharded MLP on its {y.shape[0]} rows")

    # Training: the sharded loss terms add up to the unsharded loss, so the gradients match.
    x_full = x.clone().requires_grad_()
    mlp(x_full).float().square().sum().backward()
    x_mine = x[mine].clone().requires_grad_()
    tp_mlp(x_mine).float().square().sum().backward()
    my_columns = slice(rank * intermediate // world, (rank + 1) * intermediate // world)
    down_grad = mlp.down_proj.weight.grad[:, my_columns]
    for name, got, want in (("input", x_mine.grad, x_full.grad[mine]),
                            ("down_proj weight", tp_mlp.down_proj.weight.grad, down_grad)):
        error = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        assert error < tol, f"{name} gradient: max error {error:.2g} of its largest entry"
    print(f"rank {rank}: its input and weight gradients match the unsharded MLP's")

    # Decode: a few tokens, every rank holds all of them; one all-reduce after the down projection.
    decode = TPMLP.from_mlp(mlp, comm=comm, sequence_parallel=False)
    with torch.no_grad():
        torch.testing.assert_close(decode(x[:4]), mlp(x[:4]), rtol=tol, atol=tol)
    print(f"rank {rank}: decode step (4 tokens, no sequence parallelism) matches")

    skipped = why_untimed(device)
    if skipped is None:
        plain = TPMLP.from_mlp(mlp)                              # comm=None: NCCL then cuBLAS
        times = {}
        with torch.no_grad():
            times["plain"] = median_us(lambda: plain(x[mine]), 20, 3)
            for path in ("fused", "chunked", "auto"):
                comm.overlap = path
                times[path] = median_us(lambda: tp_mlp(x[mine]), 20, 3)
        if rank == 0:
            print(f"MLP forward, {rows} tokens, hidden {hidden}, intermediate {intermediate}, tp {world}: "
                  + ", ".join(f"{k} {v:.0f} us" for k, v in times.items())
                  + f" (plain / auto = {times['plain'] / times['auto']:.2f}x; "
                  "benchmarks/bench_tp.py has the per-GEMM comparison)")
    elif rank == 0:
        print(f"timing skipped: {skipped}")
    if gpu:
        comm.destroy()


if __name__ == "__main__":
    main()
    runtime.finalize_distributed()
