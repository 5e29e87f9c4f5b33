"""moe_ep inside vLLM's modular MoE kernel, against vLLM's own batched prepare/finalize.

CPU (gloo, reference backend, fp32), 1, 2 and 4 ranks: vLLM's FusedMoEKernel with
MoeEpPrepareAndFinalize and this rank's experts gives, for every rank's tokens, what the same
kernel gives with vLLM's BatchedPrepareAndFinalize and all experts on the rank (no all-to-all),
within fp32 rounding; the per-expert counts are the reference's summed over ranks; both
micro-batch handles; apply_router_weight_on_input; zero tokens on a rank; dropped slots (-1).
The same experts (GroupedGemmExperts: plain torch off the GPU) run on both sides.

GPU (marked gpu): the same comparison with the nvshmem backend and the grouped-GEMM kernels at 2 ranks.
Where vLLM is installed as .ci/run installs it, ``pytest tests/test_vllm.py -m gpu``. A GPU machine without
a package index takes the same files as a folder on PYTHONPATH: every Python file of the vllm 0.33.0
wheel (its compiled extensions are not needed) and, for that machine's Python, the packages .ci/run
adds; then ``PYTHONPATH=FOLDER:$PWD pytest tests/test_vllm.py -m gpu``.
"""
import os
import threading

import pytest
import torch

from cases import moe_layer_inputs
from distributed import run

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")       # vLLM's Python modules without its compiled extensions
pytest.importorskip("vllm")

import vllm.model_executor.layers.fused_moe.modular_kernel as mk  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.model_executor.layers.fused_moe.config import (FUSED_MOE_UNQUANTIZED_CONFIG, FusedMoEConfig,  # noqa: E402
                                                         FusedMoEParallelConfig, FusedMoEQuantConfig,
                                                         RoutingMethodType)
from vllm.model_executor.layers.fused_moe.prepare_finalize.batched import BatchedPrepareAndFinalize  # noqa: E402
from vllm.v1.worker import ubatching  # noqa: E402

from moe_ep.integrations import vllm as moe_ep_vllm  # noqa: E402

EXPERTS, HIDDEN, INTERMEDIATE, MAX_TOKENS = 8, 32, 16, 6


def moe_config(world, rank, topk, hidden=HIDDEN, dtype=torch.float32, local=None, device="cpu") -> FusedMoEConfig:
    parallel = FusedMoEParallelConfig(tp_size=1, pcp_size=1, dp_size=world, ep_size=world, tp_rank=0, pcp_rank=0,
                                      dp_rank=rank, ep_rank=rank, sp_size=1, use_ep=True,
                                      all2all_backend=moe_ep_vllm.BACKEND_NAME, enable_eplb=False)
    local = EXPERTS // world if local is None else local
    return FusedMoEConfig(num_experts=EXPERTS, experts_per_token=topk, hidden_dim=hidden,
                          intermediate_size=INTERMEDIATE, num_local_experts=local, num_logical_experts=EXPERTS,
                          activation=MoEActivation.SILU, device=device, routing_method=RoutingMethodType.Default,
                          moe_parallel_config=parallel, in_dtype=dtype, max_num_tokens=MAX_TOKENS)


def experts(config, quant, world):
    return moe_ep_vllm.GroupedGemmExperts(config, quant, max_num_tokens=MAX_TOKENS, num_dispatchers=world)


def inputs(rank, tokens, topk, drop, hidden=HIDDEN, dtype=torch.float32, device="cpu"):
    return moe_layer_inputs(rank, tokens, topk, drop, EXPERTS, hidden, INTERMEDIATE, dtype, device)


def reference_kernel(topk, hidden=HIDDEN, dtype=torch.float32, device="cpu"):
    """vLLM's batched prepare/finalize with every expert on this rank: the MoE of this rank's tokens alone."""
    config = moe_config(1, 0, topk, hidden, dtype, local=EXPERTS, device=device)
    return mk.FusedMoEKernel(BatchedPrepareAndFinalize(MAX_TOKENS, EXPERTS, 1, 0),
                             experts(config, FUSED_MOE_UNQUANTIZED_CONFIG, 1))


def apply(kernel, w1, w2, x, ids, weights, on_input):
    return kernel.apply(x.clone(), w1, w2, weights, ids, MoEActivation.SILU, EXPERTS, None, on_input)


