"""The reference backend: plain torch on any device; see :mod:`.kernels`. Owns ``quantpack::exl3_moe_reference_``
(:mod:`.ops`)."""

from .kernels import ReferenceExpertKernel, ReferenceLinearKernel

__all__ = ["ReferenceExpertKernel", "ReferenceLinearKernel"]
