"""Triton kernels, one concern per module: quant (per-group quantization of the payload formats: FP8,
UE8M0, NVFP4), all_to_all (EP dispatch/combine), grouped_gemm (masked grouped GEMM over dispatch's
expert-major rows), ag_gemm, gemm_rs and gemm_ar (async-TP GEMMs with the all-gather / reduce-scatter /
all-reduce overlapped), matmul (what those share)."""
