"""moe_ep as SGLang's token dispatcher, against SGLang's own dispatcher without expert parallelism.

CPU (gloo, reference backend, fp32), 1, 2 and 4 ranks, SGLang's config published for DeepEP's
low-latency mode and its plugins loaded (moe_ep's entry point hooks its dispatcher factory): the
factory builds a MoeEpDispatcher per MoE layer; its dispatch, this rank's experts on the low-latency
layout and its combine give, for every rank's tokens, what SGLang's StandardDispatcher and its
torch-native MoE (fused_moe_forward_native) give with all experts on the rank, within fp32 rounding;
masked_m is the per-expert count summed over ranks; layers of one shape share an EPAllToAll; zero
tokens on a rank, one token, dropped slots (-1). At 2 ranks also: the MoE layer SGLang's model code builds
for --moe-a2a-backend deepep (DeepEPMoE, through its own constructor) gets a MoeEpDispatcher from the plugin
and its forward matches; the _a/_b halves of two sub-batches (two-batch overlap) on that layer's dispatcher
in flight, FP8 dispatch (SGLang's default dispatch dtype: FP8 rows, fp32 scales per 128 columns; where
DeepGEMM takes UE8M0 scales, payload "fp8_ue8m0": int32 scales, MN-major), the dtype a quantization method
sets, and what is refused (MXFP8 naming payload "mxfp8"). The experts on the low-latency layout are
moe_ep's plain-torch grouped GEMM: SGLang's runner for that layout (DeepGEMM) needs a GPU.

SGLang's MoE modules import torchvision (through sglang.srt.configs), and PyPI's torchvision imports
only beside PyPI's torch build: run these in an environment with both (``.ci/run`` makes one).

Elastic mode (CPU): under SGLang's elastic EP (--elastic-ep-backend) the factory asks for elastic
all-to-alls, refuses it without --enable-eplb, the reference backend, a process joining a running deployment
and room for more ranks; a simulated world of 3 ranks (EPAllToAll.simulated, kernels in the Triton interpreter) through
MoeEpDispatchers, where a rank stops answering: the others' combine completes after one timeout without
its experts, lost() reports them, SGLang's active_ranks has the rank cleared, later calls wait for nothing.

GPU (marked gpu): the same comparison with the nvshmem backend at 2 ranks in bf16. On a GPU, SGLang's MoE
modules import its compiled kernels (``sgl_kernel``, the sglang-kernel wheel): where they are missing, the
module skips.
"""
import os
import time
import tomllib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cases import expected_combine, expert_fn, make_inputs, moe_layer_inputs, on_ranks
from distributed import run, waited_once

pytest.importorskip("sglang.srt.layers.moe.token_dispatcher.deepep")

from sglang.srt.distributed.parallel_state import GroupCoordinator  # noqa: E402
from sglang.srt.elastic_ep.elastic_ep import ElasticEPState, ElasticEPStateManager  # noqa: E402
from sglang.srt.layers.moe.fused_moe_native import fused_moe_forward_native  # noqa: E402
from sglang.srt.layers.moe.fused_moe_triton import layer as fused_moe_layer  # noqa: E402
from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig  # noqa: E402
from sglang.srt.layers.moe.token_dispatcher.base import DispatchOutputFormat  # noqa: E402
from sglang.srt.layers.moe.token_dispatcher.deepep import DeepEPLLCombineInput  # noqa: E402
from sglang.srt.layers.moe.token_dispatcher.standard import StandardDispatcher  # noqa: E402
from sglang.srt.layers.moe.topk import StandardTopKOutput  # noqa: E402
from sglang.srt.layers.moe.utils import DeepEPMode, MoeA2ABackend, initialize_moe_config  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.runtime_context import get_context, get_exec, get_flags, get_parallel  # noqa: E402

