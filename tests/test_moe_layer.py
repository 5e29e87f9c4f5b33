"""EPMoE and swap_moe on real transformers MoE models built from configs (no download).

CPU: gloo, 2 and 4 ranks, reference backend, fp32: the swapped model's logits equal the original's
for every supported family (swap_moe verifies each block on the way, as it does by default); a
block that does something the layer cannot see is refused; unsupported layouts are refused
before any forward. Elastic mode: the layer asks for an elastic all-to-all (which the reference backend
refuses) and keeps each forward's lost-expert report in `lost`.

GPU: the NVSHMEM backend against the reference backend, bit for bit, on the same bf16 model; and
the accuracy of the swapped bf16 model measured against the fp32 model, relative to the error
the unswapped bf16 model itself makes there (median token error: see _relative_error).
"""
import copy

import pytest
import torch
from torch import nn

from cases import on_ranks
from distributed import gpu_worlds, run
from moe_ep import AsyncTP, EPAllToAll, EPMoE, random_topk, runtime, swap_moe
from moe_ep.reference import dequantize_fp8, quantize_fp8

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, num_experts_per_tok=2)
SUPPORTED = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3", "beam", "hunyuan_v1_moe")
# The model class of each family: older transformers releases lack some (Beam), and those are left out.
CLASSES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
           "deepseek_v3": "DeepseekV3ForCausalLM", "beam": "BeamForCausalLM",
           "hunyuan_v1_moe": "HunYuanMoEV1ForCausalLM"}


