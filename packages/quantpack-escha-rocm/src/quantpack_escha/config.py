"""``EschaConfig``: vLLM's quantization config for ``quant_method: "escha"`` packs.

``layer_meta`` (in ``quantization_config``) names every coded projection in the checkpoint's namespace with its K;
vLLM asks about its own module names, and about merged modules (``qkv_proj``, ``gate_up_proj``, ``in_proj_qkvz``).
Names are matched on their tail from ``layers.`` (``model.language_model.layers.0.mlp.gate_proj`` and vLLM's
``language_model.model.layers.0.mlp.gate_proj`` are one module), and a merged module is coded exactly when its
sources are: all of them (each keeps its own K and its own kernel call), or none (vLLM's unquantized method). A
merge whose sources are partly coded is refused. ``embed_tokens`` / ``lm_head`` stored as ``weight_int8`` +
``weight_scale`` are served by the int8-row embedding method (the table stays int8 on the device).

Follows vLLM's ``QuantizationConfig`` through :class:`quantpack_core.vllm.config.QuantpackConfig`; the format is
described in docs/escha-format.md.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from quantpack_core.errors import LayerLoadError
from quantpack_core.names import expand_fused, normalize_prefix
from quantpack_core.vllm.config import INT8_ROWS, QuantpackConfig, untie_if_head_stored
from quantpack_core.vllm.embedding import Int8RowsEmbeddingMethod

from .check import layer_ks, meta_key, meta_mismatches
from .codec import CODE
from .format import ESCHA
from .kernels import BACKEND_ENV, LINEAR_KERNELS
from .methods import EschaLinearMethod

logger = logging.getLogger("vllm.quantpack.escha")

#: the int8 tables' suffixes in an escha pack
INT8_ROWS_SUFFIX, INT8_SCALES_SUFFIX = "weight_int8", "weight_scale"
DENSE_SUFFIX = "weight"
#: the only tables an escha pack stores as int8 rows
INT8_TABLES = ("embed_tokens", "lm_head")


class EschaInt8Embedding(Int8RowsEmbeddingMethod):
    """The int8-row embedding / head method with escha's tensor names (``weight_int8`` I8 ``[V, H]``,
    ``weight_scale`` F16 ``[V]``); see :class:`quantpack_core.vllm.embedding.Int8RowsEmbeddingMethod`."""

    rows_suffix = INT8_ROWS_SUFFIX
    scales_suffix = INT8_SCALES_SUFFIX
    rebuild_hint = "re-download the pack (an escha pack stores both for embed_tokens and lm_head)"


class EschaConfig(QuantpackConfig):
    """Quantization config of an escha pack.

    Args:
        quant_config: ``config.json``'s ``quantization_config``: ``quant_method: "escha"`` and ``layer_meta``
            (checkpoint module -> ``{"K": int, ...}``; other keys such as ``bits`` are informational).

    Attributes:
        layer_meta: the pack's ``layer_meta`` as given.
        (and those of :class:`~quantpack_core.vllm.config.QuantpackConfig`.)

    Raises:
        LayerLoadError: ``layer_meta`` that is not a mapping of modules to entries with an integer K in 1..8.
        BackendUnavailableError: no escha kernel can run on this platform.
    """

    format = ESCHA
    linear_method = EschaLinearMethod
    embedding_method = EschaInt8Embedding
    LINEAR_KERNELS = LINEAR_KERNELS
    BACKEND_ENV = BACKEND_ENV
    UNAVAILABLE_HINT = (
        f"To run anyway with the reference kernel (it decodes every layer at load, so it needs the memory of the "
        f"dense model), set {BACKEND_ENV}=reference."
    )
    title = "quantpack-escha"

    def __init__(self, quant_config: dict[str, Any]):
        super().__init__(quant_config)
        self.layer_meta = quant_config.get("layer_meta") or {}
        self._meta = layer_ks(self.layer_meta)
        self._k = {key: k for key, (_, k) in self._meta.items()}

    def __repr__(self) -> str:
        hist: dict[int, int] = {}
        for k in self._k.values():
            hist[k] = hist.get(k, 0) + 1
        kernels = ", ".join(k.name for k in self.linear_kernels)
        return f"EschaConfig(coded={len(self._k)}, K={dict(sorted(hist.items()))}, kernels=[{kernels}])"

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        """0: the kernel lists decide per platform."""
        return 0

    def meta_k(self, module: str) -> int | None:
        """The K ``layer_meta`` gives a checkpoint (or vLLM) module, or None when it is not coded."""
        return self._k.get(meta_key(module))

    def coded(self, prefix: str) -> bool:
        """Whether vLLM's layer ``prefix`` is escha-coded: all of its sources are in ``layer_meta`` (a merged
        layer's q / k / v, gate / up ...), or none.

        Raises:
            LayerLoadError: some sources of a merged layer are coded and others are not (named).
        """
        for group in expand_fused(prefix):
            hit = [n for n in group if self.meta_k(n) is not None]
            if hit and len(hit) != len(group):
                rest = [n for n in group if n not in hit]
                raise LayerLoadError(
                    f"{prefix}: layer_meta codes {', '.join(hit)} but not {', '.join(rest)}; vLLM merges them into one "
                    "layer, which cannot mix escha-coded and dense sources - the pack is inconsistent, re-convert it "
                    "with all of them coded"
                )
            if hit:
                return True
        return False

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        """Coded linear layers -> :class:`~quantpack_escha.methods.EschaLinearMethod`; other linear layers ->
        vLLM's unquantized method; embeddings and heads by the base's storage table (int8 rows here).

        Raises:
            LayerLoadError: a merged layer whose sources are partly coded.
        """
        from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

        from quantpack_core.vllm.compat import routed_experts_class

        if isinstance(layer, LinearBase):
            return self.linear_method(self, prefix) if self.coded(prefix) else UnquantizedLinearMethod()
        experts = routed_experts_class()
        if experts is not None and isinstance(layer, experts):
            key = meta_key(prefix) + "."
            coded = sorted(k for k in self._k if k.startswith(key))
            if coded:
                raise LayerLoadError(
                    f"{prefix}: layer_meta codes its experts ({coded[0]} and {len(coded) - 1} more); escha expert "
                    "banks (eschamoe packs) are not supported by this version of quantpack-escha-rocm - serve a "
                    "dense-MLP escha pack, or the model's EXL3 pack with quantpack-exl3"
                )
            return None
        return super().get_quant_method(layer, prefix)

    def maybe_update_config(self, model_name: str, hf_config=None, revision: str | None = None) -> None:
        """For a pack folder or a Hugging Face repository's snapshot (:meth:`local_pack`), record how it stores
        ``embed_tokens`` / ``lm_head`` (int8 rows or a dense table); a stored head is served even when the config ties
        it. Where no snapshot can be had, the default (int8 rows, what escha packs store)."""
        folder = self.local_pack(model_name, revision)
        if folder is None:
            for table in INT8_TABLES:
                self.storage.setdefault(table, INT8_ROWS)
            return
        names = tensor_names(Path(folder))
        self.check_layer_meta(code_shapes(Path(folder)))
        for name in names:
            module, _, suffix = name.rpartition(".")
            key = normalize_prefix(module)
            if key.rsplit(".", 1)[-1] not in INT8_TABLES:
                continue
            if suffix in (INT8_ROWS_SUFFIX, INT8_SCALES_SUFFIX):
                self.storage[key] = INT8_ROWS
            elif suffix == DENSE_SUFFIX:
                self.storage.setdefault(key, "dense")
        untie_if_head_stored([n.rpartition(".")[0] for n in names], hf_config, folder)
        logger.info("quantpack-escha: %s: %r", model_name, self)

    def check_layer_meta(self, codes: dict[str, tuple[int, ...]]) -> None:
        """``layer_meta`` against the pack's codes, in the user's process before any worker loads
        (:func:`quantpack_escha.check.meta_mismatches`, the check ``quantpack inspect`` makes too): every module
        storing ``.escha_code`` listed, every listed module storing one, each K the code's.

        Args:
            codes: each module storing ``.escha_code`` -> that tensor's shape (:func:`code_shapes`).

        Raises:
            LayerLoadError: the first disagreement, how many more of its kind there are, and the fix.
        """
        found = meta_mismatches(self._meta, {m: shape[-1] if shape else 0 for m, shape in codes.items()})
        if found:
            module, what, fix = found[0]
            raise LayerLoadError(f"{module}: {what} - {fix}")


def tensor_names(pack: Path) -> list[str]:
    """Every tensor name in a local pack's safetensors files (headers only)."""
    from safetensors import safe_open

    names: list[str] = []
    for f in sorted(pack.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            names.extend(st.keys())
    return names


def code_shapes(pack: Path) -> dict[str, tuple[int, ...]]:
    """Each module of a local pack storing ``.escha_code`` -> that tensor's shape (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(pack.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                module, _, suffix = name.rpartition(".")
                if suffix == CODE:
                    shapes[module] = tuple(st.get_slice(name).get_shape())
    return shapes
