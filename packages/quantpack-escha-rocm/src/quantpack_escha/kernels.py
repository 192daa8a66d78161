"""Which kernel runs which escha shard: one priority list per platform kind, fastest first
(:func:`quantpack_core.kernels.choose_kernel`). ``QUANTPACK_ESCHA_BACKEND=<name>`` forces one kernel by name.

This version has the reference kernel (CPU, and any device when forced). The GPU kernels of the escha design (the
HIP extension on ROCm gfx1201, a Triton kernel for CUDA and ROCm) are not in this version: on a GPU the config
fails at load naming the kernels' reasons and the ``reference`` override.
"""

from __future__ import annotations

from quantpack_core.kernels import CPU, CUDA, ROCM

from .backends.reference import EschaReferenceKernel

BACKEND_ENV = "QUANTPACK_ESCHA_BACKEND"

LINEAR_KERNELS = {
    CUDA: [],
    ROCM: [],
    CPU: [EschaReferenceKernel],
}
