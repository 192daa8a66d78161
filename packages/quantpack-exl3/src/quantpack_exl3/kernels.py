"""Which kernel runs which EXL3 shard: one priority list per operation and platform kind, fastest first.

For each shard (and each expert bank) the method walks its platform's list when the shard's K and shape are known
and takes the first kernel whose ``can_implement`` accepts (:func:`quantpack_core.kernels.choose_kernel`); a kernel
that declines passes the shard on to the next. ``QUANTPACK_EXL3_BACKEND=<name>`` forces one kernel by name
(``reference`` on a GPU, to debug). Adding a kernel = one folder under ``backends/`` + one line here. What each
kernel takes: docs/kernels.md (pinned by ``test_kernel_support.py``).
"""

from __future__ import annotations

from quantpack_core.kernels import CPU, CUDA, ROCM

from .backends.exllamav3 import Exllamav3ExpertKernel, Exllamav3LinearKernel
from .backends.reference import ReferenceExpertKernel, ReferenceLinearKernel
from .backends.trellis_mma import TrellisMmaExpertKernel, TrellisMmaLinearKernel

BACKEND_ENV = "QUANTPACK_EXL3_BACKEND"

LINEAR_KERNELS = {
    CUDA: [TrellisMmaLinearKernel, Exllamav3LinearKernel],
    ROCM: [],  # no EXL3 kernel for ROCm in this version (the reference one only when forced)
    CPU: [ReferenceLinearKernel],
}
EXPERT_KERNELS = {
    # trellis_mma's grouped expert kernels first: 1.7x exllamav3's at batch 1 and 4x at 64 on the 30B-A3B shape, and
    # exllamav3's per-slot path failed CUDA-graph capture at vLLM's larger capture sizes (docs/troubleshooting.md);
    # exllamav3 takes the float32 models
    CUDA: [TrellisMmaExpertKernel, Exllamav3ExpertKernel],
    ROCM: [],
    CPU: [ReferenceExpertKernel],
}
