"""The masked grouped GEMM kernel against its torch reference (interpreter on CPU, compiled on GPU).

Edge cases: empty experts, one row, a count equal to the capacity, every expert empty, both tile
shape classes, packed and capacity layouts on either side, FP8 rows. Rows that the counts leave
out must keep what the output held. Every case runs with each way of loading operands (VARIANTS:
pointers, tensor descriptors). The interpreter's bfloat16 dot is not usable, so bfloat16 runs on
the GPU only (one GPU is enough: those cases are skipped on CPU, not marked `gpu`).
"""
import pytest
import torch

from moe_ep.kernels.grouped_gemm import (ACTIVATIONS, TILE_CANDIDATES, VARIANTS, GatedMLP, gated_activation,
                                         gated_mlp, grouped_gemm, grouped_gemm_reference)
from moe_ep.kernels.quant import quantize_weights_fp8
from moe_ep.reference import dequantize_fp8, quantize_fp8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FILL = 7.0
on_gpu = pytest.mark.skipif(DEVICE == "cpu", reason="bfloat16 dots and large shapes: compiled, on a GPU")


def _tolerance(dtype):
    return 1e-5 if dtype == torch.float32 and DEVICE == "cpu" else 2e-2   # GPU fp32 dots run in tf32


def _inputs(experts, rows, k, n, counts, dtype, seed=0):
    g = torch.Generator().manual_seed(seed + rows * k + n)
    a = torch.randn(experts, rows, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(experts, n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    return a, w, torch.tensor(counts, dtype=torch.int32, device=DEVICE)


def _pack(x, counts):
    return torch.cat([x[e, :c] for e, c in enumerate(counts.tolist())])


def _check_capacity(out, expected, counts, tol):
    for e, count in enumerate(counts.tolist()):
        torch.testing.assert_close(out[e, :count].float(), expected[e, :count].float(), rtol=tol, atol=tol)
        assert (out[e, count:] == FILL).all(), f"expert {e}: rows past the count must not be written"


@pytest.mark.parametrize("experts,rows,k,n,counts,dtype,rows_per_expert", [
    (3, 16, 64, 32, [0, 1, 16], torch.float32, None),          # empty expert, one row, count = capacity
    (2, 70, 128, 96, [70, 5], torch.float32, None),            # N not a multiple of the tile
    (3, 130, 64, 160, [130, 0, 129], torch.float32, 1000),     # prefill tiles (128 rows), two row blocks
    (2, 8, 64, 32, [0, 0], torch.float32, None),               # nothing to do
    (2, 5, 40, 24, [5, 2], torch.float32, None),               # K not a multiple of BLOCK_K
    pytest.param(4, 8, 256, 64, [8, 0, 3, 7], torch.bfloat16, None, marks=on_gpu),
    pytest.param(8, 512, 2048, 1536, [512, 0, 1, 300, 256, 511, 64, 65], torch.bfloat16, 1000, marks=on_gpu),
    pytest.param(4, 1024, 2048, 1536, [0, 0, 1024, 0], torch.bfloat16, 256, marks=on_gpu),  # all rows to one expert
])
@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_reference(experts, rows, k, n, counts, dtype, rows_per_expert, variant):
    a, w, counts = _inputs(experts, rows, k, n, counts, dtype)
    out = torch.full((experts, rows, n), FILL, dtype=dtype, device=DEVICE)
    grouped_gemm(a, w, counts, out=out, rows_per_expert=rows_per_expert, variant=variant)
    _check_capacity(out, grouped_gemm_reference(a, w, counts), counts, _tolerance(dtype))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows_per_expert", [None, 1000])
def test_packed_out_then_packed_in(rows_per_expert, variant):
    """The GEMMs of an MoE layer: gate_up into packed rows, act(gate) * up, down back to capacity rows."""
    experts, rows, hidden, inter = 4, 20, 64, 48
    a, gate_up, counts = _inputs(experts, rows, hidden, 2 * inter, [3, 0, 20, 1], torch.float32)
    down = _inputs(experts, rows, inter, hidden, [0] * experts, torch.float32, seed=1)[1]
    packed_rows = 30                                             # > sum(counts) = 24: spare rows stay as they were
    y = torch.full((packed_rows, 2 * inter), FILL, device=DEVICE)
    grouped_gemm(a, gate_up, counts, out=y, rows_per_expert=rows_per_expert, variant=variant)
    expected_y = grouped_gemm_reference(a, gate_up, counts)
    tol = _tolerance(torch.float32)
    torch.testing.assert_close(y[:24], _pack(expected_y, counts), rtol=tol, atol=tol)
    assert (y[24:] == FILL).all()

    h = gated_activation(y, counts, rows, "silu")
    gate, up = expected_y.chunk(2, dim=-1)
    expected_h = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(h[:24], _pack(expected_h, counts), rtol=tol, atol=tol)
    out = torch.full((experts, rows, hidden), FILL, device=DEVICE)
    grouped_gemm(h, down, counts, out=out, rows_per_expert=rows_per_expert, variant=variant)
    _check_capacity(out, grouped_gemm_reference(expected_h, down, counts), counts, tol)


@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("quantize", [False, True])
def test_gated_activation(activation, quantize):
    """act(gate) * up of the counted packed rows (counts clamped to the capacity: 9 + 0 + 6 rows of 20),
    cast, or quantized per row and 128 columns with dispatch's formula."""
    g = torch.Generator().manual_seed(3)
    rows, inter = 6, 256
    gate_up = torch.randn(20, 2 * inter, generator=g).to(DEVICE)
    counts = torch.tensor([9, -2, 40], dtype=torch.int32, device=DEVICE)
    total = 6 + 0 + 6
    gate, up = gate_up[:total].chunk(2, dim=-1)
    expected = ACTIVATIONS[activation](gate) * up
    if quantize:
        h, scales = gated_activation(gate_up, counts, rows, activation, torch.float8_e4m3fn)
        assert h.dtype == torch.float8_e4m3fn and scales.shape == (20, 2)
        q, expected_scales = quantize_fp8(expected.cpu(), 128)
        torch.testing.assert_close(scales[:total].cpu(), expected_scales, rtol=1e-6, atol=0)
        torch.testing.assert_close(dequantize_fp8(h[:total].cpu(), scales[:total].cpu(), 128),
                                   dequantize_fp8(q, expected_scales, 128), rtol=0.07, atol=1e-6)  # one e4m3 step
    else:
        h = gated_activation(gate_up, counts, rows, activation)
        torch.testing.assert_close(h[:total], expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="activation"):
        gated_activation(gate_up, counts, rows, "relu")
    with pytest.raises(ValueError, match="gate_up"):
        gated_activation(gate_up[:, :100], counts, rows, activation, torch.float8_e4m3fn)


def _mlp_operands(fp8):
    """gated_mlp's operands for 3 experts of 12 rows, H = I = 128, counts [5, 0, 12]: fp32 rows and weights, FP8
    rows (fp8="rows") or FP8 rows and weights ("rows and weights"). Returns x, w13, w2, counts, scales and the
    weights' scales as gated_mlp's keywords."""
    experts, rows, hidden, inter = 3, 12, 128, 128
    x, w13, counts = _inputs(experts, rows, hidden, 2 * inter, [5, 0, 12], torch.float32)
    w2 = _inputs(experts, rows, inter, hidden, [0] * experts, torch.float32, seed=1)[1]
    scales = w13_scales = w2_scales = None
    if fp8:
        q, scales = quantize_fp8(x.view(-1, hidden).cpu(), 128)
        x, scales = q.view(experts, rows, hidden).to(DEVICE), scales.view(experts, rows, 1).to(DEVICE)
    if fp8 == "rows and weights":
        (w13, w13_scales), (w2, w2_scales) = quantize_weights_fp8(w13), quantize_weights_fp8(w2)
    return x, w13, w2, counts, scales, dict(w13_scales=w13_scales, w2_scales=w2_scales)


@pytest.mark.parametrize("fp8", ["rows", "rows and weights", None])
def test_planned_gated_mlp_launches_what_gated_mlp_launches(fp8):
    """GatedMLP, planned once on x, the weights and counts, gives gated_mlp's kernels' result bit for bit at
    every call, from what x and counts hold then (new rows written into x, new counts, one expert or all empty);
    it keeps none of the tensors it makes; bad operands and a callable activation are refused."""
    x, w13, w2, counts, scales, weights = _mlp_operands(fp8)
    planned = GatedMLP(x, w13, w2, counts, scales, packed_rows=20, rows_per_expert=4, **weights)
    g = torch.Generator().manual_seed(3)
    for new_counts in ([5, 0, 12], [1, 7, 0], [0, 0, 0], [12, 4, 3]):
        counts.copy_(torch.tensor(new_counts, dtype=torch.int32))
        x.copy_(torch.randn(x.shape, generator=g).to(x.dtype))
        out = planned()
        expected = gated_mlp(x, w13, w2, counts, scales, packed_rows=20, rows_per_expert=4, kernels=True, **weights)
        for e, count in enumerate(new_counts):
            assert torch.equal(out[e, :count], expected[e, :count])
    kept = {t.data_ptr() for t in (x, w13, w2, counts, scales, *weights.values()) if t is not None}
    for _, values in (planned._up, planned._act, planned._down):
        for value in values:
            base = getattr(value, "base", value)          # a descriptor's: the tensor it describes
            assert not isinstance(base, torch.Tensor) or base.data_ptr() in kept
    with pytest.raises(ValueError, match="activation"):
        GatedMLP(x, w13, w2, counts, scales, activation=torch.tanh, **weights)
    with pytest.raises(ValueError, match="counts"):
        GatedMLP(x, w13, w2, counts[:2], scales, **weights)
    with pytest.raises(ValueError, match=r"x must be \[E, R, H\]"):
        GatedMLP(x[0], w13, w2, counts, scales, **weights)


@pytest.mark.parametrize("activation", ["silu", torch.tanh])
@pytest.mark.parametrize("fp8", ["rows", "rows and weights", None])
def test_gated_mlp_kernels_match_its_reference(activation, fp8):
    """gated_mlp's kernels (act(gate) * up by name in a kernel, or a callable applied in torch; packed
    intermediate of fewer rows than E * R; FP8 rows, and FP8 weights with the intermediate quantized
    between the GEMMs) against its plain-torch path; out's rows past the counts kept."""
    x, w13, w2, counts, scales, weights = _mlp_operands(fp8)
    dtype = torch.bfloat16 if fp8 == "rows and weights" else torch.float32
    out = torch.full(x.shape, FILL, dtype=dtype, device=DEVICE)
    assert gated_mlp(x, w13, w2, counts, scales, activation=activation, out=out, packed_rows=20, kernels=True,
                     **weights) is out
    expected = gated_mlp(x, w13, w2, counts, scales, activation=activation, kernels=False, **weights)
    if fp8 != "rows and weights":
        _check_capacity(out, expected, counts, _tolerance(torch.float32))
        return
    # FP8 weights: the kernels round gate_up to bf16 and quantize act(gate) * up from that, the reference
    # from fp32, so a few of the down GEMM's inputs differ by an e4m3 step (2**-4 of their group's amax)
    for e, count in enumerate(counts.tolist()):
        difference = (out[e, :count].float() - expected[e, :count].float()).norm()
        assert difference <= 0.02 * expected[e, :count].float().norm(), f"expert {e}: {difference:.3g}"
        assert (out[e, count:] == FILL).all()


def test_tiles_override():
    a, w, counts = _inputs(2, 40, 64, 48, [40, 17], torch.float32)
    tiles = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2, programs_per_sm=1)
    out = torch.full((2, 40, 48), FILL, device=DEVICE)
    grouped_gemm(a, w, counts, out=out, tiles=tiles)
    _check_capacity(out, grouped_gemm_reference(a, w, counts), counts, _tolerance(torch.float32))


def test_packed_rows_argument_allocates_packed_out():
    a, w, counts = _inputs(2, 6, 32, 16, [2, 3], torch.float32)
    h = grouped_gemm(a, w, counts, packed_rows=5)
    assert h.shape == (5, 16)
    tol = _tolerance(torch.float32)
    torch.testing.assert_close(h, _pack(grouped_gemm_reference(a, w, counts), counts), rtol=tol, atol=tol)


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp8_input_dequantized_on_load(variant):
    g = torch.Generator().manual_seed(0)
    experts, rows, k, n = 2, 16, 256, 32
    x = torch.randn(experts * rows, k, generator=g)
    q, scales = quantize_fp8(x, 128)
    q, scales = q.view(experts, rows, k).to(DEVICE), scales.view(experts, rows, 2).to(DEVICE)
    w = (torch.randn(experts, n, k, generator=g) / k**0.5).to(DEVICE)
    counts = torch.tensor([16, 9], dtype=torch.int32, device=DEVICE)
    out = torch.full((experts, rows, n), FILL, device=DEVICE)
    grouped_gemm(q, w, counts, scales, 128, out=out, variant=variant)
    _check_capacity(out, grouped_gemm_reference(q, w, counts, scales, 128), counts,
                    1e-5 if DEVICE == "cpu" else 2e-2)


def test_bad_shapes_raise():
    a = torch.zeros(2, 4, 64, device=DEVICE)
    counts = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="w must be"):
        grouped_gemm(a, torch.zeros(2, 8, 32, device=DEVICE), counts)
    with pytest.raises(ValueError, match="a must be"):
        grouped_gemm(torch.zeros(3, 4, 64, device=DEVICE), torch.zeros(2, 8, 64, device=DEVICE), counts)
    with pytest.raises(ValueError, match="scales"):
        grouped_gemm(a.to(torch.float8_e4m3fn), torch.zeros(2, 8, 64, device=DEVICE), counts)
    with pytest.raises(ValueError, match="counts"):
        grouped_gemm(a, torch.zeros(2, 8, 64, device=DEVICE), counts.long())
    with pytest.raises(ValueError, match="BLOCK_K=64 must divide"):
        grouped_gemm(a.to(torch.float8_e4m3fn), torch.zeros(2, 8, 64, device=DEVICE), counts,
                     torch.ones(2, 4, 2, device=DEVICE), 32, tiles=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64,
                                                                        num_warps=4, num_stages=2, programs_per_sm=1))
    with pytest.raises(ValueError, match="variant"):
        grouped_gemm(a, torch.zeros(2, 8, 64, device=DEVICE), counts, variant="cublas")
    with pytest.raises(ValueError, match="16-byte aligned"):                   # rows of 6 fp32: 24 bytes
        grouped_gemm(torch.zeros(2, 4, 6, device=DEVICE), torch.zeros(2, 8, 6, device=DEVICE), counts, variant="tma")
    with pytest.raises(ValueError, match="out must be"):
        grouped_gemm(a, torch.zeros(2, 8, 64, device=DEVICE), counts, out=torch.zeros(2, 4, 4, device=DEVICE))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("rows_fp8", [False, True])
