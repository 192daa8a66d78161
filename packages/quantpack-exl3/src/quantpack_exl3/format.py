"""The EXL3 format, as the format-free machinery (:mod:`quantpack_core.vllm`) sees it.

An EXL3 shard is the set of tensors exllamav3 stores per linear layer: ``trellis`` (int16 ``(k/16, n/16, 16*K)``),
``suh`` / ``svh`` (float16; legacy packs: ``su`` / ``sv`` sign bitfields) and an optional codebook marker (``mcg`` /
``mul1``). Its geometry rule is exllamav3's padding: the stored sizes are the logical sizes rounded up to whole
128-feature Hadamard blocks (a head's vocabulary may end inside its last block). A tensor-parallel rank cuts whole
blocks out of it (:func:`quantpack_core.codec.cut_tensors`). An MoE layer's experts go into one K-sorted bank
(:func:`quantpack_core.moe.bank_from_tensors`).

Its rules of the pack check (:class:`quantpack_core.format.PackFormat`, registered under the ``quantpack.formats``
entry point) are :mod:`quantpack_exl3.check`'s.

Source: docs/exl3-format.md; exllamav3 ``exllamav3/modules/quant/exl3.py`` (``LinearEXL3``: tensors, padding).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from quantpack_core.check.settings import CheckSettings
from quantpack_core.codec import HAD_BLOCK, Exl3Tensors, cut_tensors
from quantpack_core.codec.codebook import Codebook
from quantpack_core.codec.exl3 import FORMAT
from quantpack_core.errors import Problem
from quantpack_core.format import PackRules
from quantpack_core.inventory import ModuleInfo, PackView, TensorInfo
from quantpack_core.kernels import ExpertSpec, LinearSpec, Platform
from quantpack_core.moe import Exl3MoeBank, bank_from_tensors
from quantpack_core.tp import TpCut, padding_error

from . import check


class Exl3Format(PackRules):
    """EXL3 linear shards and expert banks, and their rules of the pack check (implements
    :class:`quantpack_core.format.ExpertFormat` and :class:`quantpack_core.format.PackFormat`)."""

    name: ClassVar[str] = FORMAT
    label: ClassVar[str] = "EXL3"
    storage_label: ClassVar[str] = "an EXL3 trellis"
    writer: ClassVar[str] = "exllamav3's converter"
    suffixes: ClassVar[Mapping[str, torch.dtype]] = {
        "trellis": torch.int16,
        "suh": torch.float16,
        "svh": torch.float16,
        "su": torch.int16,  # legacy packed signs
        "sv": torch.int16,
        "mcg": torch.int32,
        "mul1": torch.int32,
    }
    main_suffix: ClassVar[str] = "trellis"
    block: ClassVar[int] = HAD_BLOCK
    tp_fallback: ClassVar[bool] = True

    def parse(self, tensors: Mapping[str, torch.Tensor]) -> Exl3Tensors:
        """The shard's :class:`~quantpack_core.codec.Exl3Tensors` (legacy sign vectors unpacked).

        Raises:
            CodecError: a missing tensor, both markers, a marker of an unknown variant, an illegal trellis width, or
                vectors that do not fit the trellis or hold NaN / infinities.
        """
        return Exl3Tensors.from_tensors(dict(tensors))

    def stored_shape(self, shard: Exl3Tensors) -> tuple[int, int]:
        """``(k, n)``: stored input and output features."""
        return shard.padded_shape

    def geometry_error(self, shard: Exl3Tensors, in_features: int, out_features: int, is_lm_head: bool) -> str | None:
        """Stored sizes must be the logical ones rounded up to 128; a head's stored rows may exceed its vocabulary
        by less than one block (exllamav3 pads the vocabulary, vLLM pads it to a multiple of 64)."""
        return padding_error(
            shard.padded_shape, in_features, out_features, is_lm_head, "stores a {k}x{n} (in x out) EXL3 matrix"
        )

    def cut(self, shard: Exl3Tensors, cut: TpCut) -> Exl3Tensors:
        """The whole 128-feature blocks of the rank's spans (:func:`quantpack_core.codec.cut_tensors`)."""
        return cut_tensors(shard, cut)

    def spec(
        self, shard: Exl3Tensors, platform: Platform, in_f: int, out_f: int, dtype: torch.dtype, tp: str
    ) -> LinearSpec:
        """K, codebook and stored shape of the rank's shard, for the kernel choice."""
        k, n = shard.padded_shape
        return LinearSpec(platform, self.name, shard.k_bits, shard.codebook.value, k, n, in_f, out_f, dtype, tp)

    def release(self, shard: Exl3Tensors) -> None:
        """Nothing to drop: an EXL3 shard holds only the captured tensors (or their cut), which the machinery
        releases with its placeholders."""

    # ------------------------------------------------------------------------------------------------ experts

    def build_bank(
        self,
        layer: str,
        experts: Mapping[tuple[int, str], Exl3Tensors],
        device: torch.device,
        tp_size: int,
        tp_rank: int,
    ) -> Exl3MoeBank:
        """The rank's bank (:func:`quantpack_core.moe.bank_from_tensors`: planned from the K each expert holds).

        Raises:
            CodecError: experts in several codebooks. GeometryError: w1 / w3 of an expert at different K.
        """
        return bank_from_tensors(layer, experts, device, tp_size, tp_rank)

    def expert_spec(
        self, bank: Exl3MoeBank, platform: Platform, dtype: torch.dtype, tp: str, layer_experts: int
    ) -> ExpertSpec:
        """Codebook, K groups and stored sizes of the bank (of a layer of ``layer_experts`` routed experts), for the
        kernel choice."""
        plan = bank.plan
        groups = tuple((float(g.k_gu), float(g.k_d)) for g in plan.groups)
        return ExpertSpec(
            platform,
            self.name,
            plan.codebook.value,
            groups,
            plan.num_experts,
            layer_experts,
            plan.hidden,
            plan.inter_local,
            dtype,
            tp,
            gated=plan.gated,
        )

    def bank_intermediate(self, bank: Exl3MoeBank, logical: int) -> int:
        """The rank's logical intermediate channels: its stored ones, less the padding past the layer's end."""
        plan = bank.plan
        return min(plan.inter_local, max(0, logical - plan.inter_start))

    # ------------------------------------------------------------------------------------------- the pack check

    def codebook_of(self, tensors: Mapping[str, TensorInfo]) -> Codebook | None:
        return check.codebook_of(tensors)

    def remains(self, tensors: Mapping[str, TensorInfo]) -> bool:
        return check.remains(tensors)

    def module_problems(self, pack: PackView, m: ModuleInfo, settings: CheckSettings) -> list[Problem]:
        return check.module_problems(pack, m, settings)

    def manifest_problems(self, pack: PackView, module: str, entry: dict) -> list[Problem]:
        return check.manifest_problems(pack, module, entry)

    def pack_problems(self, pack: PackView, settings: CheckSettings) -> list[Problem]:
        return check.codebook_mixture_problems(pack)

    def value_problems(self, pack: PackView) -> list[Problem]:
        return check.padding_problems(pack)


#: the one instance the methods, the kernels and the pack check use
EXL3 = Exl3Format()
