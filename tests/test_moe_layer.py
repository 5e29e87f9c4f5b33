"""EPMoE and swap_moe on real transformers MoE models built from configs (no download).

CPU: gloo, world 2, reference backend, fp32: the swapped model's logits equal the original's.
"""
import copy

import pytest
import torch
from torch import nn

from distributed import run
from moe_ep import EPMoE, swap_moe

transformers = pytest.importorskip("transformers")


def tiny_model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    common = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, num_experts_per_tok=2)
    if kind == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=48, num_local_experts=8, **common)
        model = transformers.MixtralForCausalLM(config)
    else:
        config = transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                             norm_topk_prob=True, decoder_sparse_step=1, head_dim=16, **common)
        model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():                  # some experts are initialized to zeros: make every one count
        for name, p in model.named_parameters():
            if "experts" in name or "gate" in name:
                p.normal_(0, 0.2)
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
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_swapped_model_matches_original(kind):
    run(_swapped_logits_match, 2, kind)


def _both_models(rank, world):
    for kind in ("mixtral", "qwen3_moe"):
        _swapped_logits_match(rank, world, kind)


def test_swapped_models_at_8_ranks():
    run(_both_models, 8)                     # one expert per rank; one job for both models


def _bad_options(rank, world):
    with pytest.raises(ValueError, match="activation"):
        EPMoE(64, 32, 8, 2, activation="relu6", backend="reference")
    with pytest.raises(ValueError, match="multiple"):
        EPMoE(64, 32, 7, 2, backend="reference")
    with pytest.raises(ValueError, match="max_tokens"):
        EPMoE(64, 32, 8, 2, max_tokens=0, backend="reference")

    class OddBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(64, 8)
            self.experts = nn.ModuleList([nn.Linear(64, 64) for _ in range(8)])

    with pytest.raises(ValueError, match="OddBlock"):
        swap_moe(nn.Sequential(OddBlock()), backend="reference")
    with pytest.raises(ValueError, match="no MoE block"):
        swap_moe(nn.Linear(4, 4))
    layer = EPMoE(64, 32, 8, 2, backend="reference", dtype=torch.float32)
    with pytest.raises(ValueError, match="router"):
        layer(torch.zeros(3, 64))
    with pytest.raises(ValueError, match="hidden"):
        layer(torch.zeros(3, 32))


def test_bad_options_raise():
    run(_bad_options, 2)


def _gpu_models(rank, world, kind):
    model = tiny_model(kind).to("cuda", torch.bfloat16)
    tokens = torch.randint(0, 96, (2, 7 + rank), generator=torch.Generator().manual_seed(rank)).cuda()
    with torch.no_grad():
        expected = model(tokens).logits.float()
        for fp8, tolerance in ((False, 3e-2), (True, 1e-1)):      # relative L2 error of the logits
            swapped = swap_moe(copy.deepcopy(model), fp8_dispatch=fp8, fp8_group=64, max_tokens=64)   # H = 64
            logits = swapped(tokens).logits.float()
            error = ((logits - expected).norm() / expected.norm()).item()
            assert error < tolerance, f"fp8={fp8}: relative error {error:.3g}"

        layer = next(m for m in swapped.modules() if isinstance(m, EPMoE))     # a decode step in a CUDA graph
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
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_swapped_model_on_gpus(kind):
    run(_gpu_models, min(torch.cuda.device_count(), 8), kind, gpu=True, timeout=300)
