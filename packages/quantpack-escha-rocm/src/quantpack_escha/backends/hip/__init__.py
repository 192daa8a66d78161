"""The escha HIP backend: the ``radiance_escha_kernel`` extension on ROCm gfx1201 (not run here)."""

from .kernels import EschaHipLinearKernel

__all__ = ["EschaHipLinearKernel"]
