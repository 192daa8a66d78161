"""vLLM general-plugin entry point of quantpack-families (``vllm.general_plugins``: ``quantpack_families``).

vLLM calls :func:`register` in every process it starts, sometimes twice; it must be cheap and idempotent and import
no model code (model classes are registered lazily as ``module:Class`` strings). Each fix is applied only where the
installed vLLM lacks it. Follows vLLM's ``vllm/plugins/__init__.py`` and ``ModelRegistry.register_model``.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.quantpack.families")

#: architecture name -> (``module:Class`` of the fix, the config hook of ``vllm.model_executor.models.config``
#: it needs (or None), why it is needed)
ARCHITECTURES = {
    "Qwen3_5ForCausalLM": (
        "quantpack_families.qwen3_5:Qwen3_5TextForCausalLM",
        "Qwen3_5ForConditionalGenerationConfig",
        "vLLM before 0.29 ships the text-only Qwen3.5 class without registering its name, marking it hybrid or "
        "stripping the model.language_model. prefix of Qwen3.5 checkpoints",
    ),
}

_registered = False


def register() -> None:
    """Register every family fix the installed vLLM needs (architectures it does not know)."""
    global _registered
    if _registered:
        return
    from vllm import ModelRegistry

    from .announce import install

    install()  # embedding names for compressed-tensors embeddings (see announce.py)
    known = set(ModelRegistry.get_supported_archs())
    for arch, (target, hook, why) in ARCHITECTURES.items():
        if arch in known:
            continue
        from vllm.model_executor.models import config as model_configs  # only where a fix applies

        ModelRegistry.register_model(arch, target)
        # vLLM runs per-architecture config hooks (e.g. the Gated DeltaNet state dtype) by name
        if hook is not None and arch not in model_configs.MODELS_CONFIG_MAP:
            if hasattr(model_configs, hook):
                model_configs.MODELS_CONFIG_MAP[arch] = getattr(model_configs, hook)
            else:
                logger.warning("quantpack-families: this vLLM has no %s; %s runs without that config hook", hook, arch)
        logger.info("quantpack-families: registered %s -> %s (%s)", arch, target, why)
    _registered = True
