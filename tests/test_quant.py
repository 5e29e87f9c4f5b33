"""The FP8 quantization kernel against the torch formula of moe_ep.reference.

On CPU the kernel runs in the Triton interpreter, whose float32 -> float8 cast is not exact:
there the scales and the values before the cast are compared bit for bit. On the GPU the
FP8 bytes are compared too.
"""
import pytest
import torch

from moe_ep import quantize_fp8
from moe_ep.kernels.quant import dequantize_weights_fp8, quantize_weights_fp8
from moe_ep.reference import AMAX_FLOOR, FP8_MAX, dequantize_fp8
from moe_ep.reference import quantize_fp8 as quantize_reference


def _inputs(tokens, hidden, device):
    g = torch.Generator().manual_seed(tokens * 31 + hidden)
    x = torch.randn(tokens, hidden, generator=g) * torch.logspace(-3, 3, tokens)[:, None]
    if tokens > 2:
        x[1] = 0.0                                  # an all-zero token: the amax floor
        x[2, :64] = 448.0                           # exactly representable extremes
    return x.to(torch.bfloat16).to(device)


@pytest.mark.parametrize("tokens,hidden,group", [(1, 128, 128), (7, 512, 128), (5, 7168, 128), (3, 256, 64)])
def test_scales_and_scaled_values_exact(tokens, hidden, group):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = _inputs(tokens, hidden, device)
    values, scales = quantize_fp8(x, group, out_dtype=torch.float32)
    xf = x.float().cpu().reshape(tokens, -1, group)
    amax = xf.abs().amax(-1).clamp(min=AMAX_FLOOR)
    assert torch.equal(scales.cpu(), amax * (1.0 / FP8_MAX))
    assert torch.equal(values.cpu(), (xf * (torch.full_like(amax, FP8_MAX) / amax)[..., None]).reshape(tokens, hidden))
    assert values.abs().max() <= FP8_MAX * (1 + 2**-22)    # one float32 ulp over: the cast still gives 448


def test_zero_tokens():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, scales = quantize_fp8(torch.empty(0, 256, dtype=torch.bfloat16, device=device))
    assert q.shape == (0, 256) and scales.shape == (0, 2)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="multiple"):
        quantize_fp8(torch.zeros(2, 100), 128)
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8(torch.zeros(2, 3, 128), 128)


def test_reference_round_trip_error():
    x = _inputs(6, 512, "cpu").float()
    q, scales = quantize_reference(x)
    assert torch.isfinite(q.float()).all() and q.float().abs().max() == FP8_MAX
    error = (dequantize_fp8(q, scales) - x).abs()
    # half an e4m3 step at the top binade (16 scales), and the ulps by which scale * inverse misses 1
    bound = scales.repeat_interleave(128, dim=1) * 16 + x.abs() * 2**-20
    assert (error <= bound).all()


def test_weight_blocks_follow_the_row_formula():
    """Each 128 x 128 block of an expert's weights is quantized as one group of the row formula."""
    w = torch.randn(2, 256, 384, generator=torch.Generator().manual_seed(0)) * torch.logspace(-2, 2, 384)
    w[1, :128, :128] = 0.0                                  # an all-zero block: the amax floor
    q, scales = quantize_weights_fp8(w.bfloat16())
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (2, 2, 3)
    for e, i, j in [(0, 0, 0), (0, 1, 2), (1, 0, 0), (1, 1, 1)]:
        block = w.bfloat16()[e, i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].reshape(1, -1)
        q_ref, scale_ref = quantize_reference(block, 128 * 128)
        assert torch.equal(scales[e, i, j], scale_ref[0, 0])
        assert torch.equal(q[e, i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].view(torch.uint8).reshape(1, -1),
                           q_ref.view(torch.uint8))
    error = (dequantize_weights_fp8(q, scales) - w.bfloat16().float()).abs()
    bound = scales.repeat_interleave(128, 1).repeat_interleave(128, 2) * 16 + w.bfloat16().float().abs() * 2**-20
    assert (error <= bound).all()
    with pytest.raises(ValueError, match="multiples of the block"):
        quantize_weights_fp8(torch.zeros(1, 100, 128))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,hidden,group", [(1, 128, 128), (64, 7168, 128), (9, 2048, 64)])
def test_fp8_bytes_exact_on_gpu(tokens, hidden, group):
    x = _inputs(tokens, hidden, "cuda")
    q, scales = quantize_fp8(x, group)
    q_ref, scales_ref = quantize_reference(x, group)
    assert torch.equal(scales, scales_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_a_non_finite_value_spoils_its_group():
    """What the docs warn of: an inf in a token makes its whole FP8 group non-finite once dequantized (the
    group's amax, and so its scale, is inf), in the kernel and in the reference; the token's other group
    and the other tokens keep finite values. A NaN spoils its group in the reference (torch's amax
    propagates it), while the kernel's maximum skips it: there the group's other values stay finite."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = _inputs(3, 256, device)
    x[0, 5], x[1, 200] = float("inf"), float("nan")
    for quantize in (quantize_fp8, quantize_reference):
        y = dequantize_fp8(*quantize(x, 128)).cpu()
        assert not y[0, :128].isfinite().any() and y[0, 128:].isfinite().all(), quantize
        assert y[1, :128].isfinite().all() and y[2].isfinite().all(), quantize
    assert dequantize_fp8(*quantize_reference(x, 128))[1, 128:].isnan().all()
    assert dequantize_fp8(*quantize_fp8(x, 128))[1, 128:].cpu().isfinite().sum() >= 127     # all but the NaN's own
