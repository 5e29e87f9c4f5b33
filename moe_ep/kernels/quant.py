"""Per-group quantization of the dispatch payload formats (``moe_ep.formats``): the formulas the dispatch kernel
applies on the fly, each a Triton helper over a [N_GROUPS, GROUP] float32 tile, beside its plain-torch twin
(``quantize_rows_*``), the two bit for bit the same on every device.

FP8 (format "fp8", today's FP8 dispatch), for every run of `group` consecutive columns of a token:

    amax    = max(|x|, 1e-4)              (the floor keeps all-zero groups finite)
    scale   = amax * fp32(1 / 448)        (what dequantization multiplies by)
    inverse = 448 / amax                  (fp32, IEEE division: one per group)
    q       = fp8_e4m3(x * inverse)       (round to nearest even)
    x      ~= q * scale

A product per element, not a division: a correctly rounded division per element cost the dispatch
kernel a quarter of its send at 4096 tokens on an H200 (benchmarks/NOTES.md). `moe_ep.reference.quantize_fp8`
computes the same in plain torch; the one division is correctly rounded on both sides (``div_rn``
here; a tensor by a tensor there, which torch does not turn into a product with the reciprocal as
it does a division by a constant), so the two agree bit for bit.

UE8M0 (power-of-two scales; formats "fp8_ue8m0" and "mxfp8"), DeepEP's ``round_scale=True``:

    e       = ceil(log2(max(amax, 1e-4) * fp32(1 / 448)))   (read off the float32 bits of the product)
    scale   = 2^e, stored as its biased exponent byte e + 127 (UE8M0; 105 <= e + 127 <= 246)
    q       = fp8_e4m3(x * 2^-e)                            (an exact product; round to nearest even)

NVFP4 (format "nvfp4": groups of 16, an e4m3 block scale s, a float32 per-tensor scale t > 0):

    s       = fp8_e4m3(min(amax / (6 * t), 448))            (IEEE division; round to nearest even)
    inverse = 1 / (s * t), or 0 where s == 0                (IEEE division, one per group)
    q       = e2m1(x * inverse)                             (``round_to_e2m1``), x ~= q * s * t

In these two a group holding a NaN or an inf is poisoned: its scale is NaN (UE8M0 0xFF, e4m3 0x7F), its
elements are zeros, so it dequantizes to NaN entirely, while the amax of the other groups sees finite values
only. (FP8 keeps its own rule: an inf makes its group's scale inf, a NaN only itself NaN in the kernel.)

Scale kinds are protocol: a kernel takes one as ``SCALE_KIND: tl.constexpr`` (``quantize_groups``), and a
format's ``kernel_constants`` names it.

The Triton interpreter (TRITON_INTERPRET=1, CPU) casts float32 to float8 wrongly when the rounding carries
into the exponent, a NaN to -256, and to bfloat16 by truncation; there ``to_fp8`` and ``cast_rn`` round in
float32 arithmetic first, so that the cast itself is exact and CPU tests compare bytes too. On the GPU both
are plain casts.
"""
import torch
import triton
import triton.language as tl

from ..shmem import INTERPRETING

FP8_MAX = tl.constexpr(448.0)
INV_FP8_MAX = tl.constexpr(1.0 / 448.0)
AMAX_FLOOR = tl.constexpr(1e-4)
FP32_MAX = tl.constexpr(torch.finfo(torch.float32).max)
E2M1_MAX = tl.constexpr(6.0)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)      # the magnitude of e2m1 codes 0-7 (8-15: negated)
UE8M0_NAN = tl.constexpr(0xFF)     # the one UE8M0 byte that is not a power of two
E4M3_NAN = tl.constexpr(0x7F)      # e4m3's positive NaN byte

SCALE_NONE = tl.constexpr(0)       # no scales: the payload is the activation dtype itself
SCALE_FP32 = tl.constexpr(1)       # float32 amax / 448 per group (``fp8_quantize_groups``)
SCALE_UE8M0 = tl.constexpr(2)      # a power of two per group, its biased exponent byte (``ue8m0_quantize_groups``)
SCALE_E4M3 = tl.constexpr(3)       # an e4m3 per group times a float32 per tensor (``nvfp4_quantize_groups``)


