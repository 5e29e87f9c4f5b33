"""moe_ep inside vLLM: the layers vLLM builds, its dual-batch overlap, and its modular MoE kernel
against vLLM's own batched prepare/finalize.

CPU (gloo, reference backend), 2 ranks: FusedMoEFactory called as model code calls it under vLLM's config
(--all2all-backend moe_ep, expert parallelism) and distributed state, with the plugin registered: its
quantization method, the kernel oracle (which picks batched experts for moe_ep) and FusedMoEKernel over
MoeEpPrepareAndFinalize, unquantized (hidden 36, padded to 128) and FP8 [128, 128] weight blocks with per-128
activations (hidden 2880, padded to 2944), forward against a plain-torch MoE. Dual-batch overlap: two
micro-batch threads with vLLM's UBatchContexts through that layer's kernel, the dispatch's receive held
back until its hook runs, so a finalize that does not run the other micro-batch's pending hook fails;
each micro-batch keeps its own handle.
_stand_ins names the plain-torch stand-ins for what vLLM's CPU platform lacks.

CPU, 1, 2 and 4 ranks: vLLM's FusedMoEKernel with MoeEpPrepareAndFinalize and this rank's experts gives,
for every rank's tokens, what the same kernel gives with vLLM's BatchedPrepareAndFinalize and all experts
on the rank (no all-to-all), within fp32 rounding; the per-expert counts are the reference's summed over
ranks; apply_router_weight_on_input; zero tokens on a rank; dropped slots (-1).
The same experts (GroupedGemmExperts: plain torch off the GPU) run on both sides. FP8 dispatch, and payload
"fp8_ue8m0" (int32 scales, MN-major) for experts that take packed UE8M0 scales, whose layers build no "fp8"
all-to-all. Also what is refused.

Elastic mode (CPU): make_prepare_finalize(..., elastic=True) builds the shared all-to-all elastic; a
simulated world of 3 ranks (EPAllToAll.simulated, kernels in the Triton interpreter) through
MoeEpPrepareAndFinalize, where a rank stops answering: the others' finalize completes after one timeout
without its experts, lost() reports them, later calls wait for nothing. Under --enable-fault-tolerance
(2 ranks, vLLM's state): the EP group's manager (MoeEpAll2AllManager) answers vLLM's fault-tolerance
queries from the all-to-alls' masks and refuses a retry after a lost rank; the plugin refuses the reference
backend there and asks the nvshmem one for elastic all-to-alls; vLLM's fault tolerance accepts the backend.

GPU (marked gpu): the same with the nvshmem backend at 2 ranks (bf16). Where vLLM is installed as .ci/run
installs it, ``pytest tests/test_vllm.py -m gpu``. A GPU machine without a package index takes the same
files as a folder on PYTHONPATH: every Python file of the vllm 0.33.0 wheel (its compiled extensions are
not needed) and, for that machine's Python, the packages .ci/run adds; then
``PYTHONPATH=FOLDER:$PWD pytest tests/test_vllm.py -m gpu``.
"""
import contextlib
import os
import threading
import time

import pytest
import torch

from cases import expected_combine, expert_fn, make_inputs, moe_layer_inputs, on_ranks
from distributed import run, waited_once

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")       # vLLM's Python modules without its compiled extensions
pytest.importorskip("vllm")

import vllm.model_executor.layers.fused_moe.modular_kernel as mk  # noqa: E402
from vllm.model_executor.layers.fused_moe.activation import MoEActivation  # noqa: E402
from vllm.model_executor.layers.fused_moe.config import (FUSED_MOE_UNQUANTIZED_CONFIG, FusedMoEConfig,  # noqa: E402
                                                         FusedMoEParallelConfig, FusedMoEQuantConfig,
                                                         RoutingMethodType)
from vllm.model_executor.layers.fused_moe.prepare_finalize.batched import BatchedPrepareAndFinalize  # noqa: E402
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceDelegate  # noqa: E402
from vllm.v1.worker import ubatching  # noqa: E402

from moe_ep import integrations  # noqa: E402
from moe_ep.ep import EPAllToAll, EPHandle  # noqa: E402
from moe_ep.formats import FORMATS  # noqa: E402
from moe_ep.integrations import vllm as moe_ep_vllm  # noqa: E402
from moe_ep.reference import quantize_fp8  # noqa: E402

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


