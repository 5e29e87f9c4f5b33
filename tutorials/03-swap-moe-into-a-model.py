"""
Tutorial 03: swap expert-parallel MoE blocks into a transformers model
======================================================================

    bash launch.sh tutorials/03-swap-moe-into-a-model.py

``moe_ep.swap_moe(model)`` finds the sparse MoE blocks of a model (a router at ``.gate`` and
experts stored as 3-D ``gate_up_proj`` / ``down_proj`` tensors, the layout transformers uses for
Mixtral, Qwen3-MoE and others) and replaces each with an ``EPMoE`` holding only this rank's
share of the experts. The block's own router is kept, so softmax, top-k and renormalization
stay exactly as the model defines them.

Before it swaps anything, ``swap_moe`` checks each new layer against the block it replaces on a
few random probe tokens (``verify=True``, the default; every rank still holds the whole block
then) and refuses with a ValueError if they differ by more than the rounding of the dtype.

Here every rank builds the same small Qwen3-MoE from a config (no download), generates a few
tokens for its own prompts with the original model and with the swapped one, and checks that
they agree, and prints what the verification cost. On GPUs the swapped model runs the NVSHMEM
kernels in bf16, and one forward of the whole model is timed before and after the swap, and one
layer alone. On CPU (launch.sh falls back to gloo) it runs the reference backend in fp32 and times
no forward: gloo on CPU says nothing about GPU speed.
"""
import copy
import time

import torch
import torch.distributed as dist
import transformers

from moe_ep import EPMoE, runtime, swap_moe
from moe_ep.timing import median_us, why_untimed


def small_qwen3_moe() -> torch.nn.Module:
    torch.manual_seed(0)                      # the same weights on every rank
    config = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_experts=16, num_experts_per_tok=4,
        norm_topk_prob=True, max_position_embeddings=128)
    return transformers.Qwen3MoeForCausalLM(config).eval()


def main():
    device = runtime.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = device.type == "cuda"
    model = small_qwen3_moe().to(device, torch.bfloat16 if cuda else torch.float32)
    prompts = torch.randint(0, 512, (2, 6), generator=torch.Generator().manual_seed(rank)).to(device)
    options = dict(max_tokens=64, backend="nvshmem" if cuda else "reference", fp8_dispatch=False)
    start = time.perf_counter()
    swap_moe(copy.deepcopy(model), verify=False, **options)
    unverified_s = time.perf_counter() - start
    start = time.perf_counter()
    swapped = swap_moe(copy.deepcopy(model), **options)
    verified_s = time.perf_counter() - start
    if rank == 0:
        print(f"swap_moe: {verified_s * 1e3:.0f} ms with verification, {unverified_s * 1e3:.0f} ms without "
              f"(2 MoE blocks, checking costs {(verified_s - unverified_s) * 1e3:.0f} ms)")

    generate = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False)   # the same number of steps on every rank
    with torch.no_grad():
        original = model.generate(prompts, **generate)
        expert_parallel = swapped.generate(prompts, **generate)
    agree = (original == expert_parallel).float().mean().item()
    print(f"rank {rank}: {world} ranks, {swapped.config.num_experts // world} experts per rank and layer; "
          f"generated tokens agree with the single-process model: {agree:.0%}")
    assert agree == 1.0 if not cuda else agree > 0.9, "generation drifted"
    skipped = why_untimed(device)
    if skipped is not None:
        if rank == 0:
            print(f"timing skipped: {skipped}")
        return

    layer = next(m for m in swapped.modules() if isinstance(m, EPMoE))
    x = torch.randn(64, 256, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        before_us = median_us(lambda: model(prompts), 20, 3)
        after_us = median_us(lambda: swapped(prompts), 20, 3)
        layer_us = median_us(lambda: layer(x))
    if rank == 0:
        print(f"one forward of the model over {prompts.numel()} tokens per rank: {before_us:.0f} us before the swap "
              f"(every rank computes every expert), {after_us:.0f} us after ({world} ranks share the experts)")
        print(f"one EPMoE layer, 64 tokens per rank: {layer_us:.1f} us per forward (eager)")


if __name__ == "__main__":
    main()
    runtime.finalize_distributed()
