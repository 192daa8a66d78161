"""``Exl3Config``: vLLM's quantization config for ``quant_method: "exl3"`` packs.

vLLM matches the checkpoint's ``quantization_config.quant_method`` against registered methods, so a pack made by
exllamav3 is claimed with no ``--quantization`` flag once :func:`quantpack_exl3.plugin.register` has run. The config
then routes each layer vLLM builds: EXL3 layers (and layers whose pack tensors are not known) to
:class:`~quantpack_exl3.linear.Exl3LinearMethod`, layers the pack's manifest lists as dense to vLLM's own unquantized
methods.

Follows vLLM's ``QuantizationConfig`` (``vllm/model_executor/layers/quantization/
base_config.py``) and ``get_quant_config`` / ``VllmConfig._get_quantization_config`` (when ``from_config`` and
``maybe_update_config`` are called: in the front-end process, before the engine starts).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from quantpack_core.codebook import Codebook
from quantpack_core.embedding import INT8_FORMAT
from quantpack_core.names import FUSED_LAYERS, constituents, normalize_prefix
from quantpack_core.pack import MANIFEST_FILE, Pack

from .backends import select_backend
from .embedding import Exl3EmbeddingMethod
from .linear import Exl3LinearMethod, LayerLoadError, UnsupportedLayerError  # noqa: F401  (re-exported)
from .moe import Exl3MoEMethod

logger = logging.getLogger("vllm.quantpack.exl3")

METHOD = "exl3"


def manifest_routes(tensor_storage: dict[str, Any]) -> dict[str, str]:
    """Canonical module name -> ``"exl3"``, ``"int8_rows"`` or ``"dense"`` from a pack's ``tensor_storage``.

    Args:
        tensor_storage: ``quantization_config.json``'s ``tensor_storage`` (module -> entry with ``stored_tensors``
            and, for EXL3 modules, ``quant_format: "exl3"``).

    Returns:
        ``{normalize_prefix(module): kind}``; modules that are neither (norms' weights count as dense, which is
        harmless: no linear layer asks for them) are left out.
    """
    routes: dict[str, str] = {}
    for module, entry in (tensor_storage or {}).items():
        entry = entry or {}
        stored = entry.get("stored_tensors") or {}
        if entry.get("quant_format") == METHOD or f"{module}.trellis" in stored:
            routes[normalize_prefix(module)] = "exl3"
        elif entry.get("quant_format") == INT8_FORMAT or f"{module}.qweight" in stored:
            routes[normalize_prefix(module)] = "int8_rows"
        elif f"{module}.weight" in stored:
            routes[normalize_prefix(module)] = "dense"
    return routes


def untie_if_head_stored(pack: Pack, hf_config) -> bool:
    """Packs from exllamav3 1.4 and older can say ``tie_word_embeddings: true`` and still ship their own quantized
    ``lm_head``; the head in the pack wins (vLLM would otherwise skip loading it and reuse the embedding). Sets
    ``tie_word_embeddings`` to False on the config (and its text config) in that case.

    Returns:
        whether the config was changed.
    """
    if hf_config is None or not any(normalize_prefix(k) == "lm_head" for k in pack.modules):
        return False
    changed = False
    for cfg in (hf_config, getattr(hf_config, "text_config", None)):
        if cfg is not None and getattr(cfg, "tie_word_embeddings", False):
            cfg.tie_word_embeddings = False
            changed = True
    if changed:
        logger.warning(
            "quantpack-exl3: %s says tie_word_embeddings but stores its own lm_head; serving the stored head", pack.path
        )
    return changed


def check_fused_routes(routes: dict[str, str]) -> None:
    """Refuse a manifest that stores some modules behind one fused vLLM layer as EXL3 and others as dense (e.g.
    ``q_proj``/``v_proj`` EXL3 but ``k_proj`` dense): one vLLM layer is all one kind.

    Args:
        routes: :func:`manifest_routes`'s result.

    Raises:
        LayerLoadError: naming the modules and their kinds.
    """
    for alternatives in FUSED_LAYERS.values():
        for group in alternatives:
            if len(group) < 2:
                continue
            parents: dict[str, dict[str, str]] = {}
            for name, kind in routes.items():
                parent, _, last = name.rpartition(".")
                if last in group:
                    parents.setdefault(parent, {})[last] = kind
            for parent, kinds in parents.items():
                if len(set(kinds.values())) > 1:
                    listing = ", ".join(f"{parent}.{n} as {k}" for n, k in sorted(kinds.items()))
                    raise LayerLoadError(
                        f"the pack stores {listing}; vLLM fuses them into one layer, which cannot mix EXL3 trellis "
                        "and dense modules - re-quantize the pack with one setting for all of them"
                    )


class Exl3Config(QuantizationConfig):
    """Quantization config of an EXL3 pack.

    Args:
        quant_config: the pack's quantization config (``config.json``'s ``quantization_config``, possibly with
            ``tensor_storage``).

    Attributes:
        bits: average bits per weight the pack was made at.
        head_bits: bits of lm_head.
        codebook: default codebook (each tensor's own marker decides).
        backend: the kernel backend chosen for this device.
        routes: canonical module name -> ``"exl3"`` / ``"dense"`` (empty without a manifest).

    Raises:
        BackendUnavailableError: at construction, when no backend can run on this device.
    """

    def __init__(self, quant_config: dict[str, Any]):
        super().__init__()
        from vllm.platforms import current_platform

        self.raw = {k: v for k, v in quant_config.items() if k != "tensor_storage"}
        self.bits = float(quant_config.get("bits", 0.0) or 0.0)
        self.head_bits = float(quant_config.get("head_bits", 16) or 16)
        # informational: each tensor's own marker decides its codebook
        self.codebook = str(quant_config.get("codebook", Codebook.INST3.value))
        capability = None
        if current_platform.device_type == "cuda":
            cap = current_platform.get_device_capability()
            capability = cap.to_int() if cap is not None else None
        self.backend = select_backend(current_platform.device_type, capability)
        self.routes: dict[str, str] = manifest_routes(quant_config.get("tensor_storage") or {})
        check_fused_routes(self.routes)

    def __repr__(self) -> str:
        return (
            f"Exl3Config(bits={self.bits:g}, head_bits={self.head_bits:g}, codebook={self.codebook}, "
            f"backend={self.backend.name}, manifest_modules={len(self.routes)})"
        )

    # ---------------------------------------------------------------------------------- vLLM's class interface

    @classmethod
    def get_name(cls) -> str:
        return METHOD

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        # exllamav3's kernels need sm_80; vLLM skips this check where the platform has no capability (CPU).
        return 80

    @staticmethod
    def get_config_filenames() -> list[str]:
        return [MANIFEST_FILE]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Exl3Config:
        return cls(config)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None, **kwargs) -> str | None:
        """Claim packs whose config says ``quant_method: "exl3"`` (``hf_config=`` is passed from vLLM 0.20 on)."""
        method = str((hf_quant_cfg or {}).get("quant_method", "")).lower()
        if method == METHOD and user_quant in (None, METHOD):
            return METHOD
        return None

    def maybe_update_config(self, model_name: str, hf_config=None, revision: str | None = None) -> None:
        """Validate a local pack and read its manifest, before any weight is loaded.

        Raises:
            PackError: the pack is unsound (every problem is listed, each with module, tensor and fix).
        """
        if not os.path.isdir(model_name):
            self._fetch_manifest(model_name, revision)
            return
        pack = Pack.open(model_name)
        if pack.manifest:
            self.routes = manifest_routes(pack.manifest)
            check_fused_routes(self.routes)
        untie_if_head_stored(pack, hf_config)
        logger.info(
            "quantpack-exl3: %s: %d EXL3 modules (K histogram %s), backend %s",
            model_name,
            sum(1 for m in pack.modules.values() if m.format == "exl3"),
            pack.bits_histogram(),
            self.backend.name,
        )

    def _fetch_manifest(self, repo_id: str, revision: str | None) -> None:
        try:
            import json

            from huggingface_hub import hf_hub_download

            path = hf_hub_download(repo_id, MANIFEST_FILE, revision=revision)
            with open(path) as f:
                self.routes = manifest_routes(json.load(f).get("tensor_storage") or {})
        except Exception as e:  # offline, or a pack without a manifest: every linear layer is then EXL3-capable
            logger.debug("quantpack-exl3: no manifest for %s (%s)", repo_id, e)

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        """Add vLLM's spelling of every manifest module (names are also compared in canonical form)."""
        if not self.routes:
            return
        mapped = {}
        for name, kind in self.routes.items():
            for out in hf_to_vllm_mapper.apply_list([name]):
                mapped[normalize_prefix(out)] = kind
        self.routes.update(mapped)

    # ------------------------------------------------------------------------------------------------ routing

    def route(self, prefix: str) -> str | None:
        """How the pack stores the checkpoint modules behind vLLM layer ``prefix``: ``"exl3"``, ``"dense"`` or None
        (not in the manifest, or no manifest).

        Raises:
            LayerLoadError: when the manifest has EXL3 and dense modules behind one fused layer.
        """
        kinds = {}
        for name in constituents(prefix):
            kind = self.routes.get(normalize_prefix(name))
            if kind is not None:
                kinds[name] = kind
        if len(set(kinds.values())) > 1:
            raise LayerLoadError(
                f"{prefix}: the pack stores {', '.join(f'{n} as {k}' for n, k in kinds.items())}; one vLLM layer "
                "cannot mix EXL3 trellis and dense shards - re-quantize the pack with one setting for all of them"
            )
        return next(iter(kinds.values()), None)

    def expert_routes(self, prefix: str) -> set[str]:
        """Kinds (``"exl3"``, ``"dense"``) the manifest gives the expert modules under the MoE layer ``prefix``
        (``...mlp.experts``); empty without a manifest."""
        key = normalize_prefix(prefix) + "."
        return {kind for name, kind in self.routes.items() if name.startswith(key)}

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """The method for one layer vLLM builds.

        Raises:
            LayerLoadError: a fused layer that mixes EXL3 and dense modules in the pack.
            LayerLoadError: an MoE layer whose experts the pack stores partly as EXL3 and partly dense.
        """
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            ParallelLMHead,
            UnquantizedEmbeddingMethod,
            VocabParallelEmbedding,
        )

        from .compat import routed_experts_class

        route = self.route(prefix)
        if isinstance(layer, ParallelLMHead):
            if route == "dense":
                return UnquantizedEmbeddingMethod()
            if route == "int8_rows":
                return Exl3EmbeddingMethod(prefix)
            return Exl3LinearMethod(self.backend, prefix, is_lm_head=True)
        if isinstance(layer, VocabParallelEmbedding):
            # a dense table known from the manifest goes to vLLM's own method; int8 rows, or an unknown table, here
            return None if route == "dense" else Exl3EmbeddingMethod(prefix)
        if isinstance(layer, LinearBase):
            if route == "dense":
                return UnquantizedLinearMethod()
            return Exl3LinearMethod(self.backend, prefix)
        experts = routed_experts_class()
        if experts is not None and isinstance(layer, experts):
            kinds = self.expert_routes(prefix)
            if kinds == {"dense"}:
                return None  # vLLM's unquantized MoE method loads per-expert .weight tensors
            if len(kinds) > 1:
                raise LayerLoadError(
                    f"{prefix}: the pack stores some experts of this layer as EXL3 trellis and others as dense "
                    "weights; one MoE layer is one bank - re-quantize the pack with one setting for all of its experts"
                )
            return Exl3MoEMethod(layer.moe_config, self.backend, prefix)
        return None
