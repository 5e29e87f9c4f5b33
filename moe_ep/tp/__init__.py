"""Async tensor parallelism: ``AsyncTP`` (``async_tp``), the choice of path (``cost``), the
autograd functions of its ops (``autograd``) and the plain ops, one collective and one GEMM (``plain``).
"""
from .async_tp import AsyncTP

__all__ = ["AsyncTP"]
