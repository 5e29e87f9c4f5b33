"""The masked grouped GEMM kernel against the torch reference (interpreter on CPU, compiled on GPU).

The interpreter's bfloat16 dot is not usable, so bfloat16 runs on the GPU only.
"""
import pytest
import torch

from moe_ep.kernels.grouped_gemm import grouped_gemm
from moe_ep.reference import grouped_gemm as grouped_gemm_reference
from moe_ep.reference import quantize_fp8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("experts,rows,k,n,counts,dtype", [
    (3, 16, 64, 32, [0, 1, 16], torch.float32),
    (2, 70, 128, 96, [70, 5], torch.float32),
    pytest.param(4, 8, 256, 64, [8, 0, 3, 7], torch.bfloat16, marks=pytest.mark.gpu),
])
def test_matches_reference(experts, rows, k, n, counts, dtype):
    g = torch.Generator().manual_seed(rows * k)
    a = torch.randn(experts, rows, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(experts, n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    counts = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
    out = torch.full((experts, rows, n), 7.0, dtype=dtype, device=DEVICE)
    grouped_gemm(a, w, counts, out=out)
    expected = grouped_gemm_reference(a, w, counts)
    tol = 1e-5 if dtype == torch.float32 and DEVICE == "cpu" else 2e-2   # GPU fp32 dots run in tf32
    for e, count in enumerate(counts.tolist()):
        torch.testing.assert_close(out[e, :count].float(), expected[e, :count].float(), rtol=tol, atol=tol)
        assert (out[e, count:] == 7.0).all(), "rows past the count must not be written"


def test_fp8_input_dequantized_on_load():
    g = torch.Generator().manual_seed(0)
    experts, rows, k, n = 2, 16, 256, 32
    x = torch.randn(experts * rows, k, generator=g)
    q, scales = quantize_fp8(x, 128)
    q, scales = q.view(experts, rows, k).to(DEVICE), scales.view(experts, rows, 2).to(DEVICE)
    w = (torch.randn(experts, n, k, generator=g) / k**0.5).to(DEVICE)
    counts = torch.tensor([16, 9], dtype=torch.int32, device=DEVICE)
    out = grouped_gemm(q, w, counts, scales, 128)
    expected = grouped_gemm_reference(q, w, counts, scales, 128)
    tol = 1e-5 if DEVICE == "cpu" else 2e-2
    for e, count in enumerate(counts.tolist()):
        torch.testing.assert_close(out[e, :count], expected[e, :count], rtol=tol, atol=tol)


def test_bad_shapes_raise():
    a = torch.zeros(2, 4, 64, device=DEVICE)
    with pytest.raises(ValueError, match="w must be"):
        grouped_gemm(a, torch.zeros(3, 8, 64, device=DEVICE), torch.zeros(2, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="scales"):
        grouped_gemm(a.to(torch.float8_e4m3fn), torch.zeros(2, 8, 64, device=DEVICE),
                     torch.zeros(2, dtype=torch.int32, device=DEVICE))