@pytest.mark.parametrize("rows_per_expert", [None, 1000])
def test_fp8_weights(rows_fp8, rows_per_expert, variant):
    """FP8 tensor-core path: 128 x 128 weight blocks; rows FP8 from dispatch, or quantized on load; decode
    and prefill tiles. Its error against the exact product is within 1.2x of the error of the same
    scheme computed in plain torch (dequantized operands, fp32 products; the 1.2 covers bf16 out)."""
    experts, rows, k, n = 3, 20, 256, 256
    a, w, counts = _inputs(experts, rows, k, n, [20, 0, 7], torch.float32)
    w_q, w_scales = quantize_weights_fp8(w)
    scales = None
    if rows_fp8:
        q, scales = quantize_fp8(a.reshape(-1, k).cpu(), 128)
        a, scales = q.view(a.shape).to(DEVICE), scales.view(experts, rows, 2).to(DEVICE)
    out = torch.full((experts, rows, n), FILL, dtype=torch.bfloat16, device=DEVICE)
    grouped_gemm(a, w_q, counts, scales, 128, out=out, rows_per_expert=rows_per_expert, w_scales=w_scales,
                 variant=variant)
    simulated = grouped_gemm_reference(a, w_q, counts, scales, 128, w_scales=w_scales, out_dtype=torch.float32)
    _check_capacity(out, simulated, counts, 1e-2)                  # bf16 out: one rounding apart at most
    exact = grouped_gemm_reference(a, w, counts, scales, 128, out_dtype=torch.float32)
    for e, count in enumerate(counts.tolist()):
        error = (out[e, :count].float() - exact[e, :count]).norm()
        floor = (simulated[e, :count] - exact[e, :count]).norm()
        assert error <= 1.2 * floor, f"expert {e}: error {error:.3g}, the scheme's own {floor:.3g}"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", list(TILE_CANDIDATES))
