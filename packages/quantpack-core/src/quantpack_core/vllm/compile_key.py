"""The model's kernel plan in vLLM's compile-cache key.

vLLM caches a compiled model (torch.compile's AOT artifact and Inductor's code) under a hash of its config
(``VllmConfig.compute_hash``: model path, dtypes, parallelism, ``additional_config``, ...), computed when the model
first runs, after its weights are processed. The kernels a quantpack method chooses per shard are not in that config:
the same pack served once with ``trellis_mma`` (whose fused runs register ``shard0_trellis0`` ...) and once with
``QUANTPACK_EXL3_BACKEND=exllamav3`` (one run per shard, other parameter names and ops) hashed alike, and the second
engine loaded the first one's artifact and failed on a parameter it does not have (``KeyError: 'shard0_trellis0'``,
H200, vLLM 0.25.1). A measured delegated mask (``trellis_mma``'s row buckets) is a constant of the traced
graph too.

So every layer a method processes adds what its forward traces - the ops, the parameter names, the ops' scalar
arguments - to a running digest, kept in ``vllm_config.additional_config["quantpack_kernel_plan"]``, the place
vLLM itself keeps graph-relevant backend choices (``gdn_prefill_backend``). Two loads that trace the same graph
share the cached artifact; two that differ get their own. The user's other ``additional_config`` keys are kept.

Source: vLLM ``vllm/config/vllm.py`` (``VllmConfig.compute_hash``), ``vllm/compilation/caching.py``
(``aot_compile_hash_factors``), ``vllm/compilation/decorators.py`` (the AOT cache directory), 0.25 - 0.32.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

#: the ``additional_config`` key that holds the digest
PLAN_KEY = "quantpack_kernel_plan"

logger = logging.getLogger("vllm.quantpack")


def current_vllm_config() -> Any | None:
    """The ``VllmConfig`` vLLM is building a model under, or None outside that (a layer built by hand in a test).

    Uses ``vllm.config.get_current_vllm_config_or_none`` (vLLM 0.25+); None on releases without it.
    """
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return None
    return get_current_vllm_config_or_none()


def engine_max_rows() -> int | None:
    """The most rows one forward pass gives a layer of the model vLLM is building: its scheduler's
    ``max_num_batched_tokens``; None where no build is under way, it is unset, or the model has an encoder (a
    multimodal or encoder-decoder model: a vision tower's blocks run on every patch of an image, up to the encoder's
    own budget and more, before any merge)."""
    config = current_vllm_config()
    model = getattr(config, "model_config", None)
    if getattr(model, "is_multimodal_model", False) or getattr(model, "is_encoder_decoder", False):
        return None
    rows = getattr(getattr(config, "scheduler_config", None), "max_num_batched_tokens", None)
    return rows if isinstance(rows, int) and not isinstance(rows, bool) and rows > 0 else None


def op_name(fn: Any) -> str | None:
    """What a run calls, for :meth:`CompileKey.add`, without addresses (the digest must be equal from load to load):
    ``module.qualname`` of a function, of a ``functools.partial``'s function, else of the callable's class; None for
    None."""
    if fn is None:
        return None
    inner = getattr(fn, "func", None)
    if inner is not None and not hasattr(fn, "__qualname__"):
        return op_name(inner)
    named = fn if hasattr(fn, "__qualname__") else type(fn)
    return f"{named.__module__}.{named.__qualname__}"


class CompileKey:
    """One model's kernel plan as a digest in its ``VllmConfig`` (see the module).

    :meth:`bind` is called while vLLM builds the model (the quant config's ``get_quant_method``), :meth:`add` once
    per processed layer. A model built outside a vLLM config (tests that build layers by hand) keeps the digest here
    only (:attr:`digest`).
    """

    def __init__(self) -> None:
        self._digest = hashlib.sha256().hexdigest()
        self._config: Any | None = None
        self._warned = False

    def __getstate__(self) -> dict:
        # vLLM pickles the quant config into its engine process: keep the digest, not the VllmConfig it came from
        return {"_digest": self._digest, "_config": None, "_warned": self._warned}

    @property
    def digest(self) -> str:
        """The hex digest of every :meth:`add` so far, chained (of an empty plan when none)."""
        return self._digest

    def bind(self) -> None:
        """Remember the ``VllmConfig`` the model is being built under (the first one seen; later calls keep it)."""
        if self._config is None:
            self._config = current_vllm_config()

    def add(self, prefix: str, *parts: Any) -> None:
        """Add one layer's traced form: ``prefix`` (the layer) and ``parts`` (kernel names, parameter names, the
        ops' scalar arguments), hashed by their ``repr``; then store the digest in the bound config.

        A config whose ``additional_config`` is not a dict (an object with its own ``compute_hash``) cannot take the
        key: warned once, naming the risk (a compile cache shared between different kernel plans).
        """
        self._digest = hashlib.sha256((self._digest + repr((prefix, parts))).encode()).hexdigest()
        config = self._config
        if config is None:
            return
        extra = getattr(config, "additional_config", None)
        if isinstance(extra, dict):
            extra[PLAN_KEY] = self.digest
        elif not self._warned:
            self._warned = True
            logger.warning(
                "quantpack: vLLM's additional_config is a %s, not a dict, so the kernel plan cannot join the compile "
                "cache's key; set VLLM_DISABLE_COMPILE_CACHE=1 when you force another kernel or change the pack",
                type(extra).__name__,
            )