@triton.jit
def round_to_e4m3(x):
    """Round float32 values (|x| <= 448) to the nearest e4m3 value, ties to even, in float32, keeping the sign
    as the cast does (-1e-9 -> -0.0)."""
    a = tl.abs(x)
    exponent = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)   # -6: subnormals
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)                   # 3 mantissa bits
    scaled = a / step                                                                  # exact: a power of 2
    low = tl.floor(scaled)
    rest = scaled - low
    odd = (low - 2.0 * tl.floor(low * 0.5)) != 0.0
    rounded = (low + ((rest > 0.5) | ((rest == 0.5) & odd)).to(tl.float32)) * step
    return tl.where(x.to(tl.int32, bitcast=True) < 0, -rounded, rounded)


@triton.jit
def round_to_bf16(x):
    """Round float32 values to the nearest bfloat16 value, ties to even, in float32."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


if INTERPRETING:
    @triton.jit
    def to_fp8(x):
        """float32 -> float8 e4m3, round to nearest even, NaN -> 0x7F, as on the GPU (exact under the
        interpreter too, whose cast makes a NaN -256)."""
        q = round_to_e4m3(x).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        return tl.where(x == x, q, E4M3_NAN).to(tl.uint8).to(tl.float8e4nv, bitcast=True)

    @triton.jit
    def cast_rn(x, dtype: tl.constexpr):
        """float32 -> dtype, round to nearest even (exact under the interpreter too)."""
        if dtype == tl.bfloat16:
            x = round_to_bf16(x)
        return x.to(dtype)
else:
    @triton.jit
    def to_fp8(x):
        """float32 -> float8 e4m3, round to nearest even."""
        return x.to(tl.float8e4nv)

    @triton.jit
    def cast_rn(x, dtype: tl.constexpr):
        """float32 -> dtype, round to nearest even."""
        return x.to(dtype)


@triton.jit
def fp8_quantize_groups(x):
    """x: [N_GROUPS, GROUP] float32 -> (x * inverse as float32 [N_GROUPS, GROUP], scale [N_GROUPS]).

    ``to_fp8`` of the first result gives the FP8 values.
    """
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), AMAX_FLOOR)
    inverse = tl.math.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), amax)
    return x * inverse[:, None], amax * INV_FP8_MAX


@triton.jit
def finite_amax(x):
    """x: [N_GROUPS, GROUP] float32 -> (amax of each group's finite |x| [N_GROUPS] float32, 0 where none;
    whether the group holds a NaN or an inf [N_GROUPS] int1): what the poisoning rule of the module docstring
    reads."""
    a = tl.abs(x)
    finite = a <= FP32_MAX                                   # False for NaN and inf
    return tl.max(tl.where(finite, a, 0.0), axis=1), tl.min(finite.to(tl.int32), axis=1) == 0


@triton.jit
def ue8m0_quantize_groups(x):
    """x: [N_GROUPS, GROUP] float32 -> (e4m3 [N_GROUPS, GROUP] float8e4nv, biased scale exponents [N_GROUPS]
    uint8): the UE8M0 formula of the module docstring, x ~= q * 2^(exponent - 127)."""
    amax, poisoned = finite_amax(x)
    bits = (tl.maximum(amax, AMAX_FLOOR) * INV_FP8_MAX).to(tl.int32, bitcast=True)
    biased = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)       # 127 + ceil(log2(.))
    inverse = ((254 - biased) << 23).to(tl.float32, bitcast=True)                 # 2^-e, exactly
    values = tl.where(poisoned[:, None], 0.0, x * inverse[:, None])
    return to_fp8(values), tl.where(poisoned, UE8M0_NAN, biased).to(tl.uint8)


@triton.jit
def _bitwise_or(a, b):
    """The combine of ``pack_bytes4``'s reduction."""
    return a | b


