"""Triton kernels, one concern per module: quant (FP8 per-group quantization), all_to_all (EP
dispatch/combine), grouped_gemm (masked grouped GEMM over dispatch's expert-major rows), ag_gemm
and gemm_rs (async-TP GEMMs with the all-gather / reduce-scatter overlapped), matmul (what those two share)."""
