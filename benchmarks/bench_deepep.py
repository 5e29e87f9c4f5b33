"""DeepEP beside moe_ep: DeepEP V1's kernels on bench_all_to_all.py's inputs and timing, in a job of its own.

    bash launch.sh benchmarks/bench_deepep.py --out OUTDIR [--tokens 16,128,512,4096]
    bash launch.sh benchmarks/bench_all_to_all.py --out OUTDIR      # then ours, merged into one table

DeepEP starts NVSHMEM as moe_ep does, and a process holds one NVSHMEM, so each library runs in a job of
its own; this one writes OUTDIR/deepep_<world>ranks.json, which bench_all_to_all.py (run after it, into
the same OUTDIR) merges with its rows, with our time over DeepEP's for each entry. The inputs are
bench_all_to_all.inputs (hidden 7168, 256 experts, top-8, router-like weights, the same seeds); the timing
is its graph_median and eager_median:

  up to 512 tokens per rank   DeepEP's low-latency dispatch (FP8 with fp32 per-128 scales, quantized in the
                              kernel) and combine (bf16, weighted), on one buffer sized for the largest of
                              these settings, cleaned between them (each call uses the setting's size as
                              its num_max_dispatch_tokens_per_rank): graph (a CUDA graph of 10 calls after a
                              barrier, per call) and eager (one call after a barrier)
  above                       DeepEP's normal-mode intranode dispatch of FP8 rows (quantized beforehand,
                              as DeepEP's own test does, with the cached handle: no host sync) and its
                              combine of bf16 rows, on 24 SMs (its tuned setting) with
                              its default configs for the world size: eager only

DeepEP is found on the path (`import deep_ep`: its build in .deepep/, put there by PYTHONPATH); where it
cannot be imported this says so, writes the reason into the JSON and exits 0. Its code is not part of this
project.
"""
import json
import os

import torch
import torch.distributed as dist

from bench_all_to_all import DECODE, EXPERTS, GROUP, HIDDEN, PREFILL, eager_median, graph_median, inputs
from bench_moe_layer import attempt
from moe_ep.reference import quantize_fp8
from moe_ep.timing import Progress, benchmark_args, environment, finish, markdown_table, row_line

LOW_LATENCY_TOKENS = DECODE[-1]       # the largest setting timed on the low-latency kernels
NORMAL_SMS = 24                       # the SMs of DeepEP's normal mode (its tuned setting)
QP_DEPTH = 2048                       # DeepEP asserts NVSHMEM_QP_DEPTH >= 2 (max_tokens + 1)
COLUMNS = ["tokens", "mode", "dispatch_graph_us", "dispatch_eager_us", "combine_graph_us", "combine_eager_us",
           "error"]