def experts_for(experts_class, config, quant, prepare_finalize):
    """Experts sized as vLLM's oracles size them: by the prepare/finalize's max_num_tokens_per_rank() and
    num_dispatchers(), asked before FusedMoEKernel's post_init_setup (which must build nothing yet)."""
    return experts_class(config, quant, max_num_tokens=prepare_finalize.max_num_tokens_per_rank(),
                         num_dispatchers=prepare_finalize.num_dispatchers())


class UE8M0Experts(moe_ep_vllm.GroupedGemmExperts):
    """Experts that say they take packed UE8M0 activation scales (as vLLM's DeepGEMM experts do on Blackwell)."""

    def supports_packed_ue8m0_act_scales(self):
        return True


def _ue8m0_dispatch(rank, world):
    """Experts that take packed UE8M0 scales get payload "fp8_ue8m0": int32 scales [E_loc, W * T_max, H / 512],
    MN-major, decoding to the rows "fp8" sends (within both roundings)."""
    topk, hidden = 2, 512
    quant = FusedMoEQuantConfig.make(quant_dtype=torch.float8_e4m3fn, block_shape=[128, 128])
    config = moe_config(world, rank, topk, hidden=hidden)
    prepare_finalize = moe_ep_vllm.make_prepare_finalize(config, quant, backend="reference")
    mk.FusedMoEKernel(prepare_finalize, experts_for(UE8M0Experts, config, quant, prepare_finalize))
    ep = prepare_finalize.ep
    assert ep.payload.name == "fp8_ue8m0" and ep is moe_ep_vllm.all_to_all(
        MAX_TOKENS, hidden, EXPERTS, topk, torch.float32, backend="reference", payload="fp8_ue8m0")
    fp8 = moe_ep_vllm.all_to_all(MAX_TOKENS, hidden, EXPERTS, topk, torch.float32, True, None, "reference")
    w1, w2, x, ids, weights = inputs(rank, 5, topk, drop=True, hidden=hidden)
    recv_x, scales, meta, _, _ = prepare_finalize.prepare(x, weights, ids, EXPERTS, None, False, quant)
    rows = world * MAX_TOKENS
    assert recv_x.dtype == torch.float8_e4m3fn and scales.dtype == torch.int32
    assert scales.shape == (EXPERTS // world, rows, hidden // 512)
    assert scales.stride() == (rows * hidden // 512, 1, rows)
    fp8_x, fp8_scales, fp8_meta, _, _ = moe_ep_vllm.MoeEpPrepareAndFinalize(fp8).prepare(
        x, weights, ids, EXPERTS, None, False, quant)
    assert torch.equal(meta.expert_num_tokens, fp8_meta.expert_num_tokens)
    for e, count in enumerate(meta.expert_num_tokens.tolist()):
        got = FORMATS["fp8_ue8m0"].dequantize(recv_x[e, :count], scales[e, :count])
        sent = FORMATS["fp8"].dequantize(fp8_x[e, :count], fp8_scales[e, :count])
        assert (got - sent).norm() <= 0.1 * sent.norm()              # two e4m3 roundings of the same rows


def _ue8m0_layers_build_one_all_to_all(rank, world):
    """vLLM builds a layer's prepare/finalize before it chooses the experts: layers whose experts want packed
    UE8M0 scales build the "fp8_ue8m0" all-to-all of their shape alone (no "fp8" one holding symmetric buffers
    for nothing), all of them the same one; layers of that shape whose experts take "fp8" share the "fp8" one."""
    hidden = 1024
    quant = FusedMoEQuantConfig.make(quant_dtype=torch.float8_e4m3fn, block_shape=[128, 128])
    config = moe_config(world, rank, 2, hidden=hidden)

    def layer(experts_class):
        prepare_finalize = moe_ep_vllm.make_prepare_finalize(config, quant, backend="reference")
        mk.FusedMoEKernel(prepare_finalize, experts_for(experts_class, config, quant, prepare_finalize))
        return prepare_finalize.ep

    def built():
        return sorted(ep.payload.name for ep in integrations._ALL_TO_ALLS.values() if ep.hidden == hidden)
    ue8m0 = [layer(UE8M0Experts) for _ in range(2)]
    assert ue8m0[0] is ue8m0[1] and ue8m0[0].payload.name == "fp8_ue8m0"
    assert built() == ["fp8_ue8m0"]
    fp8 = [layer(moe_ep_vllm.GroupedGemmExperts) for _ in range(2)]
    assert fp8[0] is fp8[1] and fp8[0].payload.name == "fp8"
    assert built() == ["fp8", "fp8_ue8m0"]


def test_ue8m0_layers_build_one_all_to_all():
    run(_ue8m0_layers_build_one_all_to_all, 2)


def _fp8_dispatches(rank, world):
    _fp8_dispatch(rank, world)
    _ue8m0_dispatch(rank, world)


def test_fp8_dispatch():
    run(_fp8_dispatches, 2)


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

    with pytest.raises(ValueError, match="these experts ask for torch.bfloat16"):
        moe_ep_vllm.make_prepare_finalize(config, None, backend="reference", input_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="monolithic"):
        moe_ep_vllm.make_prepare_finalize(config, None, backend="reference", use_monolithic=True)
    recv_x = prepare_finalize.prepare(x, weights, ids, EXPERTS, None, False, FUSED_MOE_UNQUANTIZED_CONFIG)[0]
    reduce = moe_ep_vllm.GroupedGemmExperts.finalize_weight_and_reduce_impl(None)
    with pytest.raises(ValueError, match="differ from those its prepare sent"):
        prepare_finalize.finalize(torch.empty_like(x), recv_x, weights * 2, ids, False, reduce)
    prepare_finalize.finalize(torch.empty_like(x), recv_x, weights.clone(), ids, False, reduce)   # equal: taken

    quant = FusedMoEQuantConfig.make(quant_dtype=torch.float8_e4m3fn, block_shape=[128, 128])
    fp8 = moe_ep_vllm.make_prepare_finalize(moe_config(world, rank, 2, hidden=128), quant, backend="reference")
    with pytest.raises(ValueError, match="payload 'fp8_ue8m0'.*hidden=128 is not a multiple of 512"):
        mk.FusedMoEKernel(fp8, UE8M0Experts(config, quant, max_num_tokens=MAX_TOKENS, num_dispatchers=world))
    alone = moe_ep_vllm.MoeEpPrepareAndFinalize(moe_ep_vllm.all_to_all(MAX_TOKENS, 512, EXPERTS, 2, torch.float32,
                                                                       True, None, "reference"))
    with pytest.raises(ValueError, match="payload 'fp8_ue8m0'.*its 'fp8' all-to-all only"):
        mk.FusedMoEKernel(alone, UE8M0Experts(config, quant, max_num_tokens=MAX_TOKENS, num_dispatchers=world))
    with pytest.raises(ValueError, match="takes an EPAllToAll, or of_payload and the layer's moe config"):
        moe_ep_vllm.MoeEpPrepareAndFinalize(of_payload=lambda payload: alone.ep)
    nvfp4 = moe_ep_vllm.all_to_all(MAX_TOKENS, HIDDEN, EXPERTS, 2, torch.float32, backend="reference",
                                   payload="nvfp4")
    not_carried = (r"payload format 'nvfp4' needs a per-tensor scale at each dispatch \(tensor_scale\), which "
                   "moe_ep does not carry through vLLM's prepare yet")
    with pytest.raises(ValueError, match=not_carried):
        moe_ep_vllm.MoeEpPrepareAndFinalize(nvfp4)
    with pytest.raises(ValueError, match=not_carried):
        moe_ep_vllm.MoeEpPrepareAndFinalize(of_payload=lambda payload: nvfp4, payload="nvfp4", moe=config)
    with pytest.raises(ValueError, match=not_carried):
        prepare_finalize.ep = nvfp4
    assert prepare_finalize.ep.payload.name == "fp32"            # kept its own
    for asked, quant in (("mxfp8", FusedMoEQuantConfig.make(quant_dtype="mxfp8")),
                         ("float8_e4m3fn", FusedMoEQuantConfig.make(quant_dtype=torch.float8_e4m3fn,
                                                                    block_shape=[128, 64]))):
        with pytest.raises(ValueError, match=f"asks for '{asked}' activations"):
            moe_ep_vllm.make_prepare_finalize(config, quant, backend="reference")


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
import importlib
from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig
for target, version in plugin.PATCH_POINTS.values():
    module, attribute = target.split(":")
    owner = importlib.import_module(module)
    for name in attribute.split("."):
        owner = owner.__dict__["__dataclass_fields__"][name] if name == "all2all_backend" else getattr(owner, name)
    assert version == plugin.VLLM_VERSION, target
originals = (FusedMoEParallelConfig.use_batched_activation_format, all2all_utils.maybe_roundup_layer_hidden_size)
plugin.register(); plugin.register()
parallel = dict(tp_size=1, pcp_size=1, dp_size=2, ep_size=2, tp_rank=0, pcp_rank=0, dp_rank=0, ep_rank=0, sp_size=1,
                use_ep=True, enable_eplb=False)
ours, deepep_ht = (FusedMoEParallelConfig(all2all_backend=name, **parallel)
                   for name in ("moe_ep", "deepep_high_throughput"))
assert ours.use_batched_activation_format and not deepep_ht.use_batched_activation_format
without_ep = FusedMoEParallelConfig(all2all_backend="moe_ep", **parallel | dict(use_ep=False))
assert not without_ep.use_batched_activation_format
assert all2all_utils.maybe_roundup_layer_hidden_size(2880, None, ours) == 2944
assert all2all_utils.maybe_roundup_layer_hidden_size(4096, None, ours) == 4096
assert originals[0] is not FusedMoEParallelConfig.use_batched_activation_format
assert ParallelConfig(all2all_backend="moe_ep").all2all_backend == "moe_ep"
assert all2all_utils.maybe_make_prepare_finalize is unquantized.maybe_make_prepare_finalize
assert all2all_utils.maybe_make_prepare_finalize.__module__ == plugin.__name__
from types import SimpleNamespace
from vllm.v1.worker.sentinel.gpu_worker_sentinel import WorkerSentinel
worker = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_rank=0, data_parallel_size=2,
                                                         data_parallel_master_ip="", all2all_backend="moe_ep"))
