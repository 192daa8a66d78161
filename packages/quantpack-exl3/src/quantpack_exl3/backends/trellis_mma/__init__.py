"""The trellis_mma backend: EXL3 shards and expert banks through the project's own CUDA kernels, which live in
quantpack-core (``quantpack_core.trellis_mma``); this package keeps their EXL3 adapter (:mod:`.kernels`), which hands
exllamav3's GEMM to their row-bucket timing as the implementation that row buckets may go to."""

from .kernels import TrellisMmaExpertKernel, TrellisMmaLinearKernel, exllamav3_delegate

__all__ = ["TrellisMmaExpertKernel", "TrellisMmaLinearKernel", "exllamav3_delegate"]
