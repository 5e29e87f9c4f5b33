"""Per-group FP8 (e4m3) quantization: the formula the dispatch kernel applies on the fly.

For every run of `group` consecutive columns of a token:

    amax  = max(|x|, 1e-4)            (the floor keeps all-zero groups finite)
    scale = amax / 448                (fp32, IEEE division)
    q     = fp8_e4m3(x / scale)       (IEEE division, round to nearest even)
    x    ~= q * scale

`moe_ep.reference.quantize_fp8` computes the same in plain torch; both divisions are
correctly rounded here (``div_rn``) so the two agree bit for bit.
"""
import torch
import triton
import triton.language as tl

FP8_MAX = tl.constexpr(448.0)
AMAX_FLOOR = tl.constexpr(1e-4)


@triton.jit
def fp8_quantize_groups(x):
    """x: [N_GROUPS, GROUP] float32 -> (x / scale as float32 [N_GROUPS, GROUP], scale [N_GROUPS]).

    Casting the first result to tl.float8e4nv gives the FP8 values.
    """
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), AMAX_FLOOR)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32))
    return tl.math.div_rn(x, scale[:, None]), scale


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
    tl.store(q_ptr + row * hidden + cols, values.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row * num_groups + g, scale, mask=g < num_groups)


def quantize_fp8(x: torch.Tensor, group: int = 128, out_dtype: torch.dtype = torch.float8_e4m3fn):
    """x [T, H] (bf16/fp16/fp32) -> (q [T, H] out_dtype, scales [T, H // group] float32).

    ``out_dtype=torch.float32`` returns x / scale before the FP8 cast (for inspection).
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
