"""The escha ``trellis_mma`` backend: quantpack-core's Hopper / Ampere kernels (``quantpack_core.trellis_mma``) running
escha shards (CUDA)."""

from .kernels import EschaTrellisMmaLinearKernel, exl3_shard

__all__ = ["EschaTrellisMmaLinearKernel", "exl3_shard"]