WorkerSentinel(worker)                  # vLLM's fault tolerance takes the backend
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


# ------------------------------------------------------------------ the layer as vLLM's model code builds it
# vLLM's construction path at 2 ranks: its config with --all2all-backend moe_ep and expert parallelism, its
# distributed state on the test's process group, the plugin registered, FusedMoEFactory as model code calls
# it (quantization method, kernel oracle, FusedMoEKernel), weights where the checkpoint loader writes them,
# and the layer's forward, against a plain-torch MoE of the same weights and router.

_stand_in_library = None


def _stand_ins():
    """Plain-torch stand-ins, in this process, for what vLLM's Python modules cannot run here. vLLM's
    platform is the CPU (VLLM_TARGET_DEVICE=cpu: the wheel's compiled extension, built for its own CUDA
    torch, is not loaded), and on this platform:
    * torch.ops._C.silu_and_mul, a kernel of that compiled extension: out = silu(gate) * up.
    * fused_batched_moe._is_capturing_or_compiling asks torch.accelerator for the current stream, which a
      CPU-only torch refuses: nothing is captured in these tests.
    * the oracles' batched Triton experts (BatchedTritonExperts) claim CUDA platforms only: the backend
      yields vLLM's NaiveBatchedExperts, its plain-torch experts of the same batched format and
      quantization, on any device."""
    global _stand_in_library
    from vllm.model_executor.layers.fused_moe.experts import fused_batched_moe
    from vllm.model_executor.layers.fused_moe.oracle import fp8, unquantized
    if _stand_in_library is not None:
        return
    _stand_in_library = torch.library.Library("_C", "FRAGMENT")
    _stand_in_library.define("silu_and_mul(Tensor! out, Tensor input) -> ()")
    _stand_in_library.impl("silu_and_mul", _silu_and_mul, "CompositeExplicitAutograd")
    fused_batched_moe._is_capturing_or_compiling = lambda: False

    class NaiveBatchedExpertsAnywhere(fused_batched_moe.NaiveBatchedExperts):
        _supports_current_device = staticmethod(lambda: True)
        _supports_no_act_and_mul = staticmethod(lambda: False)
        _supports_quant_scheme = staticmethod(lambda weight_key, activation_key: True)
        _supports_activation = staticmethod(lambda activation: activation == MoEActivation.SILU)
        _supports_parallel_config = staticmethod(lambda parallel: True)

    for oracle, batched in ((unquantized, unquantized.UnquantizedMoeBackend.BATCHED_TRITON),
                            (fp8, fp8.Fp8MoeBackend.BATCHED_TRITON)):
        oracle.backend_to_kernel_cls = _yielding(oracle.backend_to_kernel_cls, batched, NaiveBatchedExpertsAnywhere)