def normal_mode(deep_ep, tokens: int, num_sms: int, iters: int) -> dict:
    """Normal-mode intranode dispatch (FP8 rows, cached handle) and combine (bf16), eager."""
    world = dist.get_world_size()
    x, ids, weights, _ = inputs(tokens, tokens, EXPERTS // world)
    ids = ids.to(getattr(deep_ep, "topk_idx_t", torch.int64))
    buffer = deep_ep.Buffer(dist.group.WORLD, int(2e9), 0, explicitly_destroy=True)
    try:
        deep_ep.Buffer.set_num_sms(num_sms)
        dispatch_config = deep_ep.Buffer.get_dispatch_config(world)
        combine_config = deep_ep.Buffer.get_combine_config(world)
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(ids, EXPERTS)
        rows = quantize_fp8(x, GROUP)
        recv, _, recv_weights, _, handle, _ = buffer.dispatch(
            rows, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=ids, topk_weights=weights, config=dispatch_config)
        expert_out = torch.randn(recv[0].shape, device="cuda").bfloat16()
        return {"mode": f"normal, {num_sms} SMs",
                "dispatch_eager_us": eager_median(lambda: buffer.dispatch(rows, handle=handle, config=dispatch_config),
                                                  iters),
                "combine_eager_us": eager_median(lambda: buffer.combine(expert_out, handle, recv_weights,
                                                                        config=combine_config), iters)}
    finally:
        torch.cuda.synchronize()
        dist.barrier()
        buffer.destroy()


def low_latency(deep_ep, buffer, tokens: int, iters: int) -> dict:
    """Low-latency dispatch (FP8 in the kernel) and combine (bf16), graph and eager."""
    world = dist.get_world_size()
    x, ids, weights, expert_out = inputs(tokens, tokens, EXPERTS // world)
    ids = ids.to(getattr(deep_ep, "topk_idx_t", torch.int64))
    torch.cuda.synchronize()
    dist.barrier()
    buffer.clean_low_latency_buffer(tokens, HIDDEN, EXPERTS)     # the layout of this setting's size
    torch.cuda.synchronize()
    dist.barrier()

    def dispatch():
        return buffer.low_latency_dispatch(x, ids, tokens, EXPERTS, use_fp8=True)

    handle = dispatch()[2]

    def combine():
        return buffer.low_latency_combine(expert_out, ids, weights, handle)

    out = {"mode": "low-latency", "dispatch_graph_us": graph_median(dispatch, iters // 4),
           "combine_graph_us": graph_median(combine, iters // 4)}
    handle = dispatch()[2]
    out["dispatch_eager_us"] = eager_median(dispatch, iters)
    out["combine_eager_us"] = eager_median(combine, iters)
    return out


def main():
    args = benchmark_args(__doc__, iters=100, tokens=(*DECODE, PREFILL))
    world = dist.get_world_size()
    path = os.path.join(args.out, f"deepep_{world}ranks.json")
    try:
        import deep_ep
    except ImportError as error:
        reason = f"deep_ep cannot be imported here ({error}); build DeepEP V1 into .deepep/ and put it on PYTHONPATH"
        if dist.get_rank() == 0:
            print(reason)
            with open(path, "w") as f:
                json.dump({**environment(), "unavailable": reason}, f, indent=1)
        finish(args)
        return
    results = {**environment(), "version": "V1", "normal_mode_sms": NORMAL_SMS, "settings": []}

    def save(row):
        results["settings"].append(row)
        if dist.get_rank() == 0:
            with open(path, "w") as f:
                json.dump(results, f, indent=1)

    for tokens in (t for t in args.tokens if t > LOW_LATENCY_TOKENS):
        with Progress(f"DeepEP normal mode, {tokens} tokens per rank") as p:
            row = {"tokens": tokens, **attempt(lambda: normal_mode(deep_ep, tokens, NORMAL_SMS, args.iters // 4))}
        save(row)
        p.report(row_line(row, COLUMNS, ".1f"))
    decode = [t for t in args.tokens if t <= LOW_LATENCY_TOKENS]
    if decode:
        os.environ["NVSHMEM_QP_DEPTH"] = str(max(QP_DEPTH, 2 * (max(decode) + 1)))
        size = deep_ep.Buffer.get_low_latency_rdma_size_hint(max(decode), HIDDEN, world, EXPERTS)
        buffer = deep_ep.Buffer(dist.group.WORLD, 0, size, low_latency_mode=True, num_qps_per_rank=EXPERTS // world,
                                explicitly_destroy=True)
        for tokens in decode:
            with Progress(f"DeepEP low-latency, {tokens} tokens per rank") as p:
                row = {"tokens": tokens, **attempt(lambda: low_latency(deep_ep, buffer, tokens, args.iters))}
            save(row)
            p.report(row_line(row, COLUMNS, ".1f"))
        torch.cuda.synchronize()
        dist.barrier()
        buffer.destroy()
    if dist.get_rank() == 0:
        print(f"{world}x {results['device']}, {results['date']}, DeepEP {results['version']}; us, rank 0\n")
        print(markdown_table(sorted(results["settings"], key=lambda r: r["tokens"]), COLUMNS))
    finish(args)


if __name__ == "__main__":
    main()