def _against_batched(rank, world, tokens_per_rank, topk, drop, on_input, backend="reference"):
    """fp32 on CPU (within its rounding); bf16 on the GPU, where both sides' GEMMs round to bf16."""
    gpu = backend == "nvshmem"
    device, dtype, hidden, tolerance = (("cuda", torch.bfloat16, 128, 2e-2) if gpu else
                                        ("cpu", torch.float32, HIDDEN, 1e-5))
    w1, w2, x, ids, weights = inputs(rank, tokens_per_rank[rank], topk, drop, hidden, dtype, device)
    config = moe_config(world, rank, topk, hidden, dtype, device=device)
    prepare_finalize = moe_ep_vllm.make_prepare_finalize(config, None, backend=backend)
    kernel = mk.FusedMoEKernel(prepare_finalize, experts(config, FUSED_MOE_UNQUANTIZED_CONFIG, world))
    mine = slice(rank * config.num_local_experts, (rank + 1) * config.num_local_experts)
    got = apply(kernel, w1[mine], w2[mine], x, ids, weights, on_input)
    expected = apply(reference_kernel(topk, hidden, dtype, device), w1, w2, x, ids, weights, on_input)
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)

    # per-expert counts: this rank's experts' rows from every rank
    args = (x, weights, ids, EXPERTS, None, False, FUSED_MOE_UNQUANTIZED_CONFIG)
    counts = prepare_finalize.prepare(*args)[2].expert_num_tokens
    all_counts = BatchedPrepareAndFinalize(MAX_TOKENS, EXPERTS, 1, 0).prepare(*args)[2].expert_num_tokens
    torch.distributed.all_reduce(all_counts)
    assert counts.tolist() == all_counts[mine].tolist()
    assert moe_ep_vllm.all_to_all(MAX_TOKENS, hidden, EXPERTS, topk, dtype, False, None, backend) \
        is prepare_finalize.ep                       # one EPAllToAll per shape, shared


# Per world size, cases of (tokens per rank, top-k, dropped slots, apply_router_weight_on_input), run in one
# set of processes (each imports vLLM once).
CASES = {
    1: [((5,), 2, False, False), ((1,), 1, True, True)],
    2: [((6, 3), 2, True, False),
        ((0, 4), 3, False, False),                    # zero tokens on a rank
        ((1, 6), 1, True, True)],                     # one token; router weights on the input
    4: [((2, 0, 6, 5), 2, True, False)],
}


def _cases(rank, world):
    for tokens, topk, drop, on_input in CASES[world]:
        _against_batched(rank, world, tokens, topk, drop, on_input)


@pytest.mark.parametrize("world", sorted(CASES))
def test_kernel_matches_batched_prepare_finalize(world):
    run(_cases, world)


def _micro_batches(rank, world):
    """Two micro-batches in flight: dispatch both, then finalize in the other order; each uses its own handle."""
    topk = 2
    config = moe_config(world, rank, topk)
    prepare_finalize = moe_ep_vllm.make_prepare_finalize(config, None, backend="reference")
    gemm = experts(config, FUSED_MOE_UNQUANTIZED_CONFIG, world)
    mine = slice(rank * config.num_local_experts, (rank + 1) * config.num_local_experts)
    batches = [inputs(rank + 10 * b, 3 + b, topk, drop=b == 1) for b in range(2)]
    expected = [apply(reference_kernel(topk), w1, w2, x, ids, weights, False) for w1, w2, x, ids, weights in batches]
    thread = threading.get_ident()
    pending = []
    try:
        for b, (w1, w2, x, ids, weights) in enumerate(batches):
            ubatching._THREAD_ID_TO_CONTEXT[thread] = b          # what vLLM's micro-batch threads see
            hook, receiver = prepare_finalize.prepare_async(x, weights, ids, EXPERTS, None, False,
                                                            FUSED_MOE_UNQUANTIZED_CONFIG)
            pending.append((hook, receiver))
        assert prepare_finalize.handles[0] is not prepare_finalize.handles[1]
        outputs = []
        for (hook, receiver), (w1, w2, x, ids, weights) in zip(pending, batches):
            hook()
            recv_x, scales, meta, _, _ = receiver()
            out = torch.empty_like(recv_x)
            gemm.apply(out, recv_x, w1[mine], w2[mine], weights, ids, MoEActivation.SILU, EXPERTS, None, scales,
                       None, None, None, meta, False)
            outputs.append(out)
        for b in (1, 0):
            w1, w2, x, ids, weights = batches[b]
            ubatching._THREAD_ID_TO_CONTEXT[thread] = b
            y = torch.empty_like(x)
            hook, receiver = prepare_finalize.finalize_async(y, outputs[b], weights, ids, False,
                                                             gemm.finalize_weight_and_reduce_impl())
            hook()
            receiver()
            torch.testing.assert_close(y, expected[b], rtol=1e-5, atol=1e-5)
    finally:
        ubatching._THREAD_ID_TO_CONTEXT.pop(thread, None)


def test_both_micro_batch_handles():
    run(_micro_batches, 2)