def _silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    gate, up = x.chunk(2, dim=-1)
    out.copy_(torch.nn.functional.silu(gate) * up)


def _yielding(backend_to_kernel_cls, backend, experts_cls):
    return lambda b: [experts_cls] if b == backend else backend_to_kernel_cls(b)


@contextlib.contextmanager
def vllm_state(rank, world, backend):
    """vLLM's config (--data-parallel-size world --enable-expert-parallel --all2all-backend moe_ep, the
    oracles pointed at their Triton experts, batched for moe_ep, with --moe-backend triton) and its
    distributed state on this process group, the plugin registered, BACKEND_VARIABLE naming `backend`."""
    from vllm.config import KernelConfig, ParallelConfig, SchedulerConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    _stand_ins()
    moe_ep_vllm.register()
    os.environ[moe_ep_vllm.BACKEND_VARIABLE] = backend
    config = VllmConfig(
        parallel_config=ParallelConfig(data_parallel_size=world, data_parallel_rank=rank, enable_expert_parallel=True,
                                       all2all_backend="moe_ep", distributed_executor_backend="external_launcher"),
        kernel_config=KernelConfig(moe_backend="triton"),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=MAX_TOKENS, max_num_seqs=MAX_TOKENS,
                                         max_model_len=MAX_TOKENS, is_encoder_decoder=False))
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=world, rank=rank, backend="gloo", distributed_init_method="env://")
        initialize_model_parallel(1, 1)
        yield config


