"""The escha reference kernel: decode at load, dense GEMM at forward."""

from .kernels import EschaReferenceKernel

__all__ = ["EschaReferenceKernel"]
