"""``QuantpackConfig``: the format-free base of a quantpack format's vLLM quantization config.

vLLM matches the checkpoint's ``quantization_config.quant_method`` against registered methods, so a format's config
class claims its packs with no ``--quantization`` flag once its plugin has registered it. The base then:

* reads the pack's manifest (``tensor_storage`` in ``quantization_config.json``): which checkpoint modules are stored
  in the format, as int8 rows, or dense;
* gives each layer vLLM builds its method: quantized layers (and layers the manifest does not know) the format's
  linear, expert or embedding method, dense layers vLLM's own unquantized methods; a fused layer mixing kinds is
  refused;
* resolves, once per process, the platform (:func:`~.platform.current_platform`) and the format's kernel priority
  lists for it, so that a platform with no usable kernel fails here, naming the fix, before any weight is read
  (``<FORMAT>_BACKEND``-style environment variable: one kernel forced);
* keeps the model's :class:`~quantpack_core.kernels.KernelLog` (one table of the per-shard kernel choices).

A format subclasses it with its name, its :class:`~quantpack_core.format.LinearFormat`, its method classes and its
kernel lists (``quantpack_exl3.config.Exl3Config``). Follows vLLM's ``QuantizationConfig``
(``vllm/model_executor/layers/quantization/base_config.py``) and ``get_quant_config`` /
``VllmConfig._get_quantization_config`` (when ``from_config`` and ``maybe_update_config`` are called: in the
front-end process, before the engine starts).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from quantpack_core.dense import DENSE, DenseKernel
from quantpack_core.embedding import INT8_FORMAT
from quantpack_core.errors import BackendUnavailableError, LayerLoadError
from quantpack_core.format import LinearFormat
from quantpack_core.inventory import MANIFEST_FILE
from quantpack_core.kernels import ExpertKernel, KernelLog, LinearKernel, LinearSpec, Platform
from quantpack_core.names import FUSED_LAYERS, constituents, expand_fused, normalize_prefix

from .compile_key import CompileKey
from .embedding import Int8RowsEmbeddingMethod
from .ngram import NGRAM_MODULE
from .platform import current_platform

logger = logging.getLogger("vllm.quantpack")
#: the files of a pack repository the check reads and vLLM loads (weights, index, configs, tokenizer)
PACK_FILE_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt"]

INT8_ROWS = "int8_rows"


def manifest_storage(tensor_storage: Mapping[str, Any], fmt: LinearFormat) -> dict[str, str]:
    """Canonical module name -> ``fmt.name``, ``"int8_rows"`` or ``"dense"`` from a pack's ``tensor_storage``.

    Args:
        tensor_storage: ``quantization_config.json``'s ``tensor_storage`` (module -> entry with ``stored_tensors``
            and, for quantized modules, ``quant_format``).
        fmt: the pack's format (its name and main suffix identify its modules).

    Returns:
        ``{normalize_prefix(module): kind}``; modules that are neither (norms' weights count as dense, which is
        harmless: no linear layer asks for them) are left out.
    """
    storage: dict[str, str] = {}
    for module, entry in (tensor_storage or {}).items():
        entry = entry or {}
        stored = entry.get("stored_tensors") or {}
        if entry.get("quant_format") == fmt.name or f"{module}.{fmt.main_suffix}" in stored:
            storage[normalize_prefix(module)] = fmt.name
        elif entry.get("quant_format") == INT8_FORMAT or f"{module}.qweight" in stored:
            storage[normalize_prefix(module)] = INT8_ROWS
        elif f"{module}.weight" in stored:
            storage[normalize_prefix(module)] = DENSE
    return storage


def manifest_table_rows(tensor_storage: Mapping[str, Any]) -> dict[str, int]:
    """Canonical module name -> rows of its stored 2-D ``weight``, from a pack's ``tensor_storage`` (the dense
    tables' lengths, held against the vocabulary vLLM builds; modules whose entry gives no such shape are left
    out)."""
    rows: dict[str, int] = {}
    for module, entry in (tensor_storage or {}).items():
        stored = (entry or {}).get("stored_tensors") or {}
        shape = (stored.get(f"{module}.weight") or {}).get("shape") if isinstance(stored, dict) else None
        if isinstance(shape, list) and len(shape) == 2 and isinstance(shape[0], int):
            rows[normalize_prefix(module)] = shape[0]
    return rows


def check_fused_storage(storage: Mapping[str, str]) -> None:
    """Refuse a manifest that stores some modules behind one fused vLLM layer quantized and others dense (e.g.
    ``q_proj`` / ``v_proj`` quantized but ``k_proj`` dense): one vLLM layer is all one kind.

    Raises:
        LayerLoadError: naming the modules and their kinds.
    """
    for alternatives in FUSED_LAYERS.values():
        for group in alternatives:
            if len(group) < 2:
                continue
            parents: dict[str, dict[str, str]] = {}
            for name, kind in storage.items():
                parent, _, last = name.rpartition(".")
                if last in group:
                    parents.setdefault(parent, {})[last] = kind
            for parent, kinds in parents.items():
                if len(set(kinds.values())) > 1:
                    listing = ", ".join(f"{parent}.{n} as {k}" for n, k in sorted(kinds.items()))
                    raise LayerLoadError(
                        f"the pack stores {listing}; vLLM fuses them into one layer, which cannot mix quantized "
                        "and dense modules - re-quantize the pack with one setting for all of them"
                    )


def built_config(hf_config) -> dict | None:
    """vLLM's model config as a dict for the pack check (:meth:`quantpack_core.pack.Pack.open`'s ``model_config``):
    ``PretrainedConfig.to_dict()``, config.json as the server built it (after ``--hf-overrides``, a draft's class
    renamed); None without one, or where it does not give a dict (the check then reads config.json).

    Args:
        hf_config: the ``hf_config`` vLLM hands to ``maybe_update_config`` (a transformers ``PretrainedConfig``), or
            None.
    """
    try:
        value = hf_config.to_dict() if hf_config is not None else None
    except (AttributeError, TypeError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def untie_if_head_stored(modules: Sequence[str], hf_config, where: str) -> bool:
    """Packs can say ``tie_word_embeddings: true`` and still ship their own quantized ``lm_head`` (exllamav3 1.4 and
    older do); the head in the pack wins (vLLM would otherwise skip loading it and reuse the embedding). Sets
    ``tie_word_embeddings`` to False on the config (and its text config) in that case.

    Args:
        modules: the pack's module names.
        hf_config: the model's transformers config (or None).
        where: the pack, for the message.

    Returns:
        whether the config was changed.
    """
    if hf_config is None or not any(normalize_prefix(k) == "lm_head" for k in modules):
        return False
    changed = False
    for cfg in (hf_config, getattr(hf_config, "text_config", None)):
        if cfg is not None and getattr(cfg, "tie_word_embeddings", False):
            cfg.tie_word_embeddings = False
            changed = True
    if changed:
        logger.warning(
            "quantpack: %s says tie_word_embeddings but stores its own lm_head; serving the stored head", where
        )
    return changed


class QuantpackConfig(QuantizationConfig):
    """Base of a format's quantization config (see the module docstring).

    Class attributes a format sets:
        format: its :class:`~quantpack_core.format.LinearFormat` (or ``ExpertFormat``).
        linear_method, moe_method: its method classes (subclasses of :class:`~.linear.QuantLinearMethod` /
            :class:`~.moe.QuantMoEMethod` bound to the format).
        embedding_method: the method of int8-row (or unknown) embeddings and int8-row heads
            (:class:`~.embedding.Int8RowsEmbeddingMethod` or a subclass naming the format's int8 tensors).
        ngram_method: the method of a hashed n-gram table (``...ngram_embedding``: Flash-Next's per-layer
            embedding), or None where the format stores none (:class:`~.ngram.NgramRingsEmbeddingMethod`).
        LINEAR_KERNELS, EXPERT_KERNELS: platform kind -> kernels in priority order (fastest first).
        BACKEND_ENV: the environment variable that forces one kernel by name.
        UNAVAILABLE_HINT: what to tell a user whose platform has no usable kernel.
        title: the plugin's name, for messages.

    Args:
        quant_config: the pack's quantization config (``config.json``'s ``quantization_config``, possibly with
            ``tensor_storage``).

    Attributes:
        platform: where the kernels run.
        linear_kernels, expert_kernels: the priority lists in force (the platform's, or the one forced kernel).
        dense_kernels: the kernels of dense shards.
        storage: canonical module name -> how the pack stores it: the format's name, ``"int8_rows"`` or
            ``"dense"`` (empty without a manifest).
        kernel_log: the model's kernel choices.
        compile_key: the model's kernel plan, in vLLM's compile-cache key (:mod:`.compile_key`).
        pack_source: ``(model, revision)`` as vLLM named the pack, once :meth:`maybe_update_config` ran (the
            methods that read files the index omits need it); else None.

    Raises:
        BackendUnavailableError: at construction, when no kernel can run on this platform (or the forced one
            cannot), naming every kernel's reason and the fix.
        LayerLoadError: a manifest that mixes kinds behind one fused layer.
    """

    format: ClassVar[LinearFormat]
    linear_method: ClassVar[type]
    moe_method: ClassVar[type | None] = None
    embedding_method: ClassVar[type] = Int8RowsEmbeddingMethod
    ngram_method: ClassVar[type | None] = None
    LINEAR_KERNELS: ClassVar[Mapping[str, Sequence[type[LinearKernel]]]]
    EXPERT_KERNELS: ClassVar[Mapping[str, Sequence[type[ExpertKernel]]]] = {}
    BACKEND_ENV: ClassVar[str]
    UNAVAILABLE_HINT: ClassVar[str] = ""
    title: ClassVar[str] = "quantpack"

    def __init__(self, quant_config: Mapping[str, Any]):
        super().__init__()
        self.raw = {k: v for k, v in quant_config.items() if k != "tensor_storage"}
        self.platform: Platform = current_platform()
        self.linear_kernels, self.expert_kernels = self.resolve_kernels(self.platform)
        self.dense_kernels: tuple[type[LinearKernel], ...] = (DenseKernel,)
        self.storage: dict[str, str] = manifest_storage(quant_config.get("tensor_storage") or {}, self.format)
        self.table_rows: dict[str, int] = manifest_table_rows(quant_config.get("tensor_storage") or {})
        check_fused_storage(self.storage)
        self.kernel_log = KernelLog(self.title)
        self.compile_key = CompileKey()
        self.pack_source: tuple[str, str | None] | None = None

    # ---------------------------------------------------------------------------------------------- kernels

    @classmethod
    def resolve_kernels(
        cls, platform: Platform
    ) -> tuple[tuple[type[LinearKernel], ...], tuple[type[ExpertKernel], ...]]:
        """The linear and expert priority lists in force on ``platform``.

        Returns:
            the platform's lists; with :attr:`BACKEND_ENV` set, the kernel of that name alone in each list that has
            one (the other list keeps the platform's).

        Raises:
            BackendUnavailableError: the variable names no kernel of this version, the forced kernel is not available
                here, or no linear kernel of the platform's list is available (each kernel's reason and the fix).
        """
        linear = tuple(cls.LINEAR_KERNELS.get(platform.kind, ()))
        experts = tuple(cls.EXPERT_KERNELS.get(platform.kind, ()))
        forced = os.environ.get(cls.BACKEND_ENV, "").strip().lower()
        if forced:
            every = [k for table in (cls.LINEAR_KERNELS, cls.EXPERT_KERNELS) for ks in table.values() for k in ks]
            named = {k.name for k in every}
            if forced not in named:
                raise BackendUnavailableError(
                    f"{cls.BACKEND_ENV}={forced!r} is not a kernel of this version; choose one of "
                    f"{', '.join(sorted(named))}, or unset it"
                )
            pick = {k for k in every if k.name == forced}
            for kernel in pick:
                ok, why = kernel.available(platform)
                if not ok:
                    usable = sorted({k.name for k in every if k.name != forced and k.available(platform)[0]})
                    choose = f"Choose another that runs here ({', '.join(usable)}), or" if usable else "No other kernel"
                    if not usable:
                        choose += " runs on this platform either:"
                    raise BackendUnavailableError(
                        f"{cls.BACKEND_ENV}={forced}: the {forced} kernel {why}. {choose} unset {cls.BACKEND_ENV}. "
                        f"{cls.UNAVAILABLE_HINT}"
                    )
            lin = tuple(k for k in pick if issubclass(k, LinearKernel))
            exp = tuple(k for k in pick if issubclass(k, ExpertKernel))
            return lin or linear, exp or experts
        reasons = []
        for kernel in linear:
            ok, why = kernel.available(platform)
            if ok:
                return linear, experts
            reasons.append(f"the {kernel.name} kernel {why}")
        what = "; ".join(reasons) if reasons else f"this version has no {cls.format.label} kernel for {platform.kind}"
        raise BackendUnavailableError(
            f"{cls.title} cannot serve {cls.format.label} on this {platform} platform: {what}. {cls.UNAVAILABLE_HINT}"
        )

    def dense_spec(self, in_features: int, out_features: int, dtype: torch.dtype, tp: str) -> LinearSpec:
        """The :class:`LinearSpec` of a dense shard of this rank's size (``tp``: ``"whole"``, or ``"sliced"``: a dense
        share is always cut exactly)."""
        return LinearSpec(
            self.platform, DENSE, None, None, in_features, out_features, in_features, out_features, dtype, tp
        )

    # ------------------------------------------------------------------------------------ vLLM's class interface

    @classmethod
    def get_name(cls) -> str:
        return cls.format.name

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16, torch.float32]

    @staticmethod
    def get_config_filenames() -> list[str]:
        return [MANIFEST_FILE]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuantpackConfig:
        return cls(config)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None, **kwargs) -> str | None:
        """Claim packs whose config names this format (``hf_config=`` is passed from vLLM 0.20 on)."""
        method = str((hf_quant_cfg or {}).get("quant_method", "")).lower()
        name = cls.get_name()
        if method == name and user_quant in (None, name):
            return name
        return None

    def read_manifest(self, tensor_storage: Mapping[str, Any]) -> None:
        """Take the pack's manifest (``tensor_storage``) as :attr:`storage`.

        Raises:
            LayerLoadError: a manifest that mixes kinds behind one fused layer.
        """
        self.storage = manifest_storage(tensor_storage, self.format)
        self.table_rows = manifest_table_rows(tensor_storage)
        check_fused_storage(self.storage)

    @staticmethod
    def local_pack(model_name: str, revision: str | None) -> str | None:
        """The pack's folder: ``model_name`` itself, or a Hugging Face repository's snapshot at ``revision`` in
        huggingface_hub's cache (fetched there when missing: vLLM's loader reads the same files from there next), so
        that the pack check and the head's untie run before vLLM loads a repository too; None where the snapshot
        cannot be had (vLLM's own download then says why)."""
        if os.path.isdir(model_name):
            return model_name
        try:
            from huggingface_hub import snapshot_download

            return snapshot_download(model_name, revision=revision, allow_patterns=PACK_FILE_PATTERNS)
        except Exception as e:  # not a repository id, offline without it, no access
            logger.warning("quantpack: %s: no local snapshot to check before loading (%s)", model_name, e)
            return None

    def fetch_manifest(self, repo_id: str, revision: str | None) -> None:
        """Read the manifest of a pack on the Hugging Face hub, where it can be had; otherwise every layer goes to the
        format's methods, which still tell quantized from dense shards by the tensors that arrive."""
        try:
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(repo_id, MANIFEST_FILE, revision=revision)
            with open(path) as f:
                self.read_manifest(json.load(f).get("tensor_storage") or {})
        except Exception as e:  # offline, or a pack without a manifest
            logger.debug("quantpack: no manifest for %s (%s)", repo_id, e)

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        """Add vLLM's spelling of every manifest module (names are also compared in canonical form)."""
        if not self.storage:
            return
        mapped, rows = {}, {}
        for name, kind in self.storage.items():
            for out in hf_to_vllm_mapper.apply_list([name]):
                mapped[normalize_prefix(out)] = kind
                if name in self.table_rows:
                    rows[normalize_prefix(out)] = self.table_rows[name]
        self.storage.update(mapped)
        self.table_rows.update(rows)

    # ------------------------------------------------------------------------------------------------ storage

    def storage_of(self, prefix: str) -> str | None:
        """How the pack stores the checkpoint modules behind vLLM layer ``prefix``: the format's name, ``"int8_rows"``,
        ``"dense"`` or None (not in the manifest, or no manifest).

        Where the manifest holds a whole alternative layout of the layer (every module of it, e.g. the split
        ``q_proj`` / ``k_proj`` / ``v_proj`` of a vision ``qkv``), the first such layout decides, so a pack that also
        keeps the other layout (exllamav3's converter's dense fused ``qkv``) is served by the one its loader reads.

        Raises:
            LayerLoadError: when the manifest has quantized and dense modules behind one fused layer.
        """
        for alt in expand_fused(prefix):
            whole = {name: self.storage.get(normalize_prefix(name)) for name in alt}
            if None not in whole.values():
                return self._one_kind(prefix, whole)
        kinds = {}
        for name in constituents(prefix):
            kind = self.storage.get(normalize_prefix(name))
            if kind is not None:
                kinds[name] = kind
        return self._one_kind(prefix, kinds)

    @staticmethod
    def _one_kind(prefix: str, kinds: dict[str, str]) -> str | None:
        """The one kind of ``kinds`` (module -> kind), None when empty.

        Raises:
            LayerLoadError: the modules have different kinds.
        """
        if len(set(kinds.values())) > 1:
            raise LayerLoadError(
                f"{prefix}: the pack stores {', '.join(f'{n} as {k}' for n, k in kinds.items())}; one vLLM layer "
                "cannot mix quantized and dense shards - re-quantize the pack with one setting for all of them"
            )
        return next(iter(kinds.values()), None)

    def expert_storage(self, prefix: str) -> set[str]:
        """Kinds the manifest gives the expert modules under the MoE layer ``prefix`` (``...mlp.experts``); empty
        without a manifest."""
        key = normalize_prefix(prefix) + "."
        return {kind for name, kind in self.storage.items() if name.startswith(key)}

    def ngram_embedding_method(self, prefix: str) -> QuantizeMethodBase:
        """The method of the hashed n-gram table ``prefix`` (vLLM's PLE embedding layer; the Flash-Next family fix
        calls it where vLLM's own selection would refuse this config).

        Raises:
            LayerLoadError: the format stores no n-gram tables.
            PackError: the pack's table file is missing or unsound (:class:`~.ngram.NgramRingsEmbeddingMethod`).
        """
        if self.ngram_method is None:
            raise LayerLoadError(
                f"{prefix}: {self.format.label} packs store no hashed n-gram table; this model needs a pack whose "
                "table vLLM or a quantpack format reads (bf16, FP8, or an EXL3 pack made by exllamav3)"
            )
        return self.ngram_method(self, prefix)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The method for one layer vLLM builds.

        Raises:
            LayerLoadError: a fused layer that mixes quantized and dense modules in the pack, or an MoE layer whose
                experts the pack stores partly quantized and partly dense.
        """
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            ParallelLMHead,
            UnquantizedEmbeddingMethod,
            VocabParallelEmbedding,
        )

        from .compat import routed_experts_class

        self.compile_key.bind()
        stored = self.storage_of(prefix)
        if isinstance(layer, ParallelLMHead):
            if stored == DENSE:
                return UnquantizedEmbeddingMethod()
            if stored == INT8_ROWS:
                return self.embedding_method(prefix)
            return self.linear_method(self, prefix, is_lm_head=True)
        if isinstance(layer, VocabParallelEmbedding) and prefix.rsplit(".", 1)[-1] == NGRAM_MODULE:
            return self.ngram_embedding_method(prefix)
        if isinstance(layer, VocabParallelEmbedding):
            # a dense table known from the manifest goes to vLLM's own method, which loads exactly the vocabulary's
            # rows; one of another length (a vocabulary the model padded: 1,024 rows for vocab_size 1,000), int8
            # rows, or an unknown table, here (each rank keeps its vocabulary rows, those past vocab_size dropped)
            rows = self.table_rows.get(normalize_prefix(prefix))
            if stored == DENSE and rows in (None, getattr(layer, "org_vocab_size", rows)):
                return None
            return self.embedding_method(prefix)
        if isinstance(layer, LinearBase):
            if stored == DENSE:
                return UnquantizedLinearMethod()
            return self.linear_method(self, prefix)
        experts = routed_experts_class()
        if experts is not None and isinstance(layer, experts) and self.moe_method is not None:
            kinds = self.expert_storage(prefix)
            if kinds == {DENSE}:
                return None  # vLLM's unquantized MoE method loads per-expert .weight tensors
            if len(kinds) > 1:
                raise LayerLoadError(
                    f"{prefix}: the pack stores some experts of this layer as {self.format.label} and others as dense "
                    "weights; one MoE layer is one bank - re-quantize the pack with one setting for all of its experts"
                )
            return self.moe_method(layer.moe_config, self, prefix)
        return None
