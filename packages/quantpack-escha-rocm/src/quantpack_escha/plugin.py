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
    from quantpack_core.vllm.plugin import register_config

    from .config import EschaConfig

    register_config(EschaConfig)
    _registered = True
    logger.info("quantpack-escha: quant_method 'escha' registered")