@triton.jit
def pack_bytes4(b):
    """b: [N] uint8, N a multiple of 4 -> [N // 4] int32 whose byte i (little-endian) is b[4 * j + i]: four
    UE8M0 exponents per word, as DeepGEMM takes packed scales."""
    words = tl.reshape(b.to(tl.int32), (b.shape[0] // 4, 4)) << (tl.arange(0, 4) * 8)[None, :]
    return tl.reduce(words, 1, _bitwise_or)


@triton.jit
def round_to_e2m1(v):
    """float32 -> e2m1 codes as uint8 in [0, 16): bit 3 the sign, bits 0-2 the index into the magnitudes
    {0, 0.5, 1, 1.5, 2, 3, 4, 6}. Round to nearest, ties (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) to the even
    index; beyond 6 saturate to 6 (e2m1 has no inf); the sign is kept (-0.1 -> -0, where DeepGEMM's reference
    writes the same value as +0); NaN -> +0."""
    a = tl.abs(v)
    index = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
             + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
             + (a > 5.0).to(tl.int32))
    return (index + 8 * (v < 0.0).to(tl.int32)).to(tl.uint8)


@triton.jit
def nvfp4_quantize_groups(x, tensor_scale):
    """x: [N_GROUPS, GROUP] float32, tensor_scale: the float32 per-tensor scale (> 0) -> (e2m1 pairs
    [N_GROUPS, GROUP // 2] uint8, the even column in the low nibble; block scales [N_GROUPS] float8e4nv): the
    NVFP4 formula of the module docstring, x ~= q * s * tensor_scale."""
    amax, poisoned = finite_amax(x)
    target = tl.math.div_rn(amax, tl.full(amax.shape, E2M1_MAX, tl.float32) * tensor_scale)
    block = to_fp8(tl.minimum(target, FP8_MAX))
    s = block.to(tl.float32)
    divisor = tl.where(s > 0.0, s * tensor_scale, 1.0)                           # no 1 / 0 where s is 0
    inverse = tl.where(s > 0.0, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), divisor), 0.0)
    codes = round_to_e2m1(tl.where(poisoned[:, None], 0.0, x * inverse[:, None]))
    low, high = tl.split(tl.reshape(codes, (x.shape[0], x.shape[1] // 2, 2)))
    scales = tl.where(poisoned, E4M3_NAN, block.to(tl.uint8, bitcast=True)).to(tl.uint8)
    return low | (high << 4), scales.to(tl.float8e4nv, bitcast=True)


@triton.jit
def quantize_groups(x, tensor_scale, SCALE_KIND: tl.constexpr, SCALE_PACK: tl.constexpr):
    """x: [N_GROUPS, GROUP] float32 -> (payload, scales) as a kernel stores them, for a format with scales
    (``PayloadFormat.kernel_constants`` names SCALE_KIND and SCALE_PACK):

        SCALE_FP32    float8e4nv [N_GROUPS, GROUP], float32 [N_GROUPS]
        SCALE_UE8M0   float8e4nv [N_GROUPS, GROUP], uint8 [N_GROUPS] (SCALE_PACK 1) or int32 [N_GROUPS // 4] (4)
        SCALE_E4M3    uint8 [N_GROUPS, GROUP // 2] (e2m1 pairs), float8e4nv [N_GROUPS]

    tensor_scale: the float32 per-tensor scale of SCALE_E4M3, unused by the others.
    """
    if SCALE_KIND == SCALE_FP32:
        values, scales = fp8_quantize_groups(x)
        payload = to_fp8(values)
    elif SCALE_KIND == SCALE_UE8M0:
        payload, scales = ue8m0_quantize_groups(x)
        if SCALE_PACK == 4:
            scales = pack_bytes4(scales)
    else:
        tl.static_assert(SCALE_KIND == SCALE_E4M3, "quantize_groups: a format with scales")
        payload, scales = nvfp4_quantize_groups(x, tensor_scale)
    return payload, scales


@triton.jit(do_not_specialize=["num_groups"])
def quantize_fp8_kernel(x_ptr, q_ptr, scale_ptr, num_groups,
                        GROUP: tl.constexpr, GROUPS_PER_PROGRAM: tl.constexpr):
    """One program quantizes GROUPS_PER_PROGRAM groups of one row (token).

    x_ptr: [T, H] any float; q_ptr: [T, H] float8 (or float32 to read the values before the cast);
    scale_ptr: [T, H // GROUP] float32; num_groups = H // GROUP.
    """
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
    cols = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = (g < num_groups)[:, None]
    hidden = num_groups * GROUP
    x = tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    values, scale = fp8_quantize_groups(x)
    if q_ptr.dtype.element_ty == tl.float8e4nv:
        values = to_fp8(values)
    tl.store(q_ptr + row * hidden + cols, values.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row * num_groups + g, scale, mask=g < num_groups)


def quantize_fp8(x: torch.Tensor, group: int = 128, out_dtype: torch.dtype = torch.float8_e4m3fn):
    """x [T, H] (bf16/fp16/fp32) -> (q [T, H] out_dtype, scales [T, H // group] float32).

    ``out_dtype=torch.float32`` returns x * inverse before the FP8 cast (for inspection).
    """
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous 2-D tensor, got shape {tuple(x.shape)}")
    if x.shape[1] % group:
        raise ValueError(f"hidden size {x.shape[1]} is not a multiple of the group {group}")
    tokens, hidden = x.shape
    num_groups = hidden // group
    q = torch.empty((tokens, hidden), dtype=out_dtype, device=x.device)
    scales = torch.empty((tokens, num_groups), dtype=torch.float32, device=x.device)
    if tokens:
        per_program = min(16, triton.next_power_of_2(num_groups))
        grid = (tokens, triton.cdiv(num_groups, per_program))
        quantize_fp8_kernel[grid](x, q, scales, num_groups, GROUP=group, GROUPS_PER_PROGRAM=per_program)
    return q, scales


def quantize_weights_fp8(w: torch.Tensor, block: int = 128):
    """Expert weights w [E, N, K] -> (q [E, N, K] float8_e4m3fn, scales [E, N / block, K / block] float32).

    One scale per block x block tile (N and K multiples of block), the formula of the rows (module
    docstring) with the tile as the group. Plain torch: it runs once, when a layer's weights are quantized.
    """
    experts, n, k = w.shape
    if n % block or k % block:
        raise ValueError(f"weights [{experts}, {n}, {k}]: N and K must be multiples of the block {block}")
    tiles = w.float().reshape(experts, n // block, block, k // block, block)
    scales, inverse = _scale_and_inverse(tiles.abs().amax(dim=(2, 4)))
    q = (tiles * inverse[:, :, None, :, None]).to(torch.float8_e4m3fn)
    return q.reshape(experts, n, k), scales


def _scale_and_inverse(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula's scale and inverse (module docstring) of each group's amax (float32), in plain torch."""
    amax = amax.clamp(min=AMAX_FLOOR.value)
    return amax * INV_FP8_MAX.value, torch.full_like(amax, FP8_MAX.value) / amax


def dequantize_weights_fp8(q: torch.Tensor, scales: torch.Tensor, block: int = 128) -> torch.Tensor:
    """(q [E, N, K] fp8, scales [E, N / block, K / block]) -> float32 [E, N, K]."""
    full = scales.repeat_interleave(block, dim=1).repeat_interleave(block, dim=2)
    return q.float() * full


def quantize_rows_fp8(x: torch.Tensor, group: int = 128):
    """x [..., H] -> (q [..., H] float8_e4m3fn, scales [..., H / group] float32) in plain torch, the formula
    of the module docstring per `group` columns: for the paths without the kernel (the torch.distributed backend,
    any device)."""
    groups = x.float().unflatten(-1, (-1, group))
    scales, inverse = _scale_and_inverse(groups.abs().amax(-1))
    return (groups * inverse[..., None]).to(torch.float8_e4m3fn).flatten(-2), scales


def dequantize_rows_fp8(q: torch.Tensor, scales: torch.Tensor, group: int = 128) -> torch.Tensor:
    """(q [..., H] fp8 (or any values), scales [..., H / group]) -> float32 [..., H]: each group times its
    scale."""
    return (q.float().unflatten(-1, (-1, group)) * scales[..., None]).flatten(-2)


def _finite_amax(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``finite_amax`` in plain torch: groups [..., G, C] float32 -> (amax of the finite |values| [..., G], 0
    where none; whether the group holds a NaN or an inf [..., G] bool)."""
    a = groups.abs()
    finite = a <= FP32_MAX.value
    return torch.where(finite, a, 0.0).amax(-1), ~finite.all(-1)


def quantize_rows_ue8m0(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] -> (q [..., H] float8_e4m3fn, biased scale exponents [..., H / group] uint8) in plain torch:
    the UE8M0 formula of the module docstring (``ue8m0_quantize_groups``)."""
    groups = x.float().unflatten(-1, (-1, group))
    amax, poisoned = _finite_amax(groups)
    bits = (amax.clamp(min=AMAX_FLOOR.value) * INV_FP8_MAX.value).view(torch.int32)
    biased = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).int()
    inverse = ((254 - biased) << 23).view(torch.float32)
    q = torch.where(poisoned[..., None], 0.0, groups * inverse[..., None]).to(torch.float8_e4m3fn)
    return q.flatten(-2), torch.where(poisoned, UE8M0_NAN.value, biased).to(torch.uint8)


def dequantize_rows_ue8m0(q: torch.Tensor, exponents: torch.Tensor, group: int) -> torch.Tensor:
    """(q [..., H] fp8, biased exponents [..., H / group] uint8) -> float32 [..., H]; exponent 0xFF is NaN."""
    biased = exponents.int()
    scales = torch.where(biased == UE8M0_NAN.value, float("nan"), (biased << 23).view(torch.float32))
    return dequantize_rows_fp8(q, scales, group)


def _round_to_e2m1(v: torch.Tensor) -> torch.Tensor:
    """``round_to_e2m1`` in plain torch: float32 -> e2m1 codes, uint8 in [0, 16)."""
    a = v.abs()
    index = ((a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int() + (a > 2.5).int()
             + (a >= 3.5).int() + (a > 5.0).int())
    return (index + 8 * (v < 0).int()).to(torch.uint8)


def nvfp4_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """x [...] -> float32 [] on x's device: NVIDIA's per-tensor decode scale, max(amax of x's finite values,
    1e-4) / (448 * 6), a correctly rounded division."""
    amax = _finite_amax(x.detach().float().reshape(1, -1))[0][0].clamp(min=AMAX_FLOOR.value)
    return amax / torch.full_like(amax, FP8_MAX.value * E2M1_MAX.value)


def quantize_rows_nvfp4(x: torch.Tensor, tensor_scale: torch.Tensor, group: int = 16):
    """x [..., H], tensor_scale float32 [] (> 0) -> (e2m1 pairs [..., H / 2] uint8, the even column in the low
    nibble; block scales [..., H / group] float8_e4m3fn) in plain torch: the NVFP4 formula of the module
    docstring (``nvfp4_quantize_groups``)."""
    groups = x.float().unflatten(-1, (-1, group))
    amax, poisoned = _finite_amax(groups)
    scale = tensor_scale.to(device=x.device, dtype=torch.float32).expand_as(amax)   # divided as a tensor
    block = (amax / (E2M1_MAX.value * scale)).clamp(max=FP8_MAX.value).to(torch.float8_e4m3fn)
    s = block.float()
    inverse = torch.where(s > 0, torch.ones_like(s) / (s * scale), 0.0)
    codes = _round_to_e2m1(torch.where(poisoned[..., None], 0.0, groups * inverse[..., None])).flatten(-2)
    scales = torch.where(poisoned, E4M3_NAN.value, block.view(torch.uint8)).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), scales.view(torch.float8_e4m3fn)


def dequantize_rows_nvfp4(q: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor,
                          group: int = 16) -> torch.Tensor:
    """(e2m1 pairs [..., H / 2] uint8, block scales [..., H / group] float8_e4m3fn, tensor_scale float32 [])
    -> float32 [..., H]: q * (s * tensor_scale), the product the quantization divided by."""
    magnitudes = torch.tensor(E2M1_VALUES, device=q.device)
    table = torch.cat((magnitudes, -magnitudes))
    values = table[torch.stack((q & 0xF, q >> 4), -1).flatten(-2).long()]
    factor = scales.float() * tensor_scale.to(device=q.device, dtype=torch.float32)
    return dequantize_rows_fp8(values, factor, group)