def test_tile_candidates(name, variant):
    """Every candidate tile shape bench_gemm.py times, for the weights it is meant for: small shapes
    with edges in every dimension in the interpreter, DeepSeek-V3's K on the GPU."""
    tiles, precisions = TILE_CANDIDATES[name]
    experts, rows, k, n = (4, 300, 7168, 512) if DEVICE == "cuda" else (3, 70, 256, 384)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    a, w, counts = _inputs(experts, rows, k, n, [rows, 0, 1, rows - 5][:experts], dtype)
    w_scales = None
    if "fp8" in precisions:
        q, scales = quantize_fp8(a.reshape(-1, k).float().cpu(), 128)
        a, scales = q.view(a.shape).to(DEVICE), scales.view(experts, rows, k // 128).to(DEVICE)
        w, w_scales = quantize_weights_fp8(w)
    else:
        scales = None
    out_dtype = torch.bfloat16 if "fp8" in precisions else dtype
    out = torch.full((experts, rows, n), FILL, dtype=out_dtype, device=DEVICE)
    grouped_gemm(a, w, counts, scales, 128, out=out, w_scales=w_scales, tiles=tiles, variant=variant)
    expected = grouped_gemm_reference(a, w, counts, scales, 128, w_scales=w_scales)
    _check_capacity(out, expected, counts, 2e-2 if DEVICE == "cuda" or "fp8" in precisions else 1e-5)
