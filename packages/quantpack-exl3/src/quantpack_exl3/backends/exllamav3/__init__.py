"""The exllamav3 backend: exllamav3's CUDA kernels (:mod:`.kernels`), its custom ops (:mod:`.ops`:
``quantpack::exl3_gemm_``, ``quantpack::exl3_moe_``), their CUDA implementations (:mod:`.gemm`, :mod:`.moe`) and the
extension import (:mod:`.extension`)."""

from .kernels import Exllamav3ExpertKernel, Exllamav3LinearKernel

__all__ = ["Exllamav3ExpertKernel", "Exllamav3LinearKernel"]
