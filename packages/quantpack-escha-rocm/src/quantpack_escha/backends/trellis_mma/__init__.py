"""The escha ``trellis_mma`` backend: quantpack-exl3's Hopper / Ampere kernels running escha shards (CUDA)."""

from .kernels import EschaTrellisMmaLinearKernel, exl3_shard

__all__ = ["EschaTrellisMmaLinearKernel", "exl3_shard"]