def _fp8_dispatch(rank, world):
    """A config asking for FP8 activations in 128-wide blocks dispatches FP8 with per-128 scales."""
    topk, hidden = 2, 128
    quant = FusedMoEQuantConfig.make(quant_dtype=torch.float8_e4m3fn, block_shape=[128, 128])
    config = moe_config(world, rank, topk, hidden=hidden)
    prepare_finalize = moe_ep_vllm.make_prepare_finalize(config, quant, backend="reference")
    w1, w2, x, ids, weights = inputs(rank, 5, topk, drop=True, hidden=hidden)
    recv_x, scales, meta, _, _ = prepare_finalize.prepare(x, weights, ids, EXPERTS, None, False, quant)
    assert recv_x.dtype == torch.float8_e4m3fn
    assert scales.shape == (*recv_x.shape[:2], hidden // 128) and scales.dtype == torch.float32
    mine = slice(rank * config.num_local_experts, (rank + 1) * config.num_local_experts)
    out = torch.empty(recv_x.shape, dtype=torch.float32)
    gemm = experts(config, FUSED_MOE_UNQUANTIZED_CONFIG, world)
    gemm.apply(out, recv_x, w1[mine], w2[mine], weights, ids, MoEActivation.SILU, EXPERTS, None, scales, None,
               None, None, meta, False)
    y = torch.empty_like(x)
    prepare_finalize.finalize(y, out, weights, ids, False, gemm.finalize_weight_and_reduce_impl())
    expected = apply(reference_kernel(topk, hidden), w1, w2, x, ids, weights, False)
    assert (y - expected).norm() <= 0.05 * expected.norm()       # FP8 e4m3 rounding of the inputs


def test_fp8_dispatch():
    run(_fp8_dispatch, 2)


def _refusals(rank, world):
    config = moe_config(world, rank, 2)
    with pytest.raises(ValueError, match="EPLB"):
        moe_ep_vllm.make_prepare_finalize(config, None, routing_tables=(None, None, None), backend="reference")
    with pytest.raises(ValueError, match="linear expert placement"):
        moe_ep_vllm.make_prepare_finalize(config, None, backend="reference", placement="round_robin")
    with pytest.raises(ValueError, match="FP8 e4m3 in blocks of 128"):
        moe_ep_vllm.make_prepare_finalize(config, FusedMoEQuantConfig.make(quant_dtype=torch.float8_e4m3fn,
                                                                           per_act_token_quant=True),
                                          backend="reference")
    prepare_finalize = moe_ep_vllm.make_prepare_finalize(config, None, backend="reference")
    w1, w2, x, ids, weights = inputs(rank, 3, 2, drop=False)
    round_robin = torch.full((EXPERTS,), -1, dtype=torch.int32)
    round_robin[rank::world] = torch.arange(EXPERTS // world, dtype=torch.int32)
    with pytest.raises(ValueError, match="expert map"):
        prepare_finalize.prepare(x, weights, ids, EXPERTS, round_robin, False, FUSED_MOE_UNQUANTIZED_CONFIG)
    with pytest.raises(ValueError, match="top-k 1"):
        prepare_finalize.prepare(x, weights, ids, EXPERTS, None, True, FUSED_MOE_UNQUANTIZED_CONFIG)

    class UE8M0Experts(moe_ep_vllm.GroupedGemmExperts):
        def supports_packed_ue8m0_act_scales(self):
            return True
    quant = FusedMoEQuantConfig.make(quant_dtype=torch.float8_e4m3fn, block_shape=[128, 128])
    fp8 = moe_ep_vllm.make_prepare_finalize(moe_config(world, rank, 2, hidden=128), quant, backend="reference")
    with pytest.raises(ValueError, match="UE8M0"):
        mk.FusedMoEKernel(fp8, UE8M0Experts(config, quant, max_num_tokens=MAX_TOKENS, num_dispatchers=world))


def test_refuses_what_it_cannot_honour():
    run(_refusals, 2)


def test_plugin_registers_the_backend():
    """register() (the vllm.general_plugins entry point) makes moe_ep a valid --all2all-backend and routes
    vLLM's prepare/finalize factory, in every module that holds it, through moe_ep."""
    import subprocess
    import sys
    import tomllib
    from pathlib import Path
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["vllm.general_plugins"] == {"moe_ep": "moe_ep.integrations.vllm:register"}
    code = """
from moe_ep.integrations import vllm as plugin
from vllm.config.parallel import ParallelConfig
from vllm.model_executor.layers.fused_moe import all2all_utils
from vllm.model_executor.layers.fused_moe.oracle import unquantized
plugin.register(); plugin.register()
assert ParallelConfig(all2all_backend="moe_ep").all2all_backend == "moe_ep"
assert all2all_utils.maybe_make_prepare_finalize is unquantized.maybe_make_prepare_finalize
assert all2all_utils.maybe_make_prepare_finalize.__module__ == plugin.__name__
try:
    ParallelConfig(all2all_backend="no_such_backend")
except Exception as error:
    print("refused", type(error).__name__)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ | {
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "refused" in out.stdout


def _grouped_gemm_on_nvshmem(rank, world):
    _against_batched(rank, world, (6, 2), 2, True, False, backend="nvshmem")


@pytest.mark.gpu
def test_nvshmem_kernel_matches_batched_prepare_finalize():
    run(_grouped_gemm_on_nvshmem, 2, gpu=True)