from moe_ep.ep import EPAllToAll  # noqa: E402
from moe_ep.formats import FORMATS  # noqa: E402
from moe_ep.integrations import sglang as moe_ep_sglang  # noqa: E402
from moe_ep.kernels.grouped_gemm import gated_mlp  # noqa: E402

EXPERTS, HIDDEN, INTERMEDIATE, MAX_TOKENS = 8, 32, 16, 6


def publish(rank, world, backend="reference"):
    """SGLang's config for DeepEP low-latency on `world` ranks (unquantized dispatch), its TP and MoE EP
    group (the same ranks) on gloo, its plugins loaded, and MOE_EP_SGLANG naming `backend`."""
    get_context().override_server_args(tp_size=world, ep_size=world, moe_a2a_backend="deepep",
                                       deepep_mode="low_latency", deepep_dispatcher_output_dtype="bf16").install()
    initialize_moe_config()
    group = GroupCoordinator([list(range(world))], rank, "gloo", False, False, False, False, False, False,
                             group_name="moe_ep")
    get_parallel().override_permanently(tp_group=group, tp_rank=rank, moe_ep_group=group, moe_ep_rank=rank)
    os.environ[moe_ep_sglang.ENABLE_VARIABLE] = backend
    os.environ["SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"] = str(MAX_TOKENS)
    load_plugins()


def runner_config(world, topk, hidden=HIDDEN, dtype=torch.float32, local=None, shared=0) -> MoeRunnerConfig:
    local = EXPERTS // world if local is None else local
    return MoeRunnerConfig(num_experts=EXPERTS, num_local_experts=local, hidden_size=hidden,
                           intermediate_size_per_partition=INTERMEDIATE, top_k=topk,
                           num_fused_shared_experts=shared, params_dtype=dtype, activation="silu")


def inputs(rank, tokens, topk, drop, hidden=HIDDEN, dtype=torch.float32, device="cpu"):
    return moe_layer_inputs(rank, tokens, topk, drop, EXPERTS, hidden, INTERMEDIATE, dtype, device)


class Experts(torch.nn.Module):
    """What fused_moe_forward_native reads of a FusedMoE layer: its weights and runner config."""

    def __init__(self, w13, w2, config):
        super().__init__()
        self.w13_weight, self.w2_weight, self.moe_runner_config = w13, w2, config


def standard_moe(rank, world, w13, w2, x, ids, weights):
    """SGLang without expert parallelism: its factory's StandardDispatcher (no all-to-all backend, all
    experts on this rank) around its torch-native MoE; a dropped slot weighs 0."""
    config = runner_config(1, ids.shape[1], x.shape[1], x.dtype, local=EXPERTS)
    kept = ids >= 0
    topk_output = StandardTopKOutput(torch.where(kept, weights, 0), torch.where(kept, ids, 0), None)
    with get_flags().moe.override(a2a_backend=MoeA2ABackend.NONE), \
            get_parallel().override(moe_ep_size=1, moe_ep_rank=0, moe_ep_group=None, moe_tp_size=world,
                                    moe_tp_rank=rank):
        dispatcher = fused_moe_layer.create_moe_dispatcher(config, quant_method=None)
        assert isinstance(dispatcher, StandardDispatcher)
        dispatch_output = dispatcher.dispatch(hidden_states=x, topk_output=topk_output)
        return dispatcher.combine(combine_input=fused_moe_forward_native(Experts(w13, w2, config), dispatch_output))


def run_experts(dispatch_output, w13, w2, dtype):
    """This rank's experts on the low-latency layout: silu(gate) * up, then down, on each expert's first
    masked_m rows (moe_ep's plain-torch grouped GEMM), as SGLang's DeepGEMM runner computes them."""
    x, scales, ids, weights, counts, _ = dispatch_output
    y = gated_mlp(x, w13, w2, counts, scales, moe_ep_sglang.FP8_BLOCK, out_dtype=dtype, kernels=False)
    return DeepEPLLCombineInput(y, ids, weights)


