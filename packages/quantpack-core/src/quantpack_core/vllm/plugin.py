"""What a format's vLLM plugin does when vLLM calls its ``register``: its config class under its format's name, and
the embedding / head constructor wrap, and on CPU the seeded-sampling fix (:mod:`.cpu_sampling`)."""

from __future__ import annotations

import logging

from .config import QuantpackConfig
from .layers import patch_embedding_constructors

logger = logging.getLogger("vllm.quantpack")


def register_config(config_cls: type[QuantpackConfig]) -> None:
    """Register a format's config class with vLLM under its format's name (a plugin's ``register``), warning when it
    replaces a class another package registered under that name, and wrap the embedding / head constructors
    (:func:`.layers.patch_embedding_constructors`). Idempotent. Follows vLLM's ``register_quantization_config``
    (``vllm/model_executor/layers/quantization/__init__.py``)."""
    from vllm.model_executor.layers.quantization import (
        QUANTIZATION_METHODS,
        get_quantization_config,
        register_quantization_config,
    )

    name = config_cls.get_name()
    if name in QUANTIZATION_METHODS:
        existing = get_quantization_config(name)
        if existing is not config_cls:
            logger.warning(
                "%s: replacing the '%s' quantization method registered by %s.%s",
                config_cls.title,
                name,
                existing.__module__,
                existing.__qualname__,
            )
    register_quantization_config(name)(config_cls)
    patch_embedding_constructors()
    warn_untested_vllm(config_cls.title)
    fix_cpu_seeded_sampling()


_warned = False


def warn_untested_vllm(title: str) -> None:
    """Log once per process when the installed vLLM is outside the releases tested on this platform
    (:func:`.compat.untested_vllm`)."""
    global _warned
    if _warned:
        return
    _warned = True
    import vllm

    from .compat import untested_vllm
    from .platform import current_platform

    message = untested_vllm(vllm.__version__, current_platform().kind)
    if message:
        logger.warning("%s: %s", title, message)


def fix_cpu_seeded_sampling() -> bool:
    """On vLLM's CPU platform, in the releases whose runner stops on a seeded request whose prompt spans steps
    (:mod:`.cpu_sampling`), rewind seeded generators by state. Returns whether the fix applies in this process."""
    import vllm

    from quantpack_core.kernels import CPU

    from . import cpu_sampling
    from .platform import current_platform

    return cpu_sampling.install(vllm.__version__, current_platform().kind == CPU)
