"""Which kernel runs which escha shard: one priority list per platform kind, fastest first
(:func:`quantpack_core.kernels.choose_kernel`). ``QUANTPACK_ESCHA_BACKEND=<name>`` forces one kernel by name.

On ROCm the HIP extension ``radiance_escha_kernel`` (gfx1201; installed separately) runs the shards it takes; on CPU
the reference kernel (and on any device when forced). No CUDA kernel in this version (the Triton kernel is still to
come): on CUDA the config fails at load naming the ``reference`` override.
"""

from __future__ import annotations

from quantpack_core.kernels import CPU, CUDA, ROCM

from .backends.hip import EschaHipLinearKernel
from .backends.reference import EschaReferenceKernel

BACKEND_ENV = "QUANTPACK_ESCHA_BACKEND"

LINEAR_KERNELS = {
    CUDA: [],
    ROCM: [EschaHipLinearKernel],
    CPU: [EschaReferenceKernel],
}
