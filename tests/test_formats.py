"""Payload formats (moe_ep.formats): each format's kernel quantization (kernels.quant.quantize_groups) against its
torch definition, bit for bit, its round-trip bound, its shapes and bytes, and the flags that map to it.

On CPU the kernel runs in the Triton interpreter (whose float32 -> float8 cast quant.to_fp8 routes through
exact float32 rounding); on a GPU it is compiled, and the comparisons are the same.
"""
import pytest
import torch
import triton
import triton.language as tl

from cases import bits
from moe_ep import reference
from moe_ep.formats import FORMATS, format_of
from moe_ep.kernels.quant import quantize_groups

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALED = ["fp8", "fp8_ue8m0", "mxfp8", "nvfp4"]


@triton.jit(do_not_specialize=["num_groups"])
def quantize_rows_kernel(x_ptr, q_ptr, scales_ptr, tensor_scale_ptr, num_groups,
                         ELEMENT_BITS: tl.constexpr, GROUP: tl.constexpr, SCALE_KIND: tl.constexpr,
                         SCALE_PACK: tl.constexpr, BLOCK_GROUPS: tl.constexpr):
    """One program quantizes BLOCK_GROUPS groups of one row and stores them where a dispatch kernel would.

    x_ptr: [T, H] float; q_ptr: [T, H * ELEMENT_BITS / 8] one-byte payload items; scales_ptr: [T, H / GROUP /
    SCALE_PACK] scales items; tensor_scale_ptr: float32 [1]; num_groups = H // GROUP.
    """
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS)
    valid = g < num_groups
    x = tl.load(x_ptr + row * num_groups * GROUP + g[:, None] * GROUP + tl.arange(0, GROUP)[None, :],
                mask=valid[:, None], other=0.0).to(tl.float32)
    payload, scales = quantize_groups(x, tl.load(tensor_scale_ptr), SCALE_KIND, SCALE_PACK)
    GROUP_BYTES: tl.constexpr = GROUP * ELEMENT_BITS // 8
    tl.store(q_ptr + row * num_groups * GROUP_BYTES + g[:, None] * GROUP_BYTES + tl.arange(0, GROUP_BYTES)[None, :],
             payload, mask=valid[:, None])
    item = tl.program_id(1) * (BLOCK_GROUPS // SCALE_PACK) + tl.arange(0, BLOCK_GROUPS // SCALE_PACK)
    items = num_groups // SCALE_PACK
    tl.store(scales_ptr + row * items + item, scales, mask=item < items)


def kernel_quantize(fmt, x, tensor_scale=None):
    """``fmt.quantize`` computed by quantize_rows_kernel: x [T, H] -> (payload, scales)."""
    rows, hidden = x.shape
    num_groups = hidden // fmt.group
    q = torch.empty(fmt.payload_shape(rows, hidden), dtype=fmt.payload_dtype, device=x.device)
    scales = torch.empty(fmt.scales_shape(rows, hidden), dtype=fmt.scale_dtype, device=x.device)
    scale = torch.ones(1, device=x.device) if tensor_scale is None else tensor_scale.reshape(1)
    block = max(4, min(16, triton.next_power_of_2(num_groups)))      # whole int32 words of UE8M0 bytes
    quantize_rows_kernel[(rows, triton.cdiv(num_groups, block))](
        x, q, scales.view(torch.uint8) if fmt.scale_dtype == torch.float8_e8m0fnu else scales, scale, num_groups,
        BLOCK_GROUPS=block, **fmt.kernel_constants)
    return q, scales


def _assert_samebits(a, b):
    for u, v in zip(a, b):
        assert u.dtype == v.dtype and u.shape == v.shape
        assert torch.equal(bits(u), bits(v)), (bits(u) != bits(v)).nonzero()[:8].tolist()


def random_rows(tokens, hidden, seed, decades=12, dtype=torch.bfloat16):
    """tokens >= 4 rows spread over `decades` orders of magnitude, with the edge cases: an all-zero row and an
    all-zero group, a group with one huge value, an all-negative group, the extremes of e4m3."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g) * torch.logspace(-decades / 2, decades / 2, tokens)[:, None]
    x[1] = 0.0
    x[2, 32:64] = 0.0                                   # a zero group in every format (32-column aligned)
    x[2, 200] = 3e30                                    # one huge value: its group's others round to zero
    x[3, :128] = -x[3, :128].abs()
    x[3, 128:192] = 448.0
    return x.to(dtype).to(DEVICE)


def tie_rows(fmt):
    """One row whose every group has the scale 1 (amax 448; nvfp4: amax 6 with tensor scale 2^-8, block
    scale 256), filled with values halfway between two neighbours of the element grid, both signs: round to
    nearest even decides them all (e4m3: 17 -> 16, 19 -> 20, 62 -> 64 and 248 -> 256 carry into the
    exponent, 17 * 2^-8 -> 2^-4; among subnormals 2^-10 -> 0, 3 * 2^-10 -> 2^-8, 15 * 2^-10 -> 2^-6, the
    smallest normal)."""
    if fmt.element == "e2m1":
        ties = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
        top = 6.0
    else:
        ties = [448.0, 17.0, 19.0, 58.0, 62.0, 248.0, 2.0**-10, 3 * 2.0**-10, 17 * 2.0**-8, 15 * 2.0**-10]
        top = 448.0
    values = torch.tensor(ties + [-v for v in ties[1:]] + [top])
    groups = values.repeat(fmt.group // values.numel() + 1)[:fmt.group].repeat(512 // fmt.group)
    return groups[None, :].to(torch.bfloat16).to(DEVICE), torch.tensor(2.0**-8, device=DEVICE)


def _tensor_scale(fmt, x):
    return fmt.tensor_scale_of(x) if fmt.tensor_scale else None


@pytest.mark.parametrize("name", SCALED)
@pytest.mark.parametrize("tokens,hidden,seed", [(4, 512, 0), (7, 1024, 1), (5, 7168, 2)])
def test_kernel_matches_definition_bit_for_bit(name, tokens, hidden, seed):
    """On rows with the edge cases; nvfp4 also under the tensor scale of the smallest row (row 0), where the huge
    value of row 2 does not push the other block scales below e4m3's range, and the larger rows saturate."""
    fmt = FORMATS[name]
    x = random_rows(tokens, hidden, seed, decades=4)
    for scale in ((fmt.tensor_scale_of(x), fmt.tensor_scale_of(x[0])) if fmt.tensor_scale else (None,)):
        _assert_samebits(kernel_quantize(fmt, x, scale), fmt.quantize(x, scale))


@pytest.mark.parametrize("name", SCALED)
def test_kernel_matches_definition_on_float32_and_float16_rows(name):
    fmt = FORMATS[name]
    for dtype in (torch.float32, torch.float16):
        x = random_rows(6, 512, 3, dtype=torch.float32).clamp(-6e4, 6e4).to(dtype)
        scale = _tensor_scale(fmt, x)
        _assert_samebits(kernel_quantize(fmt, x, scale), fmt.quantize(x, scale))


@pytest.mark.parametrize("name", SCALED)
def test_ties_round_to_even(name):
    fmt = FORMATS[name]
    x, scale = tie_rows(fmt)
    scale = scale if fmt.tensor_scale else None
    q, scales = fmt.quantize(x, scale)
    _assert_samebits(kernel_quantize(fmt, x, scale), (q, scales))
    y = fmt.dequantize(q, scales, scale).cpu()[0, :fmt.group]
    if fmt.element == "e2m1":
        expected = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    else:
        expected = [448.0, 16.0, 20.0, 56.0, 64.0, 256.0, 0.0, 2.0**-8, 2.0**-4, 2.0**-6]
    expected = torch.tensor(expected + [-v for v in expected[1:]] + [expected[0]])
    assert torch.equal(y[:expected.numel()], expected)


def test_nvfp4_saturates_under_a_small_tensor_scale():
    """A calibrated per-tensor scale below the data's: block scales stop at 448, elements at +-6, and the
    kernel still matches the definition."""
    fmt = FORMATS["nvfp4"]
    x = random_rows(6, 512, 4)
    scale = fmt.tensor_scale_of(x) / 64
    q, scales = fmt.quantize(x, scale)
    _assert_samebits(kernel_quantize(fmt, x, scale), (q, scales))
    assert scales.float().max() == 448.0
    y = fmt.dequantize(q, scales, scale)
    assert torch.equal(y.abs().amax(), 6 * 448 * scale)


@pytest.mark.parametrize("name", SCALED)
def test_nan_and_inf(name):
    """The new formats poison a group holding a NaN or an inf (scale NaN, elements zero: all NaN once
    dequantized) and leave the others alone; "fp8" keeps today's rule, where an inf spoils its group through an
    inf scale, and its kernel's maximum skips a NaN (tests/test_quant.py)."""
    fmt = FORMATS[name]
    x = random_rows(4, 512, 5)
    x[0, 5], x[0, 300], x[1, 70] = float("inf"), float("-inf"), float("nan")
    scale = _tensor_scale(fmt, x)
    q, scales = fmt.quantize(x, scale)
    y = fmt.dequantize(q, scales, scale).cpu().unflatten(-1, (-1, fmt.group))
    poisoned = torch.zeros(y.shape[:2], dtype=torch.bool)
    poisoned[0, 5 // fmt.group] = poisoned[0, 300 // fmt.group] = poisoned[1, 70 // fmt.group] = True
    if name == "fp8":
        assert not y[0, 5 // fmt.group].isfinite().any() and y[1, 70 // fmt.group].isnan().all()
        for u, v in zip(kernel_quantize(fmt, x[[0, 2, 3]]), fmt.quantize(x[[0, 2, 3]])):   # inf * 0: NaN of
            torch.testing.assert_close(u.float(), v.float(), rtol=0, atol=0, equal_nan=True)  # either sign on CPU
        return
    assert y[poisoned].isnan().all() and y[~poisoned].isfinite().all()
    _assert_samebits(kernel_quantize(fmt, x, scale), (q, scales))
    if fmt.tensor_scale:
        assert torch.equal(scale, fmt.tensor_scale_of(x.nan_to_num(0.0, 0.0, 0.0)))


def _layouts(scales):
    """The same logical scales [T, G] (T even) in other layouts: MN-major (strides (1, T), what
    integrations.mn_major hands to engines; for G = 1 a size-1 last dimension of stride T), a column slice of a
    wider tensor at an offset, and [2, T / 2, G] MN-major per expert, the receive buffer's shape."""
    items = scales.view(torch.int32 if scales.element_size() == 4 else torch.uint8)   # copy_ on every dtype
    rows, groups = items.shape
    mn = torch.empty(groups, rows, dtype=items.dtype, device=items.device).t().copy_(items)
    wide = torch.zeros(rows, groups + 3, dtype=items.dtype, device=items.device)[:, 1:groups + 1].copy_(items)
    per_expert = torch.empty(2, groups, rows // 2, dtype=items.dtype, device=items.device).transpose(1, 2)
    per_expert.copy_(items.view(2, rows // 2, groups))
    return [(layout.view(scales.dtype), reshape) for layout, reshape in
            ((mn, False), (wide, False), (per_expert, True))]


@pytest.mark.parametrize("name", SCALED)
def test_dequantize_takes_scales_of_any_strides(name):
    """Scales laid out otherwise than quantize returns them (one scales item per row, G = 1, included: H = 512
    for fp8_ue8m0's int32 of four UE8M0 bytes) dequantize to the same values as the row-major ones."""
    fmt = FORMATS[name]
    for hidden in (fmt.hidden_multiple, 1024):
        x = random_rows(6, 1024, 10)[:, :hidden].contiguous()
        scale = _tensor_scale(fmt, x)
        q, scales = fmt.quantize(x, scale)
        expected = fmt.dequantize(q, scales, scale)
        for layout, per_expert in _layouts(scales):
            assert layout.stride() != torch.empty(layout.shape).stride()
            got = fmt.dequantize(q.view(2, 3, -1) if per_expert else q, layout, scale)
            assert torch.equal(got.view(expected.shape), expected), (hidden, layout.shape, layout.stride())


def _group_amax(x, group):
    return x.unflatten(-1, (-1, group)).abs().amax(-1).repeat_interleave(group, -1)


@pytest.mark.parametrize("name", SCALED)
def test_round_trip_bound(name):
    """The per-element bounds of the moe_ep.formats docstring, and the per-group ones they give: 2^-4 of the
    group's amax for the FP8 formats, 2^-2 for nvfp4 (but for groups below 6 t 2^-10)."""
    fmt = FORMATS[name]
    x = random_rows(12, 1024, 6).float()
    x[2, 200] = 0.0                                     # the huge value would make its group all error
    scale = _tensor_scale(fmt, x)
    q, scales = fmt.quantize(x, scale)
    error = (fmt.dequantize(q, scales, scale) - x).abs().cpu()
    x, amax = x.cpu(), _group_amax(x.cpu(), fmt.group)
    s = fmt.dequantize(torch.ones_like(q) if fmt.element == "e4m3" else torch.full_like(q, 0x22), scales, scale)
    s = s.cpu()                                         # every element of a group decodes to its scale
    if fmt.element == "e4m3":
        bound = torch.maximum(x.abs() * 2**-4, s * 2**-10) + (x.abs() * 2**-20 if name == "fp8" else 0)
        assert (error <= amax * 2**-4).all()
    else:
        floor = 6 * scale.cpu() * 2**-10
        bound = torch.maximum(torch.maximum(x.abs(), s) * 2**-2, floor) + x.abs() * 2**-22
        assert (error <= torch.maximum(amax * 2**-2, floor)).all()
    assert (error <= bound).all(), (error - bound).max()


def test_unquantized_formats_are_the_activation_dtype():
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        fmt = FORMATS[name]
        x = torch.randn(3, 64, dtype=dtype, device=DEVICE)
        q, scales = fmt.quantize(x)
        assert scales is None and q.dtype == dtype and torch.equal(q, x)
        assert torch.equal(fmt.dequantize(q, None), x.float())
        assert fmt.scales_shape(3, 64) is None and fmt.kernel_constants["GROUP"] == 0


def test_fp8_is_todays_reference_quantization():
    fmt = FORMATS["fp8"]
    x = random_rows(9, 7168, 7)
    q, scales = fmt.quantize(x)
    _assert_samebits((q, scales), reference.quantize_fp8(x, 128))
    assert torch.equal(fmt.dequantize(q, scales), reference.dequantize_fp8(q, scales, 128))


def test_ue8m0_scales_are_deepeps_rounded_powers_of_two_packed_as_deepgemm_takes_them():
    """fp8_ue8m0: each scale 2^ceil(log2(amax / 448)) (amax floored at 1e-4; for bfloat16 rows DeepEP's product
    with fp32(1 / 448) and DeepGEMM's division agree), its biased exponent byte i of int32 word j the scale of
    group 4j + i. mxfp8: the same rule per 32 columns, one float8_e8m0fnu each."""
    x = random_rows(8, 2048, 8)
    for fmt in (FORMATS["fp8_ue8m0"], FORMATS["mxfp8"]):
        q, scales = fmt.quantize(x)
        amax = x.float().unflatten(-1, (-1, fmt.group)).abs().amax(-1).clamp(min=1e-4).double()
        exponents = torch.ceil(torch.log2(amax / 448)).int() + 127
        assert torch.equal(scales.view(torch.uint8).int(), exponents)
        if fmt.scale_pack == 4:
            words = sum(exponents[..., i::4].long() << (8 * i) for i in range(4))
            assert torch.equal(scales.long() & 0xFFFFFFFF, words)
        else:
            assert torch.equal(scales.float(), 2.0 ** (exponents.float() - 127))


def test_nvfp4_layout_and_tensor_scale():
    """Two e2m1 per byte, column 2i in the low nibble; the block scale is e4m3(amax / (6 t)); t is the finite
    amax over 448 * 6."""
    fmt = FORMATS["nvfp4"]
    row = torch.tensor([0.5, 6.0, -1.0, 3.0] + [0.0] * 12 + [3.0, -0.25] + [0.0] * 14)
    x = row[None, :].to(DEVICE)
    q, scales = fmt.quantize(x, torch.tensor(1 / 448, device=DEVICE))
    assert q.cpu()[0, :2].tolist() == [0x71, 0x5A] and q.cpu()[0, 8] == 0x97     # 3 / 0.5 -> 6, -0.25 / 0.5 -> -0.5
    assert scales.float().cpu()[0].tolist() == [448.0, 224.0]
    scale = fmt.tensor_scale_of(torch.tensor([[1.0, -2688.0, float("inf"), float("nan")]]))
    assert scale.dtype == torch.float32 and scale.shape == () and scale == 1.0
    assert fmt.tensor_scale_of(torch.zeros(2, 16)) == torch.tensor(1e-4) / torch.tensor(2688.0)


def test_row_bytes_at_7168():
    expected = {"bf16": 14336, "fp16": 14336, "fp32": 28672, "fp8": 7168 + 56 * 4, "fp8_ue8m0": 7168 + 56,
                "mxfp8": 7168 + 224, "nvfp4": 3584 + 448}
    assert {name: fmt.row_bytes(7168) for name, fmt in FORMATS.items()} == expected


@pytest.mark.parametrize("name", list(FORMATS))
def test_shapes_and_dtypes_are_what_quantize_returns(name):
    fmt = FORMATS[name]
    x = torch.randn(3, 1024, device=DEVICE)
    scale = _tensor_scale(fmt, x)
    q, scales = fmt.quantize(x, scale)
    assert q.shape == fmt.payload_shape(3, 1024) and q.dtype == fmt.payload_dtype
    if fmt.group:
        assert scales.shape == fmt.scales_shape(3, 1024) and scales.dtype == fmt.scale_dtype
    assert fmt.row_bytes(1024) * 3 == q.numel() * q.element_size() + (scales.numel() * scales.element_size()
                                                                       if fmt.group else 0)


def test_bad_arguments_raise():
    x = torch.randn(2, 256)
    with pytest.raises(ValueError, match="multiple of 512"):
        FORMATS["fp8_ue8m0"].quantize(x)
    with pytest.raises(ValueError, match="needs a tensor_scale"):
        FORMATS["nvfp4"].quantize(x)
    with pytest.raises(ValueError, match="takes no tensor_scale"):
        FORMATS["fp8"].quantize(x, torch.tensor(1.0))
    with pytest.raises(ValueError, match="no per-tensor scale"):
        FORMATS["mxfp8"].tensor_scale_of(x)
    with pytest.raises(ValueError, match="needs the tensor_scale"):
        FORMATS["nvfp4"].dequantize(*FORMATS["nvfp4"].quantize(x, torch.tensor(1.0)))


def test_format_of_maps_todays_flags():
    assert format_of(True, 128, torch.bfloat16) is FORMATS["fp8"]
    assert format_of(True, 128, torch.float32) is FORMATS["fp8"]
    assert format_of(False, 128, torch.bfloat16) is FORMATS["bf16"]
    assert format_of(False, None, torch.float16) is FORMATS["fp16"]
    assert format_of(False, None, torch.float32) is FORMATS["fp32"]
    fp8_64 = format_of(True, 64, torch.bfloat16)
    assert fp8_64.name == "fp8/64" and fp8_64.group == 64 and fp8_64.row_bytes(7168) == 7168 + 112 * 4
    x = random_rows(4, 256, 9)
    _assert_samebits(fp8_64.quantize(x), reference.quantize_fp8(x, 64))
    for group in (None, 100, 8):
        with pytest.raises(ValueError, match="power of two"):
            format_of(True, group, torch.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        format_of(False, None, torch.int8)
