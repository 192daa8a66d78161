"""Give ``VocabParallelEmbedding`` and ``ParallelLMHead`` the quantpack quant config a model file withholds.

vLLM asks a quant config for a layer's method only when the model passes one to the layer's constructor, and several
model files build ``embed_tokens`` and/or ``lm_head`` without it (``qwen3_next.py``: both; ``qwen3_5.py``,
``nemotron_h.py``: the embedding). A pack whose head is an EXL3 tensor, or whose embedding is int8 rows, then cannot
load: vLLM's dense layer looks for ``.weight`` and meets ``.trellis`` / ``.qweight``.

The two constructors are wrapped once per process: when the caller passed no quant config (and no preselected
method) while the model being built is a quantpack one (its config a :class:`~.config.QuantpackConfig`: EXL3, escha),
that config is filled in. A compressed-tensors
checkpoint can quantize its embedding too (``re:.*embed_tokens$``, WNA16), but compressed-tensors picks a layer's
scheme by its name, which an embedding built without ``prefix`` lacks; so its config is filled in only for the
embedding a family module announced with :func:`embedding_prefix` (quantpack-families does so for Qwen3-Next and
Qwen3.5), and with that name. Arguments are bound
against the real signature, because ``ParallelLMHead`` passes ``quant_config`` to its parent positionally. Layers of
models built with any other quantization, or none, are untouched.

Before vLLM 0.24 a tied ``ParallelLMHead`` does not ask its method how to tie; :func:`delegate_tie_weights` makes a
quantpack head do so there, as later releases do.

Follows vLLM's ``VocabParallelEmbedding.__init__`` / ``ParallelLMHead.__init__`` / ``ParallelLMHead.tie_weights``
(``vllm/model_executor/layers/vocab_parallel_embedding.py``) and ``get_current_vllm_config``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import logging

logger = logging.getLogger("vllm.quantpack")

_MARK = "_quantpack_wrapped"
_announced: contextvars.ContextVar[str | None] = contextvars.ContextVar("quantpack_embedding_prefix", default=None)


@contextlib.contextmanager
def embedding_prefix(prefix: str):
    """While a model builds its layers: the next ``VocabParallelEmbedding`` built without a quant config is the
    module ``prefix`` (e.g. ``model.embed_tokens``). Used by family fixes around a model's ``__init__``.

    The family modules of quantpack-families announce through it (docs/families.md).
    """
    token = _announced.set(prefix)
    try:
        yield
    finally:
        _announced.reset(token)


def take_embedding_prefix() -> str | None:
    """The announced embedding name, once (later embeddings of the same model get None)."""
    prefix = _announced.get()
    if prefix is not None:
        _announced.set(None)
    return prefix


def current_quant_config():
    """The quant config of the model vLLM is building, or None (no config is being built, or no quantization)."""
    try:
        from vllm.config import get_current_vllm_config

        return getattr(get_current_vllm_config(), "quant_config", None)
    except Exception:  # no config is being built (unit tests, tools)
        return None


def current_quantpack_config():
    """The quant config of the model vLLM is building, if it is a :class:`~.config.QuantpackConfig`; else None."""
    from .config import QuantpackConfig

    qc = current_quant_config()
    return qc if isinstance(qc, QuantpackConfig) else None


def _is_head(module) -> bool:
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    return isinstance(module, ParallelLMHead)


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
            qc = current_quantpack_config()
            if qc is not None:
                args_["quant_config"] = qc
                return init(*bound.args, **bound.kwargs)
            # never a head: ParallelLMHead's own wrapper and its call of the parent constructor both see one
            if "prefix" in sig.parameters and not _is_head(self):
                prefix = take_embedding_prefix()
                qc = current_quant_config() if prefix is not None else None
                if qc is not None and qc.get_name() == "compressed-tensors":
                    args_["quant_config"] = qc
                    args_["prefix"] = prefix
                    return init(*bound.args, **bound.kwargs)
        return init(self, *args, **kwargs)

    setattr(__init__, _MARK, True)
    return __init__


def delegate_tie_weights(head_cls) -> bool:
    """Make ``head_cls.tie_weights`` (vLLM's ``ParallelLMHead``) hand a quantpack head's tying to its method, as
    vLLM 0.24+ does for every head (``self.quant_method.tie_weights(self, embed_tokens)``). Before 0.24 it sets the
    head's ``weight`` to the embedding's and returns the head, which a quantpack head cannot compute with (its
    weights are runs built at load; a tied pack stores no head): the tied head is the embedding module itself then,
    whose method computes the logits (:meth:`.linear.QuantLinearMethod.tie_weights`). Other heads keep vLLM's tying.
    Does nothing where vLLM's ``tie_weights`` already asks the head's ``quant_method`` or the wrapper is in place.

    Returns:
        True when this call installed the wrapper.
    """
    from .linear import QuantLinearMethod

    tie = head_cls.__dict__.get("tie_weights")
    code = getattr(tie, "__code__", None)
    if tie is None or getattr(tie, _MARK, False) or code is None or "quant_method" in code.co_names:
        return False

    @functools.wraps(tie)
    def tie_weights(self, embed_tokens):
        method = getattr(self, "quant_method", None)
        if isinstance(method, QuantLinearMethod):
            return method.tie_weights(self, embed_tokens)
        return tie(self, embed_tokens)

    setattr(tie_weights, _MARK, True)
    head_cls.tie_weights = tie_weights
    return True


def patch_embedding_constructors() -> bool:
    """Wrap the two constructors, and a quantpack head's tying on vLLM before 0.24 (:func:`delegate_tie_weights`)
    (idempotent).

    Returns:
        True when this call installed the wrappers, False when they were already in place.
    """
    from vllm.model_executor.layers import vocab_parallel_embedding as vpe

    installed = delegate_tie_weights(vpe.ParallelLMHead)
    for cls in (vpe.VocabParallelEmbedding, vpe.ParallelLMHead):
        init = cls.__dict__.get("__init__")
        if init is not None and not getattr(init, _MARK, False):
            cls.__init__ = _wrap(init)
            installed = True
    if installed:
        logger.debug("quantpack: embed_tokens / lm_head receive the quantpack quant config when a model omits it")
    return installed
