"""
Tutorial 02: expert-parallel dispatch and combine
=================================================

    bash launch.sh tutorials/02-ep-all-to-all.py

A mixture-of-experts layer with E experts spread over W ranks moves every token to the
ranks that own its top-k experts (dispatch), runs the experts there, and brings the
weighted expert outputs back (combine). ``moe_ep.EPAllToAll`` owns the buffers of one such
layer shape and launches the kernels:

* dispatch quantizes each token to FP8 (per 128 columns) inside the kernel and sends it
  once per destination *rank*, however many of that rank's experts it picked; the
  receiver fans it out, in its own memory, to an expert-major layout
  ``recv_x[E_loc, W * max_tokens, H]`` with ``recv_count[E_loc]`` valid rows per expert;
* the experts see static shapes (CUDA-graph friendly) and use only the counted rows;
* combine sums, on each expert rank, w[t, k] * expert_out over the token's local experts
  and sends one row per (token, rank) back; the source adds the ranks' rows.

The kernels move one token row per work item and send one signal per peer and call: the fewest
steps between a call and its result. Dispatch's ``mode`` picks its kernels, by size with the
default "auto": the decode step below runs send and receive in one kernel launch (half the
launches, so less CPU time a call); the prefill step (more than 512 tokens a rank) takes a send
and a receive kernel with larger work items, where the GPU time is what counts. ``mode="decode"``
or ``"prefill"`` asks for one plan whatever the size; a call with ``return_recv_hook=True`` takes
the send and receive kernels of its mode. ``num_sms`` bounds the SMs they take, to leave room for
a GEMM running beside them.

This tutorial runs a decode-sized step and a prefill-sized one on at most 64 SMs with a toy
expert (dequantize, scale by expert), checks both against ``moe_ep.reference`` (the same contract
on ``torch.distributed.all_to_all_single``) and, on GPUs with one rank each, times them. Without
GPUs the reference backend runs on gloo and nothing is timed: gloo on CPU says nothing about GPU
speed.
"""
import torch
import torch.distributed as dist

from moe_ep import EPAllToAll, link_copies, random_topk, reference, runtime
from moe_ep.reference import dequantize_fp8
from moe_ep.timing import median_us, why_untimed


def toy_experts(recv_x, recv_scales, recv_count):
    """Expert e multiplies its tokens by (e + 1); rows past recv_count[e] are never looked at."""
    rows = dequantize_fp8(recv_x, recv_scales) if recv_scales is not None else recv_x.float()
    scale = torch.arange(1, rows.shape[0] + 1, device=rows.device, dtype=torch.float32)
    return (rows * scale[:, None, None]).bfloat16()


def step(device, name, tokens, experts, num_sms=None):
    """One dispatch -> toy experts -> combine, checked against the reference, timed; `name` labels what it prints."""
    rank, world = dist.get_rank(), dist.get_world_size()
    hidden, topk = 7168, 8
    backend = "nvshmem" if device.type == "cuda" else "reference"
    ep = EPAllToAll(tokens, hidden, experts, topk, backend=backend, num_sms=num_sms)

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=g).bfloat16().to(device)
    topk_ids, topk_weights = random_topk(tokens, experts, topk, device=device, generator=g)

    recv_x, recv_scales, recv_count, handle = ep.dispatch(x, topk_ids, topk_weights)
    y = ep.combine(toy_experts(recv_x, recv_scales, recv_count), handle)

    # The same step on the reference path: identical bits, since both sum in the same order.
    r_x, r_scales, r_count, r_handle = reference.dispatch(x, topk_ids, topk_weights, num_experts=experts,
                                                          max_tokens=tokens, fp8_group=128)
    y_ref = reference.combine(toy_experts(r_x, r_scales, r_count), r_handle)
    assert torch.equal(recv_count, r_count) and torch.equal(y, y_ref)
    once, per_expert = link_copies(topk_ids, ep.experts_per_rank, rank, world)
    print(f"rank {rank}, {name} step, {tokens} tokens: {int(recv_count.sum())} expert rows received; combine matches "
          f"the reference; {once} token copies left this rank (one per (token, expert) would be {per_expert})")

    skipped = why_untimed(device)
    if skipped is None:
        out = toy_experts(recv_x, recv_scales, recv_count)
        dispatch_us = median_us(lambda: ep.dispatch(x, topk_ids, topk_weights))
        *_, handle = ep.dispatch(x, topk_ids, topk_weights)
        combine_us = median_us(lambda: ep.combine(out, handle))
        if rank == 0:
            print(f"{name} step, {tokens} tokens: dispatch {dispatch_us:.1f} us, combine {combine_us:.1f} us per call "
                  f"(eager, CUDA events)")
    elif rank == 0:
        print(f"{name} step, {tokens} tokens: timing skipped: {skipped}")
    ep.destroy()


def main():
    device = runtime.init_distributed()
    step(device, "decode", 128, 256)                  # a few tokens per rank: every microsecond counts
    # prefill: bandwidth, on at most 64 SMs' worth of programs (fewer experts keep the toy experts' fp32
    # copy of recv_x [E_loc, W * T, H] small; the reference backend on CPU takes fewer tokens)
    step(device, "prefill", 1024 if device.type == "cuda" else 128, 64, num_sms=64)


if __name__ == "__main__":
    main()
    runtime.finalize_distributed()