def build_layer(world, rank, hidden, fp8, dtype, device, name):
    """FusedMoEFactory(...) as model code calls it (renormalized softmax top-2 router) on `device`, and
    weights written where the checkpoint loader writes them: (layer, w13 [E, 2I, hidden], w2 [E, hidden,
    I] in fp32, the dequantized FP8 blocks when `fp8`), the same on every rank."""
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    intermediate = 128 if fp8 else INTERMEDIATE                      # whole [128, 128] weight blocks
    quant = Fp8Config(activation_scheme="dynamic", weight_block_size=[128, 128]) if fp8 else None
    with torch.device(device):
        layer = FusedMoEFactory(num_experts=EXPERTS, top_k=2, hidden_size=hidden, intermediate_size=intermediate,
                                params_dtype=dtype, quant_config=quant, prefix=f"model.layers.{name}.mlp.experts")
    experts = layer.routed_experts
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(EXPERTS, 2 * intermediate, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(EXPERTS, hidden, intermediate, generator=g) / intermediate ** 0.5
    mine = slice(rank * EXPERTS // world, (rank + 1) * EXPERTS // world)
    padded = experts.w13_weight.shape[-1]
    for param, w in (("w13", w13), ("w2", w2)):
        w = torch.nn.functional.pad(w, (0, padded - hidden) if param == "w13" else (0, 0, 0, padded - hidden))
        if fp8:
            w, scales = _fp8_blocks(w)
            getattr(experts, f"{param}_weight_scale_inv").data.copy_(scales[mine])
        getattr(experts, f"{param}_weight").data.copy_(w[mine])
    if fp8:
        w13, w2 = (_dequantized(t, hidden) for t in (w13, w2))
    experts.quant_method.process_weights_after_loading(experts)
    return layer, w13.to(device), w2.to(device)


def _fp8_blocks(w: torch.Tensor):
    """w [E, N, K] -> (FP8 e4m3 [E, N, K], fp32 scales [E, N / 128, K / 128]): one scale per 128 x 128 block."""
    e, n, k = w.shape
    blocks = w.reshape(e, n // 128, 128, k // 128, 128).transpose(2, 3).reshape(e * n // 128 * k // 128, 128 * 128)
    q, scales = quantize_fp8(blocks, 128 * 128)
    q = q.reshape(e, n // 128, k // 128, 128, 128).transpose(2, 3).reshape(e, n, k)
    return q, scales.reshape(e, n // 128, k // 128)


def _dequantized(w: torch.Tensor, hidden: int) -> torch.Tensor:
    """The weights the FP8 experts compute with: w's FP8 blocks, dequantized (hidden padded to 128s, cut back)."""
    padded = -(-hidden // 128) * 128
    pad = (0, padded - hidden) if w.shape[-1] == hidden else (0, 0, 0, padded - hidden)
    q, scales = _fp8_blocks(torch.nn.functional.pad(w, pad))
    blocks = scales.repeat_interleave(128, 1).repeat_interleave(128, 2)
    full = q.float() * blocks
    return full[..., :hidden] if w.shape[-1] == hidden else full[:, :hidden]


def plain_moe(x, logits, w13, w2):
    """The MoE in plain fp32 torch: softmax router, top-2, renormalized; silu(gate) * up, then down."""
    weights, ids = torch.softmax(logits.float(), dim=-1).topk(2, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for k in range(ids.shape[1]):
        for e in ids[:, k].unique().tolist():
            rows = ids[:, k] == e
            gate, up = (x[rows].float() @ w13[e].t()).chunk(2, dim=-1)
            y[rows] += weights[rows, k, None] * ((torch.nn.functional.silu(gate) * up) @ w2[e].t())
    return y


def _engine_built_layers(rank, world, backend="reference"):
    """Unquantized fp32 (hidden 36, padded to 128) and FP8 [128, 128] weight blocks with per-128 activations
    (hidden 2880, padded to 2944), each from FusedMoEFactory under vLLM's state, against plain_moe."""
    from vllm.forward_context import set_forward_context

    gpu = backend == "nvshmem"
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    with vllm_state(rank, world, backend) as config:
        for name, (hidden, fp8, tolerance) in enumerate(((36, False, 2e-2 if gpu else 1e-5), (2880, True, 0.06))):
            layer, w13, w2 = build_layer(world, rank, hidden, fp8, dtype, device, name)
            kernel = layer.routed_experts.quant_method.moe_kernel
            assert isinstance(kernel.prepare_finalize, moe_ep_vllm.MoeEpPrepareAndFinalize)
            assert layer.moe_config.hidden_dim == -(-hidden // 128) * 128
            assert kernel.prepare_finalize.ep.fp8_group == (128 if fp8 else None)
            g = torch.Generator().manual_seed(rank)
            x = torch.randn(MAX_TOKENS - rank, hidden, generator=g).to(device, dtype)
            logits = torch.randn(x.shape[0], EXPERTS, generator=g).to(device)
            with set_forward_context(None, config):
                y = layer(x, logits)
            expected = plain_moe(x, logits, w13, w2)
            assert y.shape == x.shape
            assert (y.float() - expected).norm() <= tolerance * expected.norm(), (name, hidden, fp8)


def test_layers_vllm_builds():
    run(_engine_built_layers, 2)


class DeferredReceive:
    """A test's EPAllToAll: the reference backend with its dispatch's receive moved into the receive hook,
    as the nvshmem backend has it, so a receive out of vLLM's order is seen: until the hook runs, the
    outputs are unwritten and the handle says so (combine refuses it)."""

    def __init__(self, ep):
        self.ep = ep

    def __getattr__(self, name):
        return getattr(self.ep, name)

    def dispatch(self, x, topk_ids, topk_weights, return_recv_hook=False):
        if not return_recv_hook:
            return self.ep.dispatch(x, topk_ids, topk_weights)
        ep = self.ep
        rows = (ep.experts_per_rank, ep.world * ep.max_tokens)
        recv_x = torch.full((*rows, ep.hidden), float("nan"), dtype=ep.dtype)
        recv_count = torch.zeros(rows[0], dtype=torch.int32)
        handle = EPHandle(-1, -1, x.shape[0], topk_ids, torch.empty(0))

        def hook():
            received_x, _, received_count, received = ep.dispatch(x, topk_ids, topk_weights)
            recv_x.copy_(received_x)
            recv_count.copy_(received_count)
            for name in EPHandle.__slots__:
                setattr(handle, name, getattr(received, name))
        return recv_x, None, recv_count, handle, hook


def _dual_batch_overlap(rank, world, backend="reference"):
    """vLLM's dual-batch overlap around the kernel of a layer vLLM built: two micro-batch threads with
    vLLM's UBatchContexts, each running FusedMoEKernel.apply, which registers every receive hook with
    the other micro-batch and yields to it (dbo_register_recv_hook, dbo_yield); the receive really
    happens in the hook (DeferredReceive on CPU, the nvshmem backend's own on a GPU)."""
    from vllm.forward_context import get_forward_context, set_forward_context

    gpu = backend == "nvshmem"
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    with vllm_state(rank, world, backend) as config:
        hidden = 128                                                  # a multiple of 128: not padded
        layer, w13, w2 = build_layer(world, rank, hidden, False, dtype, device, "dbo")
        experts = layer.routed_experts
        kernel = experts.quant_method.moe_kernel
        if not gpu:
            kernel.prepare_finalize.ep = DeferredReceive(kernel.prepare_finalize.ep)
        batches = [inputs(rank + 10 * b, 3 + b, 2, b == 1, hidden, dtype, device)[2:]    # (x, ids, weights)
                   for b in range(ubatching._NUM_UBATCHES)]
        outputs = [None] * len(batches)

        def micro_batch(context, x, ids, weights):
            with context:
                outputs[context.id] = kernel.apply(x, experts.w13_weight, experts.w2_weight, weights, ids,
                                                   MoEActivation.SILU, EXPERTS, None, False)
        with set_forward_context(None, config):
            contexts = _ubatch_contexts(get_forward_context())
        threads = [threading.Thread(target=micro_batch, args=(c, *batch)) for c, batch in zip(contexts, batches)]
        for thread in threads:
            thread.start()
        contexts[0].ready_barrier.wait()
        contexts[0].cpu_wait_event.set()
        for thread in threads:
            thread.join()
        for (x, ids, weights), y in zip(batches, outputs):
            expected = apply(reference_kernel(2, hidden, dtype, device), w13.to(dtype), w2.to(dtype), x, ids, weights,
                             False)
            torch.testing.assert_close(y, expected, rtol=2e-2 if gpu else 1e-5, atol=2e-2 if gpu else 1e-5)


def _ubatch_contexts(forward_context):
    """vLLM's UBatchContexts of two micro-batches as make_ubatch_contexts makes them, on vLLM's (CPU
    platform's) current stream and without its device events, which only stream switches record."""
    count = ubatching._NUM_UBATCHES
    stream = None
    barrier = threading.Barrier(count + 1)
    events = [threading.Event() for _ in range(count)]
    ubatching._CURRENT_CONTEXTS[:] = [None] * count
    return [ubatching.UBatchContext(i, stream, stream, forward_context, barrier, events[i], events[(i + 1) % count],
                                    None, None) for i in range(count)]


def test_dual_batch_overlap_order():
    run(_dual_batch_overlap, 2, timeout=120)


@pytest.mark.gpu
def test_nvshmem_layers_vllm_builds():
    run(_engine_built_layers, 2, "nvshmem", gpu=True)


@pytest.mark.gpu
def test_nvshmem_dual_batch_overlap_order():
    run(_dual_batch_overlap, 2, "nvshmem", gpu=True, timeout=300)


# ------------------------------------------------------------------ elastic mode

INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="runs the kernels in the Triton interpreter, on CPU-only machines")
# A simulated world: its shape, the FP8 group of its dispatch, its bound of every wait.
SIMULATED = dict(world=3, max_tokens=5, hidden=128, num_experts=12, topk=3)
GROUP, TIMEOUT_S = 64, 4.0


def test_make_prepare_finalize_builds_elastic_all_to_alls(monkeypatch):
    """elastic=True reaches EPAllToAll through the shared all_to_all, apart from the plain one of the shape."""
    made = []
    monkeypatch.setattr(integrations, "_ALL_TO_ALLS", {})
    monkeypatch.setattr(integrations, "EPAllToAll", lambda *args, **kwargs: made.append(kwargs) or len(made))
    monkeypatch.setattr(moe_ep_vllm, "check_local_experts", lambda *args: 2)
    elastic = moe_ep_vllm.make_prepare_finalize(moe_config(2, 0, 2), None, elastic=True)
    plain = moe_ep_vllm.make_prepare_finalize(moe_config(2, 0, 2), None)
    assert elastic.ep != plain.ep and [kwargs["elastic"] for kwargs in made] == [True, False]


def _round(prepare_finalizes, live, inputs):
    """One prepare, toy experts and finalize of the ranks in `live`: every send before any receive (the
    interpreter runs one program at a time). Returns each rank's output [T, H]."""
    received = {r: prepare_finalizes[r].prepare_async(x, weights, ids, SIMULATED["num_experts"], None, False,
                                                      FUSED_MOE_UNQUANTIZED_CONFIG)
                for r, (x, ids, weights) in inputs.items() if r in live}
    for r in live:
        received[r] = received[r][0]() or received[r][1]()             # the hook, then prepare's tuple
    outputs, hooks = {}, {}
    for r in live:
        x, ids, weights = inputs[r]
        recv_x, recv_scales = received[r][:2]
        outputs[r] = torch.empty_like(x)
        hooks[r], _ = prepare_finalizes[r].finalize_async(outputs[r], expert_fn(recv_x, recv_scales, GROUP, x.dtype),
                                                          weights, ids, False, TopKWeightAndReduceDelegate())
    for r in live:
        hooks[r]()
    return outputs


@INTERPRETED
def test_elastic_prepare_finalize_goes_on_without_a_lost_rank():
    """Rank 2 of a simulated world makes no call after the first: the others' next finalize completes after
    about one timeout, without its experts (not renormalized), lost() names them; the call after that waits
    for nothing."""
    world, victim = SIMULATED["world"], 2
    ranks = EPAllToAll.simulated(**SIMULATED, fp8_group=GROUP, timeout_s=TIMEOUT_S, elastic=True)
    prepare_finalizes = [moe_ep_vllm.MoeEpPrepareAndFinalize(ep) for ep in ranks]
    survivors = [0, 1]
    took = []
    for n in range(3):
        everyone = [make_inputs(r, [5, 3, 4], SIMULATED["hidden"], SIMULATED["num_experts"], SIMULATED["topk"],
                                seed=n, drop=0.2) for r in range(world)]
        live = list(range(world)) if n == 0 else survivors
        lost = set() if n == 0 else {victim}
        started = time.monotonic()
        outputs = _round(prepare_finalizes, live, dict(enumerate(everyone)))
        took.append(time.monotonic() - started)
        without = [(x, ids.masked_fill(on_ranks(ids, lost, SIMULATED["num_experts"], world), -1), weights)
                   for x, ids, weights in everyone]
        for r in live:
            assert torch.equal(outputs[r], expected_combine(r, world, without, SIMULATED["num_experts"], GROUP,
                                                            torch.bfloat16)), (n, r)
            assert torch.equal(prepare_finalizes[r].lost(), on_ranks(everyone[r][1], lost, SIMULATED["num_experts"],
                                                                     world)), (n, r)
    waited_once(took, TIMEOUT_S)
    assert [prepare_finalizes[r].live_ranks() for r in survivors] == [survivors, survivors]


def _fault_tolerance(rank, world):
    """The EP group's manager under vLLM's state answers vLLM's fault-tolerance queries (vLLM's convention: 1
    marks a lost rank) from the elastic all-to-alls' masks, and refuses a retry once a rank is lost; the
    plugin under --enable-fault-tolerance refuses the reference backend and asks the nvshmem one for
    elastic all-to-alls."""
    from vllm.distributed import get_ep_group
    with vllm_state(rank, world, "reference") as config:
        manager = moe_ep_vllm.MoeEpAll2AllManager(get_ep_group().cpu_group)
        assert manager.support_fault_tolerance and manager.query_active_mask().tolist() == [0, 0]
        assert not manager.query_fault()
        manager.clean_buffers()                                      # nothing lost: nothing to refuse

        shapes = [EPAllToAll.simulated(world, 4, hidden, 8, 2, fp8_group=GROUP, elastic=True)[rank]
                  for hidden in (128, 256)]                          # this rank of two layer shapes
        moe_ep_vllm.elastic_all_to_alls = lambda: shapes
        shapes[1].mask_ranks([1 - rank])
        assert manager.query_active_mask().tolist() == [int(r != rank) for r in range(world)]
        assert manager.query_fault()
        with pytest.raises(RuntimeError, match=rf"moe_ep lost EP ranks \[{1 - rank}\] for good"):
            manager.clean_buffers()

        object.__setattr__(config.parallel_config, "enable_fault_tolerance", True)
        with pytest.raises(ValueError, match="--enable-fault-tolerance needs moe_ep's elastic all-to-all"):
            build_layer(world, rank, 128, False, torch.float32, "cpu", "fault tolerance")
        os.environ[moe_ep_vllm.BACKEND_VARIABLE] = "nvshmem"
        moe_ep_vllm.make_prepare_finalize = _stop_asked
        with pytest.raises(Asked) as asked:
            build_layer(world, rank, 128, False, torch.float32, "cpu", "fault tolerance nvshmem")
        assert asked.value.options["elastic"] and asked.value.options["backend"] == "nvshmem"


class Asked(Exception):
    """Stops building a layer where the plugin asks for its prepare/finalize (with `options`)."""

    def __init__(self, options: dict):
        super().__init__(options)
        self.options = options


def _stop_asked(*args, **options):
    raise Asked(options)


def test_fault_tolerance():
    run(_fault_tolerance, 2)
