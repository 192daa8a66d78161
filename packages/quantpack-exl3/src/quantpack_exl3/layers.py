"""Give ``VocabParallelEmbedding`` and ``ParallelLMHead`` the EXL3 quant config a model file withholds.

vLLM asks a quant config for a layer's method only when the model passes one to the layer's constructor, and several
model files build ``embed_tokens`` and/or ``lm_head`` without it (``qwen3_next.py``: both; ``qwen3_5.py``,
``nemotron_h.py``: the embedding). A pack whose head is an EXL3 tensor, or whose embedding is int8 rows, then cannot
load: vLLM's dense layer looks for ``.weight`` and meets ``.trellis`` / ``.qweight``.

The two constructors are wrapped once per process: when the caller passed no quant config (and no preselected
method) while the model being built is an EXL3 one, the current ``Exl3Config`` is filled in. Arguments are bound
against the real signature, because ``ParallelLMHead`` passes ``quant_config`` to its parent positionally. Layers of
models built with any other quantization, or none, are untouched.

Follows vLLM's ``VocabParallelEmbedding.__init__`` / ``ParallelLMHead.__init__``
(``vllm/model_executor/layers/vocab_parallel_embedding.py``) and ``get_current_vllm_config``.
"""

from __future__ import annotations

import functools
import inspect
import logging

logger = logging.getLogger("vllm.quantpack.exl3")

_MARK = "_quantpack_exl3_wrapped"


def current_exl3_config():
    """The quant config of the model vLLM is building, if it is an ``Exl3Config``; else None."""
    try:
        from vllm.config import get_current_vllm_config

        cfg = get_current_vllm_config()
    except Exception:  # no config is being built (unit tests, tools)
        return None
    from .config import Exl3Config

    qc = getattr(cfg, "quant_config", None)
    return qc if isinstance(qc, Exl3Config) else None


def _wrap(init):
    sig = inspect.signature(init)

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        try:
            bound = sig.bind(self, *args, **kwargs)
        except TypeError:
            return init(self, *args, **kwargs)
        args_ = bound.arguments
        if "quant_config" in sig.parameters and args_.get("quant_config") is None and args_.get("quant_method") is None:
            qc = current_exl3_config()
            if qc is not None:
                args_["quant_config"] = qc
                return init(*bound.args, **bound.kwargs)
        return init(self, *args, **kwargs)

    setattr(__init__, _MARK, True)
    return __init__


def patch_embedding_constructors() -> bool:
    """Wrap the two constructors (idempotent).

    Returns:
        True when this call installed the wrappers, False when they were already in place.
    """
    from vllm.model_executor.layers import vocab_parallel_embedding as vpe

    installed = False
    for cls in (vpe.VocabParallelEmbedding, vpe.ParallelLMHead):
        init = cls.__dict__.get("__init__")
        if init is not None and not getattr(init, _MARK, False):
            cls.__init__ = _wrap(init)
            installed = True
    if installed:
        logger.debug("quantpack-exl3: embed_tokens / lm_head receive the EXL3 quant config when a model omits it")
    return installed
