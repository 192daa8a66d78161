"""The trellis_mma backend: the project's own CUDA kernels for EXL3 linear shards (:mod:`.kernels`), their custom
op ``quantpack::trellis_mma_`` and workspace (:mod:`.ops`), and the nvcc build + ctypes loading of ``csrc/``
(linear.cu, moe.cu, common.cuh; :mod:`.library`); the expert banks' op ``quantpack::trellis_moe_`` (:mod:`.moe`)."""

from .kernels import TrellisMmaExpertKernel, TrellisMmaLinearKernel

__all__ = ["TrellisMmaExpertKernel", "TrellisMmaLinearKernel"]
