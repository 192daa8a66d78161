"""The family registry: what a family module declares, and how the plugin applies it.

A family module (``quantpack_families.families.<name>``) declares one :class:`Family`: the architectures it
registers with vLLM (as ``module:Class`` strings, so no model code is imported at registration), the model classes
that must announce their embedding's name, the checkpoint prefixes its model class remaps, and the vLLM versions it
applies to. :func:`apply` registers what the installed vLLM lacks and installs a post-import hook that patches the
announced classes when vLLM itself imports their modules (vLLM's plugin hook must stay cheap, and some model files,
e.g. qwen3_5.py, import torchvision, which vLLM's CPU environments lack).

Announcing: vLLM's ``Qwen3NextModel`` and ``Qwen3_5Model`` (and their MTP drafts) build
``VocabParallelEmbedding(vocab, hidden)`` with neither ``prefix`` nor quant config, so a compressed-tensors
checkpoint that quantizes its embedding (``re:.*embed_tokens$``) cannot reach it: compressed-tensors matches schemes
by layer name. Their ``__init__`` is wrapped to run inside :func:`quantpack_core.vllm.layers.embedding_prefix` with
the module's real name (``<prefix>.embed_tokens``); quantpack-core's constructor wrap then hands that embedding the
compressed-tensors config and name. Quantpack packs do not need the name (their config reaches every embedding built
without one). Follows vLLM's ``ModelRegistry.register_model`` and ``vllm/plugins/__init__.py``; docs/families.md.
"""

from __future__ import annotations

import functools
import importlib.abc
import logging
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import ModuleType

logger = logging.getLogger("vllm.quantpack.families")

_MARK = "_quantpack_announces_embedding"


@dataclass(frozen=True)
class Architecture:
    """One architecture a family registers.

    Attributes:
        target: ``module:Class`` of the model class (imported by vLLM only when a model of it is built).
        config_hook: the name of a ``vllm.model_executor.models.config`` class vLLM must run for this architecture
            (e.g. the Gated DeltaNet state dtype), or None.
    """

    target: str
    config_hook: str | None = None


@dataclass(frozen=True)
class Family:
    """What one model family needs from vLLM.

    Attributes:
        name: the family (``"qwen3_5"``).
        why: one sentence: what breaks without it.
        vllm: the vLLM versions it applies to, as a ``packaging`` specifier (``"<0.29"``; empty: every version).
        registers: architecture name -> :class:`Architecture`, registered where vLLM does not know the name.
        announces: vLLM model module -> its classes whose ``__init__(self, *, vllm_config, prefix="")`` builds
            ``embed_tokens`` without a name.
        remaps: checkpoint prefix -> vLLM prefix (None: not loaded) that the family's model class applies.
        configs: ``model_type`` -> ``module:Class`` of a transformers config class, registered with transformers'
            ``AutoConfig`` where transformers does not know the type (so vLLM can read the checkpoint's config.json).
        conflicts: a function returning a message when another installed package would fight the family (e.g. a
            vendor plugin registering the same architecture), else None; logged as an error when the family is
            applied, and the family's model class refuses to build.
        patches: vLLM module -> function applied to the module object right after vLLM imports it (or at once if
            it is imported already), for fixes that are not an announcement: it patches what it finds there and
            must be idempotent (it returns whether it changed anything).
    """

    name: str
    why: str
    vllm: str = ""
    registers: Mapping[str, Architecture] = field(default_factory=dict)
    announces: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    remaps: Mapping[str, str | None] = field(default_factory=dict)
    configs: Mapping[str, str] = field(default_factory=dict)
    patches: Mapping[str, Callable[[ModuleType], bool]] = field(default_factory=dict)
    conflicts: Callable[[], str | None] | None = None

    def applies_to(self, version: str) -> bool:
        """Whether the family applies to vLLM ``version`` (a release string such as ``"0.25.1"``)."""
        if not self.vllm:
            return True
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version

        return Version(Version(version).base_version) in SpecifierSet(self.vllm)


def vllm_version() -> str:
    """The installed vLLM's version."""
    import vllm

    return vllm.__version__


def wrap_attribute(cls, name: str, mark: str, make: Callable[[Callable], Callable]) -> bool:
    """Replace the function ``name`` that ``cls`` itself defines (a method, or a staticmethod, which stays one) by
    ``make(original)``, once: the replacement carries the attribute ``mark``, so a second call changes nothing.

    Returns:
        True when this call replaced it; False when ``cls`` does not define ``name`` or it is replaced already.
    """
    raw = cls.__dict__.get(name)
    original = getattr(raw, "__func__", raw)
    if original is None or getattr(original, mark, False):
        return False
    wrapped = functools.wraps(original)(make(original))
    setattr(wrapped, mark, True)
    setattr(cls, name, staticmethod(wrapped) if isinstance(raw, staticmethod) else wrapped)
    return True