def moe_ep_moe(dispatcher, rank, world, w13, w2, x, ids, weights):
    """(y [T, H], the dispatch output) of one MoE layer through `dispatcher`."""
    mine = slice(rank * EXPERTS // world, (rank + 1) * EXPERTS // world)
    out = dispatcher.dispatch(hidden_states=x, topk_output=StandardTopKOutput(weights, ids, None))
    return dispatcher.combine(combine_input=run_experts(out, w13[mine], w2[mine], x.dtype)), out


def _against_standard(rank, world, tokens_per_rank, topk, drop, make, dtype=torch.float32, hidden=HIDDEN,
                      device="cpu", tolerance=1e-5):
    w13, w2, x, ids, weights = inputs(rank, tokens_per_rank[rank], topk, drop, hidden, dtype, device)
    dispatcher = make(runner_config(world, topk, hidden, dtype))
    assert isinstance(dispatcher, moe_ep_sglang.MoeEpDispatcher)
    y, out = moe_ep_moe(dispatcher, rank, world, w13, w2, x, ids, weights)
    torch.testing.assert_close(y, standard_moe(rank, world, w13, w2, x, ids, weights), rtol=tolerance, atol=tolerance)

    assert out.format == DispatchOutputFormat.DEEPEP_LL and out.hidden_states_scale is None
    assert out.hidden_states.shape == (EXPERTS // world, world * MAX_TOKENS, hidden)
    assert out.topk_ids is ids and out.topk_weights is weights
    assert out.expected_m == (x.shape[0] * world * topk + EXPERTS) // EXPERTS          # DeepEP's hint
    counts = torch.bincount(ids[ids >= 0].cpu(), minlength=EXPERTS).to(device)
    dist.all_reduce(counts)
    assert out.masked_m.tolist() == counts[rank * EXPERTS // world:(rank + 1) * EXPERTS // world].tolist()
    assert make(runner_config(world, topk, hidden, dtype)).all_to_all(x.device) is dispatcher.all_to_all(x.device), \
        "a second layer of the shape shares its EPAllToAll"


def _hooked_factory(config):
    dispatcher = fused_moe_layer.create_moe_dispatcher(config, quant_method=None)
    assert dispatcher.group is get_parallel().moe_ep_group.device_group
    return dispatcher


# Per world size, cases of (tokens per rank, top-k, dropped slots), run in one set of processes (each
# imports SGLang once); at 2 ranks the other checks follow.
CASES = {
    1: [((5,), 2, False), ((1,), 1, True)],
    2: [((6, 3), 2, True),
        ((0, 4), 3, False),                           # zero tokens on a rank
        ((1, 6), 1, True)],                           # one token
    4: [((2, 0, 6, 5), 2, True)],
}


def _cases(rank, world):
    publish(rank, world)
    for tokens, topk, drop in CASES[world]:
        _against_standard(rank, world, tokens, topk, drop, _hooked_factory)
    if world == 2:
        _layer_sglang_builds(rank, world)
        _sub_batches(rank, world)
        _fp8_dispatch(rank, world)
        _refusals(rank, world)


@pytest.mark.parametrize("world", sorted(CASES))
def test_dispatcher_matches_sglang_standard_path(world):
    run(_cases, world)


def build_layer(rank, world, topk):
    """The MoE layer SGLang's model code builds with --moe-a2a-backend deepep (get_moe_impl_class: DeepEPMoE),
    through its own constructor, under the published config and this rank's MoE parallel state."""
    from sglang.srt.layers.moe.ep_moe.layer import DeepEPMoE, get_moe_impl_class

    get_parallel().override_permanently(moe_tp_rank=0, moe_tp_size=1, moe_ep_rank=rank, moe_ep_size=world)
    layer_class = get_moe_impl_class(quant_config=None)
    assert layer_class is DeepEPMoE
    return layer_class(num_experts=EXPERTS, top_k=topk, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                       layer_id=0, params_dtype=torch.float32, prefix="model.layers.0.mlp.experts")


def _layer_sglang_builds(rank, world):
    """DeepEPMoE built by SGLang gets a MoeEpDispatcher from the plugin; its forward (dispatch, experts,
    combine) matches SGLang's standard path. Its experts here are moe_ep's plain-torch grouped GEMM in place
    of run_moe_core: SGLang's runners of DeepEP's low-latency format (DeepGEMM, AITER, Ascend) need a GPU or
    an NPU, and its torch-native MoE (fused_moe_forward_native) takes the standard format only."""
    topk = 2
    layer = build_layer(rank, world, topk)
    assert isinstance(layer.dispatcher, moe_ep_sglang.MoeEpDispatcher)
    assert layer.dispatcher.group is get_parallel().moe_ep_group.device_group
    w13, w2, x, ids, weights = inputs(rank, 5 - rank, topk, drop=True)
    mine = slice(rank * EXPERTS // world, (rank + 1) * EXPERTS // world)
    layer.w13_weight.data.copy_(w13[mine])
    layer.w2_weight.data.copy_(w2[mine])
    layer.run_moe_core = lambda dispatch_output: run_experts(dispatch_output, layer.w13_weight, layer.w2_weight,
                                                             x.dtype)
    y = layer.forward(x, StandardTopKOutput(weights, ids, None))
    torch.testing.assert_close(y, standard_moe(rank, world, w13, w2, x, ids, weights), rtol=1e-5, atol=1e-5)


def _sub_batches(rank, world):
    """Two sub-batches in flight (two-batch overlap): both dispatch_a before either dispatch_b, combines
    in the other order; each keeps its own handle. Halves out of order are refused."""
    topk = 2
    dispatcher = build_layer(rank, world, topk).dispatcher              # the dispatcher of a layer SGLang built
    mine = slice(rank * EXPERTS // world, (rank + 1) * EXPERTS // world)
    batches = [inputs(rank + 10 * b, 3 + b, topk, drop=b == 1) for b in range(2)]
    for b, (w13, w2, x, ids, weights) in enumerate(batches):
        dispatcher.dispatch_a(hidden_states=x, topk_output=StandardTopKOutput(weights, ids, None), tbo_subbatch_index=b)
    outputs = [dispatcher.dispatch_b(tbo_subbatch_index=b) for b in (1, 0)][::-1]
    for b, (w13, w2, x, ids, weights) in enumerate(batches):
        dispatcher.combine_a(combine_input=run_experts(outputs[b], w13[mine], w2[mine], x.dtype), tbo_subbatch_index=b)
    for b in (1, 0):
        w13, w2, x, ids, weights = batches[b]
        y = dispatcher.combine_b(tbo_subbatch_index=b)
        torch.testing.assert_close(y, standard_moe(rank, world, w13, w2, x, ids, weights), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="dispatch_b on sub-batch 0 needs it dispatching, it is idle"):
        dispatcher.dispatch_b()
    w13, w2, x, ids, weights = batches[0]
    out = dispatcher.dispatch(hidden_states=x, topk_output=StandardTopKOutput(weights, ids, None))
    with pytest.raises(ValueError, match="topk_weights differ from those of its dispatch"):
        dispatcher.combine(combine_input=run_experts(out, w13[mine], w2[mine], x.dtype)._replace(
            topk_weights=weights.flip(0)))
    dispatcher.combine(combine_input=run_experts(out, w13[mine], w2[mine], x.dtype))


def _fp8_dispatch(rank, world):
    """SGLang's default dispatch dtype ("auto": FP8) sends FP8 rows with fp32 scales per 128 columns; the
    unquantized experts' method asks for bf16 (the layer's dtype) through set_quant_config."""
    topk, hidden = 2, 128
    w13, w2, x, ids, weights = inputs(rank, 5, topk, drop=True, hidden=hidden)
    with get_exec().moe.override(deepep_dispatcher_output_dtype="auto"):
        dispatcher = _hooked_factory(runner_config(world, topk, hidden))
        y, out = moe_ep_moe(dispatcher, rank, world, w13, w2, x, ids, weights)
        assert out.hidden_states.dtype == torch.float8_e4m3fn
        assert out.hidden_states_scale.shape == (EXPERTS // world, world * MAX_TOKENS, hidden // 128)
        assert out.hidden_states_scale.dtype == torch.float32
        expected = standard_moe(rank, world, w13, w2, x, ids, weights)
        assert (y - expected).norm() <= 0.05 * expected.norm()        # FP8 e4m3 rounding of the inputs
        dispatcher.set_quant_config({"dispatcher_output_dtype": "bf16"})
        y, out = moe_ep_moe(dispatcher, rank, world, w13, w2, x, ids, weights)
        assert out.hidden_states.dtype == torch.float32 and out.hidden_states_scale is None
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    _ue8m0_dispatch(rank, world)


def _ue8m0_dispatch(rank, world):
    """Where DeepGEMM takes UE8M0 scales (DEEPGEMM_SCALE_UE8M0, Blackwell) FP8 dispatch is payload "fp8_ue8m0":
    int32 scales [E_loc, W * T_max, H / 512], MN-major, as DeepEP's use_ue8m0 dispatch returns them."""
    topk, hidden, rows = 2, 512, world * MAX_TOKENS
    w13, w2, x, ids, weights = inputs(rank, 5, topk, drop=True, hidden=hidden)
    mine = slice(rank * EXPERTS // world, (rank + 1) * EXPERTS // world)
    wrapper = moe_ep_sglang.deep_gemm_wrapper
    ue8m0 = wrapper.DEEPGEMM_SCALE_UE8M0
    wrapper.DEEPGEMM_SCALE_UE8M0 = True
    try:
        with get_exec().moe.override(deepep_dispatcher_output_dtype="auto"):
            dispatcher = _hooked_factory(runner_config(world, topk, hidden))
            assert dispatcher.payload == "fp8_ue8m0" and dispatcher.fp8
            out = dispatcher.dispatch(hidden_states=x, topk_output=StandardTopKOutput(weights, ids, None))
            scales = out.hidden_states_scale
            assert out.hidden_states.dtype == torch.float8_e4m3fn and scales.dtype == torch.int32
            assert scales.shape == (EXPERTS // world, rows, hidden // 512) and scales.stride() == (rows, 1, rows)
            decoded = FORMATS["fp8_ue8m0"].dequantize(out.hidden_states, scales).to(x.dtype)
            y = dispatcher.combine(combine_input=run_experts(out._replace(hidden_states=decoded,
                                                                          hidden_states_scale=None),
                                                             w13[mine], w2[mine], x.dtype))
            expected = standard_moe(rank, world, w13, w2, x, ids, weights)
            assert (y - expected).norm() <= 0.05 * expected.norm()    # e4m3 rounding with power-of-two scales
            with pytest.raises(ValueError, match="format 'fp8_ue8m0': hidden=128 is not a multiple of 512"):
                _hooked_factory(runner_config(world, topk, 128))
    finally:
        wrapper.DEEPGEMM_SCALE_UE8M0 = ue8m0


def _refusals(rank, world):
    config = runner_config(world, 2)
    with get_flags().moe.override(deepep_mode=DeepEPMode.AUTO), \
            pytest.raises(ValueError, match="--deepep-mode low_latency"):
        _hooked_factory(config)
    with get_flags().moe.override(sbo_enabled=True), pytest.raises(ValueError, match="single-batch overlap"):
        _hooked_factory(config)
    with pytest.raises(ValueError, match="--disable-shared-experts-fusion"):
        _hooked_factory(runner_config(world, 2, shared=1))
    with pytest.raises(ValueError, match="spread evenly over the 2 ranks"):
        _hooked_factory(runner_config(world, 2, local=EXPERTS))
    with pytest.raises(ValueError, match=r"topk must be an int in \[1, 16\]"):
        _hooked_factory(runner_config(world, 17))
    with get_exec().moe.override(deepep_dispatcher_output_dtype="auto"):       # SGLang's default: FP8
        with pytest.raises(ValueError, match="hidden=32 is not a multiple of fp8_group=128"):
            _hooked_factory(config)
        with pytest.raises(ValueError, match="dispatch dtype is nvfp4"):
            _hooked_factory(runner_config(world, 2, hidden=128)).set_quant_config({"dispatcher_output_dtype": "nvfp4"})
        for quant_config in ({"use_mxfp8": True}, {"dispatcher_output_dtype": "mxfp8"}):
            with pytest.raises(ValueError, match="MXFP8 experts ask for payload 'mxfp8'"):
                _hooked_factory(runner_config(world, 2, hidden=128)).set_quant_config(quant_config)
    with get_exec().moe.override(elastic_ep_backend="mooncake"):
        with pytest.raises(ValueError, match="elastic EP .* needs --enable-eplb"):
            moe_ep_sglang.make_dispatcher(config, backend="nvshmem")
    with get_exec().moe.override(elastic_ep_backend="mooncake", enable_eplb=True):
        with pytest.raises(ValueError, match="elastic=True needs backend='nvshmem'"):
            _hooked_factory(config)
        assert moe_ep_sglang.make_dispatcher(config, backend="nvshmem").elastic      # built at the first dispatch
        with get_exec().moe.override(ep_join_mode="recover"), pytest.raises(ValueError, match="running job"):
            _hooked_factory(config)
        with get_parallel().override(max_ep_size=4), pytest.raises(ValueError, match="--max-ep-size 4 from 2"):
            _hooked_factory(config)
    dispatcher = _hooked_factory(config)
    assert not dispatcher.elastic and dispatcher.live_ranks() == [0, 1]
    x = torch.randn(2, HIDDEN)
    with pytest.raises(ValueError, match="StandardTopKOutput"):
        dispatcher.dispatch(hidden_states=x, topk_output=(torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.int64)))
    os.environ[moe_ep_sglang.ENABLE_VARIABLE] = "deepep"
    with pytest.raises(ValueError, match="backend must be one of"):
        _hooked_factory(config)
    os.environ[moe_ep_sglang.ENABLE_VARIABLE] = ""
    with pytest.raises(ImportError, match="DeepEP is not available"):
        fused_moe_layer.create_moe_dispatcher(config, quant_method=None)     # unset: SGLang's own DeepEP


def test_plugin_entry_point():
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["sglang.srt.plugins"] == {"moe_ep": "moe_ep.integrations.sglang:register"}
    assert set(moe_ep_sglang.PATCH_POINTS.values()) == {
        f"{fused_moe_layer.__name__}.{fused_moe_layer.create_moe_dispatcher.__name__}"}


def _nvshmem_against_standard(rank, world):
    os.environ["SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK"] = str(MAX_TOKENS)
    get_context().override_server_args(tp_size=world, ep_size=world, moe_a2a_backend="deepep",
                                       deepep_mode="low_latency", deepep_dispatcher_output_dtype="bf16").install()
    initialize_moe_config()
    _against_standard(rank, world, (6, 2), 2, True, lambda config: moe_ep_sglang.make_dispatcher(config),
                      dtype=torch.bfloat16, hidden=128, device="cuda", tolerance=2e-2)


@pytest.mark.gpu
def test_nvshmem_dispatcher_matches_sglang_standard_path():
    run(_nvshmem_against_standard, 2, gpu=True)


# ------------------------------------------------------------------ elastic mode

INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="runs the kernels in the Triton interpreter, on CPU-only machines")
SIMULATED = dict(world=3, max_tokens=5, hidden=128, num_experts=12, topk=3)   # a simulated world's shape
GROUP, TIMEOUT_S = 64, 4.0                     # the FP8 group of its dispatch, the bound of every wait


def _round(dispatchers, live, inputs):
    """One dispatch, toy experts and combine of the ranks in `live` through their dispatchers' halves: every
    send before any receive (the interpreter runs one program at a time). Returns each rank's tokens [T, H]."""
    for r in live:
        x, ids, weights = inputs[r]
        dispatchers[r].dispatch_a(x, StandardTopKOutput(weights, ids, None))
    outputs = {r: dispatchers[r].dispatch_b() for r in live}
    for r in live:
        out = outputs[r]
        dispatchers[r].combine_a(DeepEPLLCombineInput(expert_fn(out.hidden_states, out.hidden_states_scale, GROUP,
                                                                torch.bfloat16), out.topk_ids, out.topk_weights))
    return {r: dispatchers[r].combine_b() for r in live}


def _elastic_dispatchers(rank, world):
    """Rank 2 of a simulated world makes no call after the first: the others' next combine completes after
    about one timeout, without its experts (not renormalized), lost() names them and SGLang's active_ranks
    has rank 2 cleared; the call after that waits for nothing. One process: the world is simulated, SGLang's
    config published for FP8 dispatch in DeepEP's low-latency mode, its elastic EP state on the CPU."""
    world, victim, experts = SIMULATED["world"], 2, SIMULATED["num_experts"]
    get_context().override_server_args(tp_size=world, ep_size=world, moe_a2a_backend="deepep",
                                       deepep_mode="low_latency", deepep_dispatcher_output_dtype="fp8").install()
    initialize_moe_config()
    moe_ep_sglang.check_local_experts = lambda *args: world        # the simulated world's size, not the job's
    active = torch.ones(world, dtype=torch.int32)
    ElasticEPStateManager._instance = ElasticEPState(active, active.clone(), active.clone(), effective_ep_size=world)
    simulated = iter(EPAllToAll.simulated(**SIMULATED, fp8_group=GROUP, timeout_s=TIMEOUT_S, elastic=True))
    moe_ep_sglang.all_to_all = lambda *args, **options: next(simulated)   # rank r's, at rank r's first dispatch
    dispatchers = [moe_ep_sglang.MoeEpDispatcher(experts, experts // world, SIMULATED["hidden"], SIMULATED["topk"],
                                                 torch.bfloat16, max_tokens=SIMULATED["max_tokens"], elastic=True)
                   for _ in range(world)]
    assert all(dispatcher.fp8 for dispatcher in dispatchers)
    survivors = [0, 1]
    took = []
    for n in range(3):
        everyone = [make_inputs(r, [5, 3, 4], SIMULATED["hidden"], experts, SIMULATED["topk"], seed=n, drop=0.2)
                    for r in range(world)]
        live = list(range(world)) if n == 0 else survivors
        lost = set() if n == 0 else {victim}
        started = time.monotonic()
        outputs = _round(dispatchers, live, dict(enumerate(everyone)))
        took.append(time.monotonic() - started)
        without = [(x, ids.masked_fill(on_ranks(ids, lost, experts, world), -1), weights)
                   for x, ids, weights in everyone]
        for r in live:
            assert torch.equal(outputs[r], expected_combine(r, world, without, experts, GROUP, torch.bfloat16)), (n, r)
            assert torch.equal(dispatchers[r].lost(), on_ranks(everyone[r][1], lost, experts, world)), (n, r)
        assert active.tolist() == [int(r not in lost) for r in range(world)], n
    waited_once(took, TIMEOUT_S)
    assert [dispatchers[r].live_ranks() for r in survivors] == [survivors, survivors]


@INTERPRETED
def test_elastic_dispatcher_goes_on_without_a_lost_rank():
    run(_elastic_dispatchers, 1)
