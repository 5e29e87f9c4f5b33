"""
Tutorial 05: moe_ep inside vLLM
===============================

    bash launch.sh tutorials/05-engines.py

vLLM runs every MoE layer as a "modular kernel": a prepare/finalize object moves tokens to their
experts and back, an experts object computes. Its "batched experts" layout, [E_loc, W * max_tokens, H]
rows with a count per expert, is exactly what ``EPAllToAll.dispatch`` returns, so
``moe_ep.integrations.vllm.MoeEpPrepareAndFinalize`` is a thin layer over it: prepare dispatches
(FP8 with per-128 scales when the experts take block-quantized FP8, the activations' dtype
otherwise), finalize combines straight into vLLM's output tensor.

This tutorial builds vLLM's ``FusedMoEKernel`` from moe_ep's prepare/finalize and
``GroupedGemmExperts`` (moe_ep's grouped GEMM), runs one layer on random tokens and checks it
against the same MoE computed densely on each rank. On GPUs the all-to-all is the NVSHMEM
kernels; without them the reference backend on gloo.

Serving a model (moe_ep installed into the engine's environment with ``pip install --no-deps -e .``, which
leaves the engine and its torch as they are), what the server-side selection builds:

* vLLM 0.33.0: ``vllm serve MODEL --enable-expert-parallel --data-parallel-size N --all2all-backend moe_ep``.
  The package's ``vllm.general_plugins`` entry point runs ``moe_ep.integrations.vllm.register()`` in every
  vLLM process (this tutorial calls it too): ``moe_ep`` becomes a value of ``--all2all-backend``, its layers
  take the batched experts format (``use_batched_activation_format``, shown below), and each MoE layer vLLM
  builds gets what ``make_prepare_finalize`` returns here, a ``MoeEpPrepareAndFinalize`` on vLLM's EP group,
  with the experts vLLM's oracle picks for that format (this tutorial uses ``GroupedGemmExperts``).
* SGLang 0.5.23: ``MOE_EP_SGLANG=nvshmem python -m sglang.launch_server --model-path MODEL --tp N --ep N
  --moe-a2a-backend deepep --deepep-mode low_latency --disable-shared-experts-fusion``.
  The package's ``sglang.srt.plugins`` entry point hooks SGLang's dispatcher factory: the MoE layers that
  would get DeepEP's low-latency dispatcher (``DeepEPMoE``) get ``moe_ep.integrations.sglang.MoeEpDispatcher``,
  whose output is the same layout, so SGLang's experts run on it unchanged.
"""
import os

import torch
import torch.distributed as dist

from moe_ep import runtime

EXPERTS, TOPK, HIDDEN, INTERMEDIATE, TOKENS = 16, 4, 256, 128, 32


def dense_moe(x, w1, w2, topk_ids, topk_weights):
    """sum_k w[t, k] * (silu(gate) * up)(x[t]) @ w2[e].T with all experts here, in fp32."""
    x, w1, w2 = x.float(), w1.float(), w2.float()
    y = torch.zeros_like(x)
    for k in range(topk_ids.shape[1]):
        for e in topk_ids[:, k].unique().tolist():
            rows = topk_ids[:, k] == e
            gate, up = (x[rows] @ w1[e].t()).chunk(2, dim=-1)
            y[rows] += topk_weights[rows, k, None] * ((torch.nn.functional.silu(gate) * up) @ w2[e].t())
    return y


def main():
    device = runtime.init_distributed()
    if device.type != "cuda":
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")    # vLLM's Python modules without its CUDA build
    try:
        import vllm.model_executor.layers.fused_moe.modular_kernel as mk
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.model_executor.layers.fused_moe.config import (FUSED_MOE_UNQUANTIZED_CONFIG, FusedMoEConfig,
                                                                 FusedMoEParallelConfig, RoutingMethodType)

        from moe_ep.integrations import vllm as moe_ep_vllm
    except ImportError as error:
        print(f"vLLM is not installed ({error}); add moe_ep to an environment with vLLM to run this tutorial: skipped")
        return
    moe_ep_vllm.register()                                    # what vLLM's plugin loader runs in every process
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = "nvshmem" if device.type == "cuda" else "reference"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    # A layer's parallel config under --data-parallel-size N --enable-expert-parallel --all2all-backend moe_ep.
    parallel = FusedMoEParallelConfig(tp_size=1, pcp_size=1, dp_size=world, ep_size=world, tp_rank=0, pcp_rank=0,
                                      dp_rank=rank, ep_rank=rank, sp_size=1, use_ep=True,
                                      all2all_backend=moe_ep_vllm.BACKEND_NAME, enable_eplb=False)
    assert parallel.use_batched_activation_format == (world > 1)  # the oracles then pick batched experts
    config = FusedMoEConfig(num_experts=EXPERTS, experts_per_token=TOPK, hidden_dim=HIDDEN,
                            intermediate_size=INTERMEDIATE, num_local_experts=EXPERTS // world,
                            num_logical_experts=EXPERTS, activation=MoEActivation.SILU, device=device,
                            routing_method=RoutingMethodType.Renormalize, moe_parallel_config=parallel,
                            in_dtype=dtype, max_num_tokens=TOKENS)
    # What vLLM's plugin hook builds for a layer when --all2all-backend moe_ep is set (group: vLLM's EP group).
    prepare_finalize = moe_ep_vllm.make_prepare_finalize(config, FUSED_MOE_UNQUANTIZED_CONFIG, backend=backend)
    experts = moe_ep_vllm.GroupedGemmExperts(config, FUSED_MOE_UNQUANTIZED_CONFIG, max_num_tokens=TOKENS,
                                             num_dispatchers=world)
    kernel = mk.FusedMoEKernel(prepare_finalize, experts)

    g = torch.Generator().manual_seed(0)                      # the same weights on every rank
    w1 = (torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=g) / HIDDEN ** 0.5).to(device, dtype)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=g) / INTERMEDIATE ** 0.5).to(device, dtype)
    g.manual_seed(1 + rank)                                   # this rank's tokens and routing
    x = torch.randn(TOKENS, HIDDEN, generator=g).to(device, dtype)
    topk_ids = torch.rand(TOKENS, EXPERTS, generator=g).argsort(dim=1)[:, :TOPK].to(device)
    topk_weights = torch.softmax(torch.randn(TOKENS, TOPK, generator=g), dim=-1).to(device)

    mine = slice(rank * config.num_local_experts, (rank + 1) * config.num_local_experts)
    y = kernel.apply(x, w1[mine], w2[mine], topk_weights, topk_ids, MoEActivation.SILU, EXPERTS, None, False)
    expected = dense_moe(x, w1, w2, topk_ids, topk_weights)
    error = ((y.float() - expected).norm() / expected.norm()).item()
    assert error < (2e-2 if dtype == torch.bfloat16 else 1e-5), error
    print(f"rank {rank}: vLLM's FusedMoEKernel over moe_ep ({backend}) matches the dense MoE "
          f"(relative error {error:.1e}) on {TOKENS} tokens, {EXPERTS} experts over {world} ranks")
    prepare_finalize.ep.destroy()


if __name__ == "__main__":
    main()
    runtime.finalize_distributed()
