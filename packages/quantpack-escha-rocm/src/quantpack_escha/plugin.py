"""vLLM general-plugin entry point of quantpack-escha-rocm (``vllm.general_plugins``: ``quantpack_escha``).

vLLM calls :func:`register` in every process it starts, sometimes twice in one process: it is cheap, idempotent
and touches no GPU. Follows vLLM's ``vllm/plugins/__init__.py``.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.quantpack.escha")

_registered = False


def register() -> None:
    """Make ``quant_method: "escha"`` loadable in this process (no flag: the config class claims escha packs through
    ``override_quantization_method`` before any generic handler)."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config

    from .config import EschaConfig

    if "escha" in QUANTIZATION_METHODS:
        from vllm.model_executor.layers.quantization import get_quantization_config

        existing = get_quantization_config("escha")
        if existing is not EschaConfig:
            logger.warning(
                "quantpack-escha: replacing the 'escha' quantization method registered by %s.%s",
                existing.__module__,
                existing.__qualname__,
            )
    register_quantization_config("escha")(EschaConfig)

    from quantpack_core.vllm.layers import patch_embedding_constructors

    patch_embedding_constructors()
    _registered = True
    logger.info("quantpack-escha: quant_method 'escha' registered")