def class_patch(wraps: Mapping[str, Callable[[type], bool]]) -> Callable[[ModuleType], bool]:
    """A :attr:`Family.patches` function that applies ``wraps[name]`` to each class ``name`` the vLLM module defines
    itself (a class it only imports is patched in the module that defines it).

    Returns:
        ``patch(module) -> bool``: whether anything was wrapped.
    """

    def patch(module: ModuleType) -> bool:
        done = False
        for name, wrap in wraps.items():
            cls = getattr(module, name, None)
            if cls is not None and cls.__module__ == module.__name__:
                done = wrap(cls) or done
        return done

    return patch


def wrap_init(cls) -> bool:
    """Make ``cls.__init__`` announce ``<prefix>.embed_tokens`` while it runs (idempotent).

    Returns:
        True when this call wrapped it.
    """

    def make(init):
        def __init__(self, *args, **kwargs):
            from quantpack_core.vllm.layers import embedding_prefix

            prefix = kwargs.get("prefix", "")
            with embedding_prefix(f"{prefix}.embed_tokens" if prefix else "embed_tokens"):
                init(self, *args, **kwargs)

        return __init__

    return wrap_attribute(cls, "__init__", _MARK, make)


class _PatchingLoader(importlib.abc.Loader):
    """The real loader of a model module, patching the module right after it executes; everything else (source,
    file name, resources) is the real loader's."""

    def __init__(self, loader, patch):
        self._loader = loader
        self._patch = patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for the announced and patched modules it returns the real spec with a
    :class:`_PatchingLoader`."""

    def __init__(self):
        self.announced: dict[str, tuple[str, ...]] = {}
        self.patchers: dict[str, tuple[Callable[[ModuleType], bool], ...]] = {}

    def patch(self, module) -> None:
        """Wrap the announced classes of an imported model module and run the families' patches of it."""
        for name in self.announced.get(module.__name__, ()):
            cls = getattr(module, name, None)
            if cls is not None and wrap_init(cls):
                logger.debug("quantpack-families: %s.%s announces its embedding name", module.__name__, name)
        for fix in self.patchers.get(module.__name__, ()):
            if fix(module):
                logger.debug("quantpack-families: %s patched %s", fix.__qualname__, module.__name__)

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.announced and fullname not in self.patchers:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _PatchingLoader(spec.loader, self.patch)
                return spec
        return None


FINDER = _PostImportFinder()


def install_announcements(families: Iterable[Family]) -> None:
    """Patch the announced and patched model modules now if already imported, else when vLLM imports them
    (idempotent)."""
    for family in families:
        for module, classes in family.announces.items():
            FINDER.announced[module] = tuple(dict.fromkeys((*FINDER.announced.get(module, ()), *classes)))
        for module, fix in family.patches.items():
            FINDER.patchers[module] = tuple(dict.fromkeys((*FINDER.patchers.get(module, ()), fix)))
    for name in {*FINDER.announced, *FINDER.patchers}:
        if name in sys.modules:
            FINDER.patch(sys.modules[name])
    if FINDER not in sys.meta_path:
        sys.meta_path.insert(0, FINDER)


def register_architectures(family: Family) -> list[str]:
    """Register the family's architectures that the installed vLLM does not know, with their config hooks.

    Returns:
        the architectures registered by this call.
    """
    from vllm import ModelRegistry

    known = set(ModelRegistry.get_supported_archs())
    done = []
    for arch, spec in family.registers.items():
        if arch in known:
            continue
        from vllm.model_executor.models import config as model_configs  # only where a fix applies

        ModelRegistry.register_model(arch, spec.target)
        # vLLM runs per-architecture config hooks (e.g. the Gated DeltaNet state dtype) by name
        hook = spec.config_hook
        if hook is not None and arch not in model_configs.MODELS_CONFIG_MAP:
            if hasattr(model_configs, hook):
                model_configs.MODELS_CONFIG_MAP[arch] = getattr(model_configs, hook)
            else:
                logger.warning("quantpack-families: this vLLM has no %s; %s runs without that config hook", hook, arch)
        logger.info("quantpack-families: registered %s -> %s (%s)", arch, spec.target, family.why)
        done.append(arch)
    return done


def register_configs(family: Family) -> list[str]:
    """Register the family's config classes with transformers' ``AutoConfig`` for the model types it does not know.

    Returns:
        the model types registered by this call.
    """
    import importlib

    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    done = []
    for model_type, target in family.configs.items():
        if model_type in CONFIG_MAPPING:
            continue
        module, _, name = target.partition(":")
        AutoConfig.register(model_type, getattr(importlib.import_module(module), name))
        done.append(model_type)
    return done


def apply(families: Iterable[Family], version: str | None = None) -> list[Family]:
    """Apply every family that applies to this vLLM: its announcements, and its architectures vLLM lacks.

    Args:
        families: the registry (:data:`quantpack_families.families.FAMILIES`).
        version: the vLLM version (default: the installed one).

    Returns:
        the families applied.
    """
    version = version or vllm_version()
    active = [f for f in families if f.applies_to(version)]
    install_announcements(active)
    for family in active:
        message = family.conflicts() if family.conflicts is not None else None
        if message:
            logger.error("quantpack-families: %s: %s", family.name, message)
        register_configs(family)
        register_architectures(family)
    return active