def tiny_model(kind: str, seed: int = 0) -> nn.Module:
    """A two-layer model of the family `kind` with 8 experts in every MoE block, the same on every rank.

    mixtral, qwen3_moe: softmax top-k routers. qwen2_moe: a shared expert behind a sigmoid gate.
    deepseek_v3: grouped sigmoid routing with a score-correction bias, shared experts, the routed
    scaling factor applied by the router. beam: the same routing, the routed scaling factor applied
    by the block. hunyuan_v1_moe: a shared MLP at .shared_mlp. gpt_oss, llama4: expert layouts
    swap_moe refuses.
    """
    torch.manual_seed(seed)
    t = transformers
    if kind == "mixtral":
        model = t.MixtralForCausalLM(t.MixtralConfig(intermediate_size=48, num_local_experts=8, **COMMON))
    elif kind == "qwen3_moe":
        model = t.Qwen3MoeForCausalLM(t.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                                       norm_topk_prob=True, decoder_sparse_step=1, head_dim=16,
                                                       **COMMON))
    elif kind == "qwen2_moe":
        model = t.Qwen2MoeForCausalLM(t.Qwen2MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                                       shared_expert_intermediate_size=48, norm_topk_prob=False,
                                                       decoder_sparse_step=1, **COMMON))
    elif kind == "deepseek_v3":
        model = t.DeepseekV3ForCausalLM(t.DeepseekV3Config(
            intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, n_group=2,
            topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=32,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, **COMMON))
    elif kind == "beam":
        model = t.BeamForCausalLM(t.BeamConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=8, n_group=2,
                                               topk_group=1, routed_scaling_factor=2.5, head_dim=16,
                                               mlp_layer_types=["sparse", "sparse"], **COMMON))
    elif kind == "hunyuan_v1_moe":
        model = t.HunYuanMoEV1ForCausalLM(t.HunYuanMoEV1Config(intermediate_size=32, num_experts=8,
                                                               head_dim=16, **COMMON))
    elif kind == "gpt_oss":
        model = t.GptOssForCausalLM(t.GptOssConfig(intermediate_size=32, num_local_experts=8, head_dim=16, **COMMON))
    else:
        model = t.Llama4ForCausalLM(t.Llama4TextConfig(intermediate_size=32, intermediate_size_mlp=96,
                                                       num_local_experts=8, head_dim=16, **COMMON))
    with torch.no_grad():                  # some experts and biases start at zero: make every one count
        for name, p in model.named_parameters():
            if "experts" in name or "gate" in name:
                p.normal_(0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    return model.eval()


def _swapped_logits_match(rank, world, kind):
    model = tiny_model(kind)
    tokens = torch.randint(0, 96, (2, 5 + 3 * rank), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        expected = model(tokens).logits
        swapped = swap_moe(copy.deepcopy(model), backend="reference", fp8_dispatch=False, max_tokens=64)
        layers = [m for m in swapped.modules() if isinstance(m, EPMoE)]
        assert len(layers) == 2 and all(m.experts_per_rank == 8 // world for m in layers)
        logits = swapped(tokens).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"{kind}: {m}")


def _all_families(rank, world):
    present = [kind for kind in SUPPORTED if hasattr(transformers, CLASSES[kind])]
    assert {"mixtral", "qwen3_moe", "deepseek_v3"} <= set(present), f"only {present} in this transformers"
    for kind in present:
        _swapped_logits_match(rank, world, kind)


@pytest.mark.parametrize("world", [2, 4])
def test_swapped_models_match_originals(world):
    run(_all_families, world)                # one job per world size for every family: spawning costs most


def _refusals(rank, world):
    model = tiny_model("qwen3_moe")
    block = model.model.layers[1].mlp        # scales its output: something the layer cannot know of
    block_class = type(block)
    block.__class__ = type("ScaledMoeBlock", (block_class,),
                           {"forward": lambda self, x: block_class.forward(self, x) * 1.5})
    with pytest.raises(ValueError, match=r"refuses ScaledMoeBlock at model.layers.1.mlp: .* differs from it by 0.3"):
        swap_moe(model, backend="reference", fp8_dispatch=False, max_tokens=64)
    assert not any(isinstance(m, EPMoE) for m in model.modules()), "a refused swap must leave the model unchanged"

    with pytest.raises(ValueError, match="unsupported MoE block GptOssMLP: experts with biases"):
        swap_moe(tiny_model("gpt_oss"), backend="reference")
    with pytest.raises(ValueError, match=r"unsupported MoE block Llama4TextMoe: expert weights .* not in the layout"):
        swap_moe(tiny_model("llama4"), backend="reference")


def test_swap_refuses_what_it_cannot_reproduce():
    run(_refusals, 2)


def _bad_options(rank, world):
    with pytest.raises(ValueError, match="activation"):
        EPMoE(64, 32, 8, 2, activation="relu6", backend="reference")
    with pytest.raises(ValueError, match="multiple"):
        EPMoE(64, 32, 7, 2, backend="reference")
    with pytest.raises(ValueError, match="max_tokens"):
        EPMoE(64, 32, 8, 2, max_tokens=0, backend="reference")
    with pytest.raises(ValueError, match="fp8_experts needs hidden and intermediate multiples of 128"):
        EPMoE(64, 32, 8, 2, fp8_experts=True, fp8_dispatch=False, backend="reference")

    class OddBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(64, 8)
            self.experts = nn.ModuleList([nn.Linear(64, 64) for _ in range(8)])

    with pytest.raises(ValueError, match="OddBlock"):
        swap_moe(nn.Sequential(OddBlock()), backend="reference")
    with pytest.raises(ValueError, match="no MoE block"):
        swap_moe(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="hidden=64 is not a multiple of fp8_group=128"):
        EPMoE(64, 32, 8, 2, backend="reference")                 # refused when built, not at the first forward
    with pytest.raises(ValueError, match="backend must be one of"):
        EPMoE(64, 32, 8, 2, backend="mpi", fp8_dispatch=False)
    with pytest.raises(ValueError, match="intermediate must be a positive int"):
        EPMoE(64, 0, 8, 2, backend="reference", fp8_dispatch=False)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU is usable here"):
            EPMoE(64, 32, 8, 2, backend="reference", fp8_dispatch=False, device="cuda")
    layer = EPMoE(64, 32, 8, 2, backend="reference", dtype=torch.float32, fp8_dispatch=False)
    with pytest.raises(ValueError, match="router"):
        layer(torch.zeros(3, 64))
    with pytest.raises(ValueError, match="hidden"):
        layer(torch.zeros(3, 32))


def test_bad_options_raise():
    run(_bad_options, 2)


def _initialised_like_linear(rank, world):
    """An EPMoE built directly starts with weights as nn.Linear initialises its own (uniform in +-1/sqrt(fan_in),
    fan_in = H for gate_up_proj, I for down_proj), not with torch.empty's leftovers, and its forward gives
    finite outputs of the size such weights give."""
    hidden, intermediate = 64, 32
    torch.manual_seed(rank)
    layer = EPMoE(hidden, intermediate, 8, 2, backend="reference", dtype=torch.float32, fp8_dispatch=False)
    for weight, fan_in in ((layer.gate_up_proj, hidden), (layer.down_proj, intermediate)):
        bound = fan_in ** -0.5
        assert weight.abs().max() <= bound and weight.abs().max() > 0.9 * bound
        assert abs(weight.std().item() - bound / 3 ** 0.5) < 0.05 * bound          # a uniform's deviation
        linear = nn.Linear(fan_in, 16, bias=False)
        assert abs(linear.weight.abs().max().item() - bound) < 0.1 * bound        # what nn.Linear draws
    x = torch.randn(5, hidden)
    ids, weights = random_topk(5, 8, 2, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        y = layer(x, ids, weights)
    assert torch.isfinite(y).all() and 0.01 < y.norm() / x.norm() < 1


def test_a_layer_built_directly_is_initialised_like_linear():
    run(_initialised_like_linear, 2)


def _forward_keys(rank, world):
    """Which eager forwards replay a graph of their own (EPMoE._forward_key): on the nvshmem backend, up to the
    all-to-all's one_launch_tokens tokens, outside a caller's capture, where the dispatch would pass its checks;
    keyed by the token count, the slots, the stream, the ids' and weights' dtypes and the experts. The rest
    launch. (The backend and the all-to-all are stood in for: no NVSHMEM here; the process is this rank's own.)"""
    from types import SimpleNamespace
    from moe_ep import graphs
    graphs.current_stream = lambda device: 7
    layer = EPMoE(64, 32, 8, 2, backend="reference", dtype=torch.float32, fp8_dispatch=False)
    layer.backend = "nvshmem"
    ep = SimpleNamespace(one_launch_tokens=16, replay_slots=lambda x, ids, weights: (1, 0))

    def key(tokens, ids_dtype=torch.int64, **change):
        ids, weights = random_topk(tokens, 8, 2)
        return layer._forward_key(torch.randn(tokens, 64), ids.to(ids_dtype), weights, SimpleNamespace(**{
            **vars(ep), **change}))

    assert key(16) == (16, (1, 0), 7, torch.int64, torch.float32, False, layer.gate_up_proj.data_ptr(),
                       layer.down_proj.data_ptr())
    assert key(0)[:2] == (0, (1, 0)) and key(3, torch.int32)[3] == torch.int32
    assert key(17) is None                                               # past the crossover: launched
    assert key(16, one_launch_tokens=0) is None
    assert key(4, replay_slots=lambda x, ids, weights: None) is None       # its checks would refuse it
    graphs.capturing = lambda cuda: True                                   # inside a caller's capture
    assert key(4) is None
    graphs.capturing = lambda cuda: False
    for name, value in (("replay", False), ("elastic", True), ("backend", "reference")):
        setattr(layer, name, value)
        assert key(4) is None, name
        setattr(layer, name, {"replay": True, "elastic": False, "backend": "nvshmem"}[name])
    assert key(4) is not None


def test_which_forwards_replay_a_graph():
    run(_forward_keys, 1)


def _swap_refuses_a_backend_that_cannot_run(rank, world):
    """swap_moe with the default (nvshmem) backend where it cannot run (no GPU, or no nvshmem4py) refuses
    before it changes anything."""
    model = tiny_model("qwen3_moe")
    blocks = [m for m in model.modules() if getattr(m, "experts", None) is not None]
    with pytest.raises(ValueError, match="backend='nvshmem' cannot run in this process: .*use backend='reference'"):
        swap_moe(model, fp8_dispatch=False, max_tokens=64)
    assert [m for m in model.modules() if getattr(m, "experts", None) is not None] == blocks
    assert not any(isinstance(m, EPMoE) for m in model.modules())


@pytest.mark.skipif(runtime.nvshmem_unavailable() is None, reason="checks a machine where nvshmem cannot run")
def test_swap_refuses_a_backend_that_cannot_run_here():
    run(_swap_refuses_a_backend_that_cannot_run, 2)


class ReportsRankOneLost(EPAllToAll):
    """The reference all-to-all, built where EPMoE asks for an elastic one, whose handles report the experts
    of rank 1 lost, as an elastic all-to-all's do once it lost rank 1 (what its combine then leaves out is
    the kernels' part: tests/test_ep_elastic.py)."""

    built_elastic: list[bool] = []

    def __init__(self, *args, elastic=False, **kwargs):
        self.built_elastic.append(elastic)
        super().__init__(*args, **kwargs)

    def dispatch(self, x, topk_ids, topk_weights, **kwargs):
        *received, handle = super().dispatch(x, topk_ids, topk_weights, **kwargs)
        handle.lost = on_ranks(topk_ids, {1}, self.num_experts, self.world)
        return (*received, handle)


def _elastic(rank, world):
    from moe_ep.layers import moe
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(3, 64, generator=g)
    ids, weights = random_topk(3, 8, 2, generator=g)
    layer = EPMoE(64, 32, 8, 2, backend="reference", dtype=torch.float32, fp8_dispatch=False, elastic=True)
    with pytest.raises(ValueError, match="elastic=True needs backend='nvshmem'"):
        layer(x, ids, weights)
    moe.EPAllToAll = ReportsRankOneLost
    layer = EPMoE(64, 32, 8, 2, backend="reference", dtype=torch.float32, fp8_dispatch=False, elastic=True)
    with torch.no_grad():
        layer(x, ids, weights)
    assert ReportsRankOneLost.built_elastic == [True]
    assert torch.equal(layer.lost, on_ranks(ids, {1}, 8, world))
    assert EPMoE(64, 32, 8, 2, backend="reference", fp8_dispatch=False).lost is None


def test_elastic_layer_reports_lost_experts():
    run(_elastic, 2)


def _teardown(rank, world):
    g = torch.Generator().manual_seed(rank)
    layer = EPMoE(64, 32, 8, 2, backend="reference", dtype=torch.float32, max_tokens=4, fp8_dispatch=False)
    x = torch.randn(3, 64, generator=g)
    ids, weights = random_topk(3, 8, 2, generator=g)
    with torch.no_grad():
        layer.gate_up_proj.normal_(0, 0.1, generator=g)
        layer.down_proj.normal_(0, 0.1, generator=g)
        y = layer(x, ids, weights)
        layer.destroy()
        layer.destroy()                                     # idempotent
        assert layer._all_to_all is None
        torch.testing.assert_close(layer(x, ids, weights), y)   # a new all-to-all, the same result
    layer.destroy()


def test_destroy_frees_the_all_to_all_and_a_later_forward_builds_another():
    run(_teardown, 2)


def _experts_on_kernels(rank, world):
    """run_experts as the GPU runs it (kernels; interpreted on CPU) against its torch form: the
    activation by name (a kernel) and as a callable (torch), FP8 weights; and what FP8 weights cost
    against the unquantized layer: about 6% relative error here, four e4m3 roundings (rows and weights
    of both GEMMs) of about 2.5% each. Compared per expert by the relative error of its rows: 1e-5 in
    fp32 on CPU; on GPUs the kernels' fp32 dots run in tf32 (unit roundoff 2^-11, about 5e-4, a few
    roundings through two GEMMs), so 5e-3 there, where single elements near zero can differ by more.
    With FP8 weights the intermediate is rounded to e4m3 between the GEMMs: there a tf32 difference now
    and then flips an element's rounding by one e4m3 step (about 6%), so 2e-2 on GPUs (0.0068 seen on
    H200s)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tol = 1e-5 if device == "cpu" else 5e-3
    g = torch.Generator().manual_seed(rank)
    for activation, fp8_experts in (("silu", False), (torch.tanh, False), ("silu", True)):
        layer = EPMoE(128, 128, 8, 2, activation=activation, backend="reference", dtype=torch.float32,
                      max_tokens=6, fp8_experts=fp8_experts)
        with torch.no_grad():
            layer.gate_up_proj.normal_(0, 128 ** -0.5, generator=g)
            layer.down_proj.normal_(0, 128 ** -0.5, generator=g)
        layer.to(device)
        rows = world * layer.max_tokens
        recv_x = torch.randn(layer.experts_per_rank, rows, 128, generator=g).to(device)
        counts = torch.tensor([0, rows, 1, 5][:layer.experts_per_rank], dtype=torch.int32, device=device)
        out = layer.run_experts(recv_x, None, counts, 2.0, kernels=True)
        expected = layer.run_experts(recv_x, None, counts, kernels=False)
        exact = layer.run_experts(recv_x, None, counts, fp8_experts=False, kernels=False)
        for e, count in enumerate(counts.tolist()):
            if count:
                error = ((out[e, :count] - expected[e, :count]).norm() / expected[e, :count].norm()).item()
                bound = 2e-2 if fp8_experts and device == "cuda" else tol
                assert error < bound, f"{activation}, fp8_experts={fp8_experts}, expert {e}: relative error {error:.3g}"
        error = ((expected - exact).norm() / exact.norm()).item()
        assert error < (0.1 if fp8_experts else 1e-6), f"fp8_experts={fp8_experts}: relative error {error:.3g}"
        if isinstance(activation, str):    # the kernels planned at the first call (GatedMLP), run on what
            plan = layer._plans.copy()     # the same buffers hold at the next
            recv_x.copy_(torch.randn(recv_x.shape, generator=g))
            counts.copy_(counts.flip(0))
            out = layer.run_experts(recv_x, None, counts, 3.0, kernels=True)
            assert len(plan) == 1 and layer._plans == plan
            expected = layer.run_experts(recv_x, None, counts, kernels=False)
            for e, count in enumerate(counts.tolist()):
                if count:
                    error = ((out[e, :count] - expected[e, :count]).norm() / expected[e, :count].norm()).item()
                    assert error < (2e-2 if fp8_experts and device == "cuda" else tol), f"second call, expert {e}"
            layer.quantize_experts()       # new FP8 weights: the plans on the old ones go
            assert not layer._plans


def test_experts_on_kernels_match_torch():
    run(_experts_on_kernels, 2)


def _relative_error(logits, exact):
    """Median over tokens of |logits - exact| / |exact| per token. A token whose router sits near a tie
    picks another expert after any rounding and takes an O(1) error, whichever model rounds: a few
    such tokens decide a norm over all tokens, and which tokens flip differs from model to model.
    The median measures the rounding itself."""
    per_token = (logits.float() - exact).norm(dim=-1) / exact.norm(dim=-1)
    return per_token.median().item()


def _fp8_rounded_expert_inputs(model, group):
    """The model with every MoE block's expert inputs rounded as FP8 dispatch rounds them."""
    def round_input(module, args):
        x = args[0]
        q, scales = quantize_fp8(x.reshape(-1, x.shape[-1]), group)
        return (dequantize_fp8(q, scales, group).to(x.dtype).reshape(x.shape), *args[1:])
    for block in [m for m in model.modules() if getattr(m, "experts", None) is not None]:
        block.experts.register_forward_pre_hook(round_input)
    return model


def _gpu_models(rank, world, kind):
    exact_model = tiny_model(kind).cuda()                  # fp32: the ground truth
    model = copy.deepcopy(exact_model).to(torch.bfloat16)
    tokens = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(rank)).cuda()
    group = 64                                             # H = 64
    with torch.no_grad():
        exact = exact_model(tokens).logits
        bf16_error = _relative_error(model(tokens).logits, exact)
        fp8_error = _relative_error(_fp8_rounded_expert_inputs(exact_model, group)(tokens).logits, exact)
        logits, swapped = {}, {}
        for backend in ("nvshmem", "reference"):
            for fp8 in (False, True):
                swapped[backend, fp8] = swap_moe(copy.deepcopy(model), backend=backend, fp8_dispatch=fp8,
                                                 fp8_group=group, max_tokens=64)
                logits[backend, fp8] = swapped[backend, fp8](tokens).logits
        for fp8 in (False, True):
            assert torch.equal(logits["nvshmem", fp8], logits["reference", fp8]), f"fp8={fp8}: backends differ"
        # bf16: the swapped model rounds where the original does (and keeps the expert intermediate in fp32).
        error = _relative_error(logits["nvshmem", False], exact)
        assert error <= 1.5 * bf16_error, f"bf16: relative error {error:.3g}, unswapped bf16 model {bf16_error:.3g}"
        # FP8 dispatch adds the rounding of the expert inputs to e4m3; independent errors add at most
        # linearly, so the bound is the same 1.5 times the sum of both sources, each measured alone.
        error = _relative_error(logits["nvshmem", True], exact)
        bound = 1.5 * (bf16_error + fp8_error)
        assert error <= bound, f"fp8: relative error {error:.3g}, bound {bound:.3g} (bf16 {bf16_error:.3g}, " \
                               f"FP8 inputs alone {fp8_error:.3g})"

        layer = next(m for m in swapped["nvshmem", True].modules() if isinstance(m, EPMoE))   # decode, CUDA graph
        x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
        layer(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = layer(x)
        for step in range(5):
            x.copy_(torch.randn(8, 64, device="cuda", dtype=torch.bfloat16))
            graph.replay()
            assert torch.equal(y, layer(x)), f"graph replay {step} differs from eager"


@pytest.mark.gpu
@gpu_worlds
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_swapped_model_on_gpus(kind, world):
    run(_gpu_models, world, kind, gpu=True, timeout=300)


def _eager_replays(rank, world):
    """Eager forwards replay CUDA graphs (EPMoE's replay): each token count on each slot of the all-to-all's
    buffers launches at its first forward (the experts replayed from their own graph where their plan has
    one), and from its second on replays its dispatch, experts and combine as one graph: bit for bit what
    launching everything gives, on fresh tokens at every forward, with the all-to-all's calls counted as
    made; for two layers, FP8 and bf16 experts (the bf16 intermediate is the larger), whose graphs share one
    scratch (the bf16 layer's capture makes it larger and the FP8 layer's graphs are captured again on it);
    on a second stream, with a scratch of its own; and interleaved with the replays of a caller's CUDA graph of
    the layer's forward. The graphs run on each forward's own tokens, ids and weights and write a new
    output: their kernels pointed at them (kernel_nodes), every forward's inputs at addresses of their own."""
    from moe_ep import graphs
    g = torch.Generator().manual_seed(rank)
    layers = [EPMoE(128, 128, 8, 2, max_tokens=16, fp8_experts=fp8, device="cuda") for fp8 in (True, False)]
    plain = [copy.deepcopy(layer) for layer in layers]
    for layer in plain:
        layer.replay = False

    kept = []                # every forward's inputs kept: the next ones lie elsewhere, the graphs' pointers move

    def forwards(steps):
        for step in range(steps):
            for layer, launched in zip(layers, plain):
                tokens = (3, 16, 0, 1, 9, 16)[step % 6] + rank
                tokens = min(tokens, 16)
                x = torch.randn(tokens, 128, generator=g).to("cuda", torch.bfloat16)
                ids, weights = random_topk(tokens, 8, 2, "cuda", g)
                kept.append((x, ids, weights))
                assert torch.equal(layer(x, ids, weights), launched(x, ids, weights)), f"step {step}"

    def replayed(layer, stream):
        """The layer's forward graphs on `stream`, each captured and on that stream's scratch in use."""
        found = [f.graph for key, f in layer._forwards.items() if key[2] == stream]
        assert found and all(isinstance(g, graphs.Replay) and g.current for g in found), found
        return found

    with torch.no_grad():
        forwards(18)             # 5 token counts a rank, each on one slot: launched, captured, then replayed
        stream = torch.cuda.current_stream().cuda_stream
        for layer in layers:
            assert len(replayed(layer, stream)) == 5 and layer._ep().calls == (18, 18)
            assert {r.key for r in replayed(layer, stream)} == {(torch.device("cuda", torch.cuda.current_device()),
                                                                 stream)}
        assert not any(layer._forwards for layer in plain)
        assert not any(plan.replays for layer in plain for plan in layer._plans.values())
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forwards(12)
        torch.cuda.current_stream().wait_stream(side)
        assert len({key[1] for key in graphs._SCRATCH.keys()}) == 2
        for layer in layers:
            assert len(replayed(layer, side.cuda_stream)) == 5
        forwards(2)
        # The caller's own CUDA graph of a forward, captured once the layer replays its forwards (inside it
        # everything is launched): its replays and eager forwards interleaved, each what launching gives.
        layer, launched = layers[0], plain[0]
        x = torch.randn(16, 128, generator=g).to("cuda", torch.bfloat16)
        ids, weights = random_topk(16, 8, 2, "cuda", g)
        caller = torch.cuda.CUDAGraph()
        with torch.cuda.graph(caller):
            y = layer(x, ids, weights)
        for step in range(3):
            x.copy_(torch.randn(16, 128, generator=g))
            new_ids, new_weights = random_topk(16, 8, 2, "cuda", g)
            ids.copy_(new_ids)
            weights.copy_(new_weights)
            caller.replay()
            assert torch.equal(y, launched(x, ids, weights)), f"the caller's graph, replay {step}"
            forwards(1)
    for layer in layers + plain:
        layer.destroy()


@pytest.mark.gpu
@gpu_worlds
def test_eager_forwards_replay_cuda_graphs(world):
    run(_eager_replays, world, gpu=True, timeout=300)


def _swapped_on_the_cpu(rank, world):
    """The usual order on a GPU machine: swap a model that still lives on the CPU, then move it. Every
    object built on the caller's behalf takes the device of the caller's tensors, whatever the job's
    group is (NCCL with a GPU per rank, gloo in shared-GPU mode): verification and a reference forward
    run on the CPU; the nvshmem all-to-all is built on the GPU at the first forward after .cuda(), and
    gives the logits of the model swapped on the GPU, bit for bit."""
    model = tiny_model("qwen3_moe")
    tokens = torch.randint(0, 96, (2, 5 + 3 * rank), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        on_cpu = swap_moe(copy.deepcopy(model), backend="reference", fp8_dispatch=False, max_tokens=64)
        assert all(p.device.type == "cpu" for p in on_cpu.parameters())
        torch.testing.assert_close(on_cpu(tokens).logits, model(tokens).logits, rtol=1e-5, atol=1e-5)
        model = model.to(torch.bfloat16)
        moved = swap_moe(copy.deepcopy(model), fp8_group=64, max_tokens=64).cuda()   # the nvshmem backend
        direct = swap_moe(copy.deepcopy(model).cuda(), fp8_group=64, max_tokens=64)
        assert torch.equal(moved(tokens.cuda()).logits, direct(tokens.cuda()).logits)
        layer = next(m for m in moved.modules() if isinstance(m, EPMoE))
        assert layer._ep().device == torch.device("cuda", torch.cuda.current_device()) and layer.backend == "nvshmem"

        tp = AsyncTP(8 * world, 32, backend="reference", dtype=torch.float32, device="cpu")
        shards = [torch.randn(8, 32, generator=torch.Generator().manual_seed(r)) for r in range(world)]
        w = torch.randn(32, 16, generator=torch.Generator().manual_seed(99))
        torch.testing.assert_close(tp.ag_gemm(shards[rank], w), torch.cat(shards) @ w)
    with pytest.raises(ValueError, match=r"nvshmem backend runs on this process's GPU .* on cpu"):
        EPAllToAll(16, 64, 8, 2, fp8_dispatch=False, device="cpu")


@pytest.mark.gpu
@gpu_worlds
def test_model_swapped_on_the_cpu_with_a_gpu_visible(world):
    run(_swapped_on_the_cpu, world, gpu=True, timeout=300)
