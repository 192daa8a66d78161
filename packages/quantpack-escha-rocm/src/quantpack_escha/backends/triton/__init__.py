"""The escha Triton backend (CUDA and ROCm)."""

from .kernels import EschaTritonLinearKernel

__all__ = ["EschaTritonLinearKernel"]
