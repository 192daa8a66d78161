"""``Exl3Config``: vLLM's quantization config for ``quant_method: "exl3"`` packs.

The format-free base (:class:`quantpack_core.vllm.config.QuantpackConfig`) gives each layer its method and resolves
the kernel lists; this class binds the EXL3 format, its methods and kernels, and validates a local pack with
:class:`quantpack_core.pack.Pack` before any weight is read.
"""

from __future__ import annotations

import logging
from typing import Any

from quantpack_core.codec import Codebook
from quantpack_core.pack import Pack
from quantpack_core.vllm.config import QuantpackConfig, built_config, untie_if_head_stored
from quantpack_core.vllm.ngram import NgramRingsEmbeddingMethod

from .format import EXL3
from .kernels import BACKEND_ENV, EXPERT_KERNELS, LINEAR_KERNELS
from .methods import Exl3LinearMethod, Exl3MoEMethod


def _bits(value: object, default: float) -> float | None:
    """A bit count of the quantization config: ``default`` where absent or 0, the number where it is one, else None
    (the pack check names the field)."""
    if value is None or value == 0:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


logger = logging.getLogger("vllm.quantpack.exl3")


class Exl3Config(QuantpackConfig):
    """Quantization config of an EXL3 pack.

    Args:
        quant_config: the pack's quantization config (``config.json``'s ``quantization_config``, possibly with
            ``tensor_storage``).

    Attributes:
        bits: average bits per weight the pack was made at.
        head_bits: bits of lm_head.
        codebook: default codebook (informational: each tensor's own marker decides).
        (and those of :class:`~quantpack_core.vllm.config.QuantpackConfig`: platform, kernel lists, storage.)

    Raises:
        BackendUnavailableError: at construction, when no kernel can run on this platform.
        LayerLoadError: a manifest that mixes EXL3 and dense modules behind one fused layer.
    """

    format = EXL3
    linear_method = Exl3LinearMethod
    moe_method = Exl3MoEMethod
    ngram_method = NgramRingsEmbeddingMethod  # exllamav3's row rings (Flash-Next's n-gram table)
    LINEAR_KERNELS = LINEAR_KERNELS
    EXPERT_KERNELS = EXPERT_KERNELS
    BACKEND_ENV = BACKEND_ENV
    UNAVAILABLE_HINT = (
        f"To run anyway with the reference kernel (it dequantizes every layer at load, so it needs the memory of the "
        f"dense model and runs at dense speed), set {BACKEND_ENV}=reference."
    )
    title = "quantpack-exl3"

    def __init__(self, quant_config: dict[str, Any]):
        super().__init__(quant_config)
        # informative only; a value that is no number is reported with the pack's other problems when vLLM calls
        # maybe_update_config (Pack.open), not as a bare conversion error while vLLM validates its config
        self.bits = _bits(quant_config.get("bits"), 0.0)
        self.head_bits = _bits(quant_config.get("head_bits"), 16.0)
        self.codebook = str(quant_config.get("codebook", Codebook.INST3.value))

    def __repr__(self) -> str:
        kernels = ", ".join(k.name for k in self.linear_kernels)
        return (
            f"Exl3Config(bits={self.bits}, head_bits={self.head_bits}, codebook={self.codebook}, "
            f"platform={self.platform}, kernels=[{kernels}], manifest_modules={len(self.storage)})"
        )

    @classmethod
    def get_min_capability(cls) -> int:
        """0: the kernel lists decide per platform (exllamav3 needs sm_80, the forced reference kernel runs on any GPU);
        vLLM's own check would refuse an older GPU before the forced reference kernel could be used."""
        return 0

    def maybe_update_config(self, model_name: str, hf_config=None, revision: str | None = None) -> None:
        """Validate the pack (a folder, or a Hugging Face repository's snapshot) and read its manifest, before any
        weight is loaded.

        Raises:
            PackError: the pack is unsound (every problem is listed, each with module, tensor and fix).
        """
        self.pack_source = (model_name, revision)
        folder = self.local_pack(model_name, revision)
        if folder is None:
            self.fetch_manifest(model_name, revision)
            return
        pack = Pack.open(folder, model_config=built_config(hf_config))
        if pack.manifest:
            self.read_manifest(pack.manifest)
        untie_if_head_stored(list(pack.modules), hf_config, str(pack.path))
        logger.info(
            "quantpack-exl3: %s: %d EXL3 modules (K histogram %s), kernels in priority order: %s",
            model_name,
            sum(1 for m in pack.modules.values() if m.format == "exl3"),
            pack.bits_histogram(),
            ", ".join(k.name for k in self.linear_kernels),
        )
