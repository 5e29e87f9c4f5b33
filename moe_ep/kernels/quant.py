"""Per-group FP8 (e4m3) quantization: the formula the dispatch kernel applies on the fly.

For every run of `group` consecutive columns of a token:

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

The Triton interpreter (TRITON_INTERPRET=1, CPU) casts float32 to float8 wrongly when the
rounding carries into the exponent, and to bfloat16 by truncation; there ``to_fp8`` and
``cast_rn`` round in float32 arithmetic first, so that the cast itself is exact and CPU tests
compare bytes too. On the GPU both are plain casts.
"""
import torch
import triton
import triton.language as tl

from ..shmem import INTERPRETING

FP8_MAX = tl.constexpr(448.0)
INV_FP8_MAX = tl.constexpr(1.0 / 448.0)
AMAX_FLOOR = tl.constexpr(1e-4)


@triton.jit
def round_to_e4m3(x):
    """Round float32 values (|x| <= 448) to the nearest e4m3 value, ties to even, in float32."""
    exponent = tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)   # -6: subnormals
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)                   # 3 mantissa bits
    scaled = x / step                                                                  # exact: a power of 2
    low = tl.floor(scaled)
    rest = scaled - low
    odd = (low - 2.0 * tl.floor(low * 0.5)) != 0.0
    return (low + ((rest > 0.5) | ((rest == 0.5) & odd)).to(tl.float32)) * step


@triton.jit
def round_to_bf16(x):
    """Round float32 values to the nearest bfloat16 value, ties to even, in float32."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


if INTERPRETING:
    @triton.jit
    def to_fp8(x):
        """float32 -> float8 e4m3, round to nearest even (exact under the interpreter too)."""
        return round_to_e4m3(x).to(tl.float8e4nv)

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
    """(q [..., H] fp8, scales [..., H / group]) -> float32 [..., H]."""
    return (q.float().unflatten(-1, (-1, group)) * scales[..., None]).flatten(-2)
