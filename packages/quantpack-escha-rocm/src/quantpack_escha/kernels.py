"""Which kernel runs which escha shard: one priority list per platform kind, fastest first
(:func:`quantpack_core.kernels.choose_kernel`). ``QUANTPACK_ESCHA_BACKEND=<name>`` forces one kernel by name.

On ROCm the HIP extension ``radiance_escha_kernel`` (gfx1201; installed separately) runs the shards it takes and the
Triton kernel the rest; on CUDA quantpack-core's trellis_mma kernels where they can be built (float16 / bfloat16
models, sm_80+, nvcc), else the Triton kernel; on CPU the reference kernel (and on any device when forced).
"""

from __future__ import annotations

from quantpack_core.kernels import CPU, CUDA, ROCM

from .backends.hip import EschaHipLinearKernel
from .backends.reference import EschaReferenceKernel
from .backends.trellis_mma import EschaTrellisMmaLinearKernel
from .backends.triton import EschaTritonLinearKernel

BACKEND_ENV = "QUANTPACK_ESCHA_BACKEND"

LINEAR_KERNELS = {
    CUDA: [EschaTrellisMmaLinearKernel, EschaTritonLinearKernel],
    ROCM: [EschaHipLinearKernel, EschaTritonLinearKernel],
    CPU: [EschaReferenceKernel],
}
