"""The async-TP tile loop alone (``moe_ep.kernels.matmul``), every variant against torch: in the
Triton interpreter on CPU, compiled on a GPU (one is enough). Sums are fp32; the reference is
float64 (fp32 and fp16 cases) or fp32 (bf16 on the GPU, where the interpreter's bf16 dot is not usable).
"""
import pytest
import torch

from moe_ep.kernels.matmul import VARIANTS, loads_through_descriptors, matmul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROGRAMS = torch.cuda.get_device_properties(0).multi_processor_count if DEVICE == "cuda" else 3
on_gpu = pytest.mark.skipif(DEVICE == "cpu", reason="bfloat16 dots and large shapes: compiled, on a GPU")


def operands(m, k, n, dtype, transposed, seed):
    """a [M, K]; w [K, N] contiguous, or an nn.Linear-style [N, K] weight seen through .t()."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).t() if transposed else torch.randn(k, n, generator=g)
    return a.to(DEVICE), (w * k ** -0.5).to(dtype).to(DEVICE)


# M, K, N, dtype, w transposed
CASES = [
    (150, 64, 300, torch.float32, False),       # two row tiles, three column tiles
    (70, 40, 136, torch.float32, True),         # K not a multiple of BLOCK_K, w through .t()
    (1, 48, 20, torch.float32, False),          # one row
    (33, 64, 96, torch.float16, True),          # (the interpreter computes bf16 dots wrongly; fp16 stands in)
    (0, 64, 96, torch.float32, False),          # no rows
    pytest.param(1000, 1024, 3000, torch.bfloat16, True, marks=on_gpu),      # edges in M and N, 128 x 256 tiles
    pytest.param(2048, 4096, 7168, torch.bfloat16, True, marks=on_gpu),      # bench_gemm.py's d tp2 AG
    pytest.param(16384, 8192, 4096, torch.bfloat16, True, marks=on_gpu),     # its largest M (c tp2 AG)
    pytest.param(512, 1024, 2048, torch.bfloat16, False, marks=on_gpu),      # w row-major
]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("m,k,n,dtype,transposed", CASES)
def test_matches_torch(m, k, n, dtype, transposed, variant):
    a, w = operands(m, k, n, dtype, transposed, seed=m + k + n)
    out = matmul(a, w, PROGRAMS, variant=variant)
    if dtype == torch.bfloat16:
        expected, tol = a.float() @ w.float(), 2e-2                  # bf16 output: 2**-8 relative, k terms in fp32
        torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)
    else:
        tol = 1e-4 if dtype == torch.float32 and DEVICE == "cpu" else 1e-2   # GPU fp32 dots run in tf32
        torch.testing.assert_close(out.double(), a.double() @ w.double(), rtol=tol, atol=tol)


def test_descriptors_refuse_what_tma_cannot_address():
    a, w = operands(8, 40, 130, torch.float32, False, seed=0)   # out's rows: 130 * 4 bytes, not a multiple of 16
    torch.testing.assert_close(matmul(a, w, PROGRAMS, variant="pointer"), a @ w, rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="16-byte aligned"):
        matmul(a, w, PROGRAMS, variant="tma")
    assert not loads_through_descriptors("tma", a, w)                 # the fused kernels fall back to pointers
    with pytest.raises(ValueError, match="variant"):
        matmul(a, w, PROGRAMS, variant="cublas")
