"""Async tensor parallelism: ``AsyncTP`` (``async_tp``), the choice of path (``cost``) and the
autograd functions of its ops (``autograd``).
"""
from .async_tp import AsyncTP

__all__ = ["AsyncTP"]
