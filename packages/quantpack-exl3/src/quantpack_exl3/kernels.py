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
    # trellis_mma's grouped expert kernels stay behind exllamav3's until measured on a GPU (docs/kernels.md)
    CUDA: [Exllamav3ExpertKernel, TrellisMmaExpertKernel],
    ROCM: [],
    CPU: [ReferenceExpertKernel],
}
