"""Dispatch payload formats: what a token's row becomes on its way to the expert ranks, one object each.

A format says how a row of H activations is encoded (its elements, the scales of its groups of columns,
the bytes that leave a GPU per row), defines that encoding bit for bit in plain torch (``quantize``,
``dequantize``: the formulas of ``moe_ep.kernels.quant``, which the kernels match), and names what a kernel
needs to apply it on the fly (``kernel_constants``, for ``kernels.quant.quantize_groups``). ``FORMATS``
holds them by name; ``format_of`` maps the flags of ``EPAllToAll`` (fp8_dispatch, fp8_group, dtype) to one.

    name              elements                scales of a row                                bytes per row, H = 7168
    bf16, fp16, fp32  the activation dtype    none                                           2H, 2H, 4H (14336 ...)
    fp8               e4m3                    float32 amax / 448 per 128 columns             H + 4 H / 128 = 7392
    fp8_ue8m0         e4m3                    UE8M0 per 128, four packed in an int32         H + H / 128 = 7224
    mxfp8             e4m3                    UE8M0 per 32, one float8_e8m0fnu each          H + H / 32 = 7392
    nvfp4             e2m1, two per byte      e4m3 per 16, and one float32 per tensor        H / 2 + H / 16 = 4032

"fp8" is today's FP8 dispatch (``fp8_dispatch=True``): ``reference.quantize_fp8`` bit for bit.

"fp8_ue8m0" rounds each scale up to a power of two as DeepEP's low-latency dispatch does with
``round_scale=True``: 2^ceil(log2(max(amax, 1e-4) * fp32(1 / 448))), the ceiling read off the float32 bits
of that product (DeepEP's ``fast_log2_ceil``; DeepGEMM's ``per_token_cast_to_fp8`` divides by 448 instead,
which can differ for float32 inputs within an ulp of 448 * 2^k, never for bfloat16 ones). The scales of a row
are its UE8M0 bytes (the biased exponent e + 127) in column order, four to an int32, byte i of word j
(little-endian) the scale of group 4j + i: DeepGEMM's packed UE8M0 (``pack_ue8m0_to_int``), which is also
what DeepEP's ``use_ue8m0=True`` hands back per token ([..., H / 512] int32). Both want a tensor's scales
MN-major for TMA (stored [H / 512, rows], rows a multiple of 4, and viewed transposed); here each row's scales
stay with the row, as they cross the wire, and a receiver that feeds DeepGEMM lays them out so.
DeepEP sends each scale as a float32 (4 bytes); this format sends one byte.

"mxfp8" is OCP MX's MXFP8 (e4m3 elements, one UE8M0 shared scale per 32) with the same power-of-two scale,
rounded up. The OCP MX spec (v1.0) takes 2^(floor(log2(amax)) - 8) and clamps the elements that then
overflow: values of (448, 512) * scale saturate to 448, an error up to 12.5%. Rounding up, as NVIDIA's
MXFP8 recipe and Transformer Engine do, makes every element fit, so each keeps its half-ulp bound, for at
most one binade of range. Any MX reader decodes it (x = q * 2^(E - 127)). Its scales are one byte per group
in column order (float8_e8m0fnu); the same bytes viewed as int32 are DeepGEMM's packed (1, 32) scales, and
Blackwell's block-scaled MMA wants them swizzled, which a receiver does.

"nvfp4" is NVIDIA's NVFP4: e2m1 elements, two per byte (column 2i in the low nibble, 2i + 1 in the high one,
the order of torch.float4_e2m1fn_x2 and of DeepGEMM's per_token_cast_to_fp4), an e4m3 scale per 16 columns,
and a float32 per-tensor scale t = global amax / (448 * 6), the decode scale of NVIDIA's recipe (its encode
scale is (448 * 6) / amax, TensorRT-LLM's SFScaleVal, Transformer Engine's S_enc): block scales then use
e4m3's whole range. Per block s = e4m3(amax / (6 t)), elements e2m1(x / (s t)), x ~= q * s * t. NVIDIA
computes the two quotients with approximate reciprocals; here they are correctly rounded divisions, so kernel
and torch agree bit for bit (TensorRT-LLM's bytes can differ in the last ulp of a block's factor). A dispatch
needs t before its first token: ``tensor_scale_of(x)`` measures it on a tensor (the amax of its finite
values, floored at 1e-4); a calibrated one (a checkpoint's input scale) is passed as is and must be positive:
where x exceeds 448 * 6 * t, block scales saturate at 448 and elements at 6. ``EPAllToAll.dispatch`` takes a
calibrated t per call (``tensor_scale=``, float32 [1] on the device, read there, no sync), the same on every
rank: a receiver decodes every source's rows with it. Rows travel as H / 2 bytes of e2m1 pairs and H / 16
e4m3 bytes. Hopper has no FP4 MMA: a receiver there dequantizes to bfloat16 rows
(``dequantize(...).bfloat16()``).

NaN and inf. "fp8" keeps today's rule (``reference.quantize_fp8``: an inf makes its group's scale inf, a NaN
its group NaN; the kernel's maximum skips a NaN). In the other scaled formats a group holding a NaN or an
inf is poisoned: scale NaN (UE8M0 0xFF, e4m3 0x7F), elements zero, so it dequantizes to NaN entirely; the
other groups of the row, and ``tensor_scale_of``, see finite values only.

Round trip, x_hat = dequantize(quantize(x)) for finite x, per element, d the factor dequantization multiplies
the element's group by (the float32 scale; 2^e; s * t for nvfp4):

    bf16, fp16, fp32    x_hat == x for x of that dtype
    fp8                 |x_hat - x| <= max(2^-4 |x|, 2^-10 d) + 2^-20 |x|     (<= 2^-4 of the group's amax)
    fp8_ue8m0, mxfp8    |x_hat - x| <= max(2^-4 |x|, 2^-10 d)                 (<= 2^-4 of the group's amax)
    nvfp4               |x_hat - x| <= max(2^-2 |x|, 2^-2 d, 6 t 2^-10) + 2^-22 |x|, for t >= tensor_scale_of(x)
                        (<= 2^-2 of the group's amax, or 6 t 2^-10 for groups below that)

(e4m3 keeps 3 mantissa bits, a relative half-ulp of 2^-4, and an absolute one of 2^-10 below 2^-6; e2m1
keeps 1, a relative 2^-2, and 0.25 below 1; an e4m3 block scale rounded down makes elements saturate at 6
by less than their half-ulp, and one rounded to zero or to a subnormal costs at most 6 t 2^-10; the last
terms are the float32 roundings of the scale and its inverse.)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .kernels.quant import (SCALE_E4M3, SCALE_FP32, SCALE_NONE, SCALE_UE8M0, dequantize_rows_fp8,
                            dequantize_rows_nvfp4, dequantize_rows_ue8m0, nvfp4_tensor_scale, quantize_rows_fp8,
                            quantize_rows_nvfp4, quantize_rows_ue8m0)

_SCALE_KINDS = {"none": SCALE_NONE.value, "fp32": SCALE_FP32.value, "ue8m0": SCALE_UE8M0.value,
                "e4m3": SCALE_E4M3.value}


@dataclass(frozen=True)
class PayloadFormat:
    """How one row of H activations crosses to an expert rank: elements, per-group scales, bytes (module
    docstring). Rows are the last dimension; every method takes any leading dimensions."""
    name: str
    element: str                          # one element's encoding: "bf16", "fp16", "fp32", "e4m3" or "e2m1"
    payload_dtype: torch.dtype            # of the payload tensor: the activation dtype, float8_e4m3fn, or uint8
    element_pack: int = 1                 # elements per payload item: 2 for e2m1 (column 2i in the low nibble)
    scale: str = "none"                   # a group's scale: "none", "fp32", "ue8m0" (a power of two) or "e4m3"
    scale_dtype: torch.dtype | None = None   # of the scales tensor: float32, int32, float8_e8m0fnu, float8_e4m3fn
    group: int = 0                        # columns per scale (0: no scales)
    scale_pack: int = 1                   # scales per scales item: 4 UE8M0 bytes in an int32, group 4j + i in byte i
    tensor_scale: bool = False            # one float32 per tensor multiplies every group's scale (nvfp4;
                                          # dispatch takes it per call: EPAllToAll.dispatch's tensor_scale)

    @property
    def element_bits(self) -> int:
        """One element's width on the wire."""
        return self.payload_dtype.itemsize * 8 // self.element_pack

    @property
    def scale_storage(self) -> torch.dtype | None:
        """The dtype buffers and kernels hold the scales in: ``scale_dtype``, but uint8 (the same bytes) for
        float8_e8m0fnu, which Triton has no type for and torch can neither index-assign nor compare."""
        return torch.uint8 if self.scale_dtype == torch.float8_e8m0fnu else self.scale_dtype

    @property
    def hidden_multiple(self) -> int:
        """What H must be a multiple of: the columns of one scales item (one payload item without scales)."""
        return self.group * self.scale_pack if self.group else self.element_pack

    def check_hidden(self, hidden: int) -> None:
        """Raises ValueError unless rows of `hidden` columns fit this format."""
        if hidden % self.hidden_multiple:
            raise ValueError(f"format {self.name!r}: hidden={hidden} is not a multiple of {self.hidden_multiple}")

    def payload_shape(self, rows: int, hidden: int) -> tuple[int, int]:
        """Shape of the payload of `rows` rows of `hidden` columns, of dtype ``payload_dtype``."""
        return rows, hidden // self.element_pack

    def scales_shape(self, rows: int, hidden: int) -> tuple[int, int] | None:
        """Shape of their scales, of dtype ``scale_dtype``, row-major, group g in item g // scale_pack; None
        without scales. The per-tensor scale of nvfp4 is apart: a float32 [] for all rows."""
        return (rows, hidden // (self.group * self.scale_pack)) if self.group else None

    def row_bytes(self, hidden: int) -> int:
        """Bytes one row of `hidden` columns takes on the wire: its payload and its scales."""
        payload = hidden // self.element_pack * self.payload_dtype.itemsize
        return payload + (hidden // (self.group * self.scale_pack) * self.scale_dtype.itemsize if self.group else 0)

    @property
    def kernel_constants(self) -> dict[str, int]:
        """The constexprs a kernel applies this format with: ELEMENT_BITS, GROUP (0 without scales),
        SCALE_KIND (a ``kernels.quant.SCALE_*``) and SCALE_PACK, for ``kernels.quant.quantize_groups``."""
        return {"ELEMENT_BITS": self.element_bits, "GROUP": self.group, "SCALE_KIND": _SCALE_KINDS[self.scale],
                "SCALE_PACK": self.scale_pack}

    def tensor_scale_of(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> float32 [] on x's device: the per-tensor scale NVIDIA's recipe takes, max(amax of x's
        finite values, 1e-4) / (448 * 6); a correctly rounded division. Formats with a per-tensor scale only."""
        if not self.tensor_scale:
            raise ValueError(f"format {self.name!r} has no per-tensor scale")
        return nvfp4_tensor_scale(x)

    def quantize(self, x: torch.Tensor, tensor_scale: torch.Tensor | None = None):
        """x [..., H] (bf16, fp16 or fp32) -> (payload [..., H / element_pack] payload_dtype, scales
        [..., H / group / scale_pack] scale_dtype, or None without scales): the definition the kernels match
        bit for bit. tensor_scale: float32 [] > 0, needed by formats with a per-tensor scale (nvfp4), refused
        by the others."""
        self.check_hidden(x.shape[-1])
        if self.tensor_scale != (tensor_scale is not None):
            raise ValueError(f"format {self.name!r} " + ("needs a tensor_scale (tensor_scale_of(x), or a calibrated "
                             "one)" if self.tensor_scale else "takes no tensor_scale"))
        if self.scale == "none":
            return x.to(self.payload_dtype), None
        if self.scale == "fp32":
            return quantize_rows_fp8(x, self.group)
        if self.scale == "ue8m0":
            q, exponents = quantize_rows_ue8m0(x, self.group)
            return q, exponents.view(self.scale_dtype)
        return quantize_rows_nvfp4(x, tensor_scale, self.group)

    def dequantize(self, q: torch.Tensor, scales: torch.Tensor | None,
                   tensor_scale: torch.Tensor | None = None) -> torch.Tensor:
        """(payload, scales as ``quantize`` returns them, tensor_scale for nvfp4) -> float32 [..., H]. The scales
        may have any strides (MN-major as ``integrations.mn_major`` lays them out, a slice, a transpose)."""
        if self.scale == "none":
            return q.float()
        if self.scale == "fp32":
            return dequantize_rows_fp8(q, scales, self.group)
        if self.scale == "ue8m0":
            return dequantize_rows_ue8m0(q, self._exponents(scales), self.group)
        if tensor_scale is None:
            raise ValueError(f"format {self.name!r} needs the tensor_scale its payload was quantized with")
        return dequantize_rows_nvfp4(q, scales, tensor_scale, self.group)

    def _exponents(self, scales: torch.Tensor) -> torch.Tensor:
        """UE8M0 scales [..., G / scale_pack] scale_dtype, of any strides -> their biased exponents [..., G]
        uint8 in group order: item j's bits 8i to 8i + 7 are group scale_pack * j + i's (read by shifts, not by
        viewing the bytes, which needs the last dimension of stride 1)."""
        if self.scale_pack == 1:
            return scales.view(torch.uint8)          # float8_e8m0fnu: a view of the same width takes any strides
        shifts = torch.arange(0, 8 * self.scale_pack, 8, dtype=scales.dtype, device=scales.device)
        return ((scales[..., None] >> shifts) & 0xFF).flatten(-2).to(torch.uint8)


FP8_GROUP = 128      # columns per scale of "fp8" and "fp8_ue8m0": DeepEP's and DeepGEMM's per-token FP8 group

FORMATS: dict[str, PayloadFormat] = {f.name: f for f in (
    PayloadFormat("bf16", "bf16", torch.bfloat16),
    PayloadFormat("fp16", "fp16", torch.float16),
    PayloadFormat("fp32", "fp32", torch.float32),
    PayloadFormat("fp8", "e4m3", torch.float8_e4m3fn, scale="fp32", scale_dtype=torch.float32, group=FP8_GROUP),
    PayloadFormat("fp8_ue8m0", "e4m3", torch.float8_e4m3fn, scale="ue8m0", scale_dtype=torch.int32,
                  group=FP8_GROUP, scale_pack=4),
    PayloadFormat("mxfp8", "e4m3", torch.float8_e4m3fn, scale="ue8m0", scale_dtype=torch.float8_e8m0fnu,
                  group=32),
    PayloadFormat("nvfp4", "e2m1", torch.uint8, element_pack=2, scale="e4m3", scale_dtype=torch.float8_e4m3fn,
                  group=16, tensor_scale=True),
)}

_UNQUANTIZED = {FORMATS[name].payload_dtype: FORMATS[name] for name in ("bf16", "fp16", "fp32")}


def format_of(fp8_dispatch: bool, fp8_group: int | None, dtype: torch.dtype) -> PayloadFormat:
    """The format today's flags of ``EPAllToAll`` ask for: with fp8_dispatch "fp8" (fp8_group, a power of two
    >= 16, other than 128 gives "fp8" over that group, named e.g. "fp8/64"), without it the format of the
    activation dtype ("bf16", "fp16" or "fp32"; fp8_group is then ignored). Raises ValueError for others."""
    if fp8_dispatch:
        if not isinstance(fp8_group, int) or fp8_group < 16 or fp8_group & (fp8_group - 1):
            raise ValueError(f"fp8_group must be a power of two >= 16, got {fp8_group!r}")
        fp8 = FORMATS["fp8"]
        return fp8 if fp8_group == fp8.group else dataclasses.replace(fp8, name=f"fp8/{fp8_group}", group=fp8_group)
    if dtype not in _UNQUANTIZED:
        raise ValueError(f"dtype must be bfloat16, float16 or float32, got {dtype}")
    return _UNQUANTIZED[dtype]
