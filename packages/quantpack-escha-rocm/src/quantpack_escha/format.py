"""The escha format, as the format-free machinery (:mod:`quantpack_core.vllm`) sees it.

An escha shard is ``escha_code`` (EXL3 trellis tiles, mcg codebook) with its four scale vectors
(:class:`~quantpack_escha.codec.EschaTensors`); its geometry rule and tensor-parallel cuts are those of EXL3: stored
sizes are the logical ones rounded up to whole 128-feature Hadamard blocks, and a rank keeps whole blocks (a row
cut: code rows, ``rin`` and ``s_in``; a column cut: each output partition's code columns, ``rout`` and ``s_out``).

Its rules of the pack check (registered under the ``quantpack.formats`` entry point) are
:mod:`quantpack_escha.check`'s.

Source: docs/escha-format.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from quantpack_core.check.settings import CheckSettings
from quantpack_core.codec import HAD_BLOCK
from quantpack_core.codec.codebook import Codebook
from quantpack_core.errors import Problem
from quantpack_core.format import PackRules
from quantpack_core.inventory import ModuleInfo, PackView, TensorInfo
from quantpack_core.kernels import LinearSpec, Platform
from quantpack_core.tp import TpCut, padding_error

from . import check
from .codec import CODE, CODEBOOK, CONFIG, IN_SCALES, OUT_SCALES, EschaTensors, cut_tensors


class EschaFormat(PackRules):
    """escha linear shards, and their rules of the pack check (implements :class:`quantpack_core.format.LinearFormat`
    and :class:`quantpack_core.format.PackFormat`)."""

    name: ClassVar[str] = "escha"
    label: ClassVar[str] = "escha"
    storage_label: ClassVar[str] = "escha code"
    writer: ClassVar[str] = "quantpack escha-from-exl3"
    suffixes: ClassVar[Mapping[str, torch.dtype]] = {
        CODE: torch.int16,
        **dict.fromkeys((*IN_SCALES, *OUT_SCALES), torch.float16),
        CONFIG: torch.int32,  # geometry record of the writer; informational
    }
    main_suffix: ClassVar[str] = CODE
    block: ClassVar[int] = HAD_BLOCK
    #: escha's runtimes cut whole 128-feature blocks per rank; a share off the blocks is refused at load
    tp_fallback: ClassVar[bool] = False

    def parse(self, tensors: Mapping[str, torch.Tensor]) -> EschaTensors:
        """The shard's :class:`~quantpack_escha.codec.EschaTensors`.

        Raises:
            CodecError: a missing tensor, a code of an illegal width, or scales that do not fit it.
        """
        return EschaTensors.from_tensors(dict(tensors))

    def stored_shape(self, shard: EschaTensors) -> tuple[int, int]:
        """``(k, n)``: stored input and output features."""
        return shard.stored_shape

    def geometry_error(self, shard: EschaTensors, in_features: int, out_features: int, is_lm_head: bool) -> str | None:
        """Stored sizes must be the logical ones rounded up to 128 (a head's rows may exceed its vocabulary by less
        than one block)."""
        return padding_error(
            shard.stored_shape, in_features, out_features, is_lm_head, "codes a {k}x{n} (in x out) matrix"
        )

    def cut(self, shard: EschaTensors, cut: TpCut) -> EschaTensors:
        """The whole 128-feature blocks of the rank's spans (:func:`quantpack_escha.codec.cut_tensors`)."""
        return cut_tensors(shard, cut)

    def spec(
        self, shard: EschaTensors, platform: Platform, in_f: int, out_f: int, dtype: torch.dtype, tp: str
    ) -> LinearSpec:
        """K, codebook (always mcg) and stored shape of the rank's shard, for the kernel choice."""
        k, n = shard.stored_shape
        return LinearSpec(platform, self.name, float(shard.k_bits), CODEBOOK.value, k, n, in_f, out_f, dtype, tp)

    def release(self, shard: EschaTensors) -> None:
        """Nothing to drop beyond the captured tensors."""

    # ------------------------------------------------------------------------------------------- the pack check

    def codebook_of(self, tensors: Mapping[str, TensorInfo]) -> Codebook:
        return CODEBOOK

    def module_problems(self, pack: PackView, m: ModuleInfo, settings: CheckSettings) -> list[Problem]:
        return check.module_problems(pack, m, settings)

    def config_problems(self, pack: PackView) -> list[Problem]:
        return check.layer_meta_problems(pack)

    def unproven_sizes(self, pack: PackView) -> list[str]:
        return check.unproven_sizes(pack)


#: the one instance the methods, the kernels and the pack check use
ESCHA = EschaFormat()
