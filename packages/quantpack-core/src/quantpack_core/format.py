"""The format protocol: what a quantized format tells the shared, format-free layer machinery
(:mod:`quantpack_core.vllm`) so that the machinery can capture, check, cut and hand its shards to kernels.

A format is a small object with:

* its name (the ``quant_method`` / the :class:`~quantpack_core.kernels.LinearSpec` ``format``) and its checkpoint
  suffixes with their dtypes (one placeholder parameter each, plus ``weight`` for dense shards);
* :meth:`LinearFormat.parse`: one shard's captured ``{suffix: tensor}`` -> the format's parsed shard (raising
  :class:`~quantpack_core.errors.CodecError` for an unsound one);
* its geometry rule (:meth:`LinearFormat.geometry_error`: stored vs logical sizes) and its tensor-parallel cut
  (:meth:`LinearFormat.cut`, exact on whole blocks of :attr:`LinearFormat.block` features);
* :meth:`LinearFormat.spec`: the K / codebook / stored shape a kernel is chosen by;
* for MoE layers (:class:`ExpertFormat`): how to build a rank's bank from its experts' parsed tensors and describe
  it to kernels.

Host copies: what :meth:`LinearFormat.parse` returns may hold views of the checkpoint (safetensors memory maps); the
machinery drops every captured tensor and placeholder once the kernels have built their forms, so a format keeps
no host state of its own (:meth:`LinearFormat.release` is where one that did would drop it).

The pack side (:class:`PackFormat`): how the pack reader (:class:`~quantpack_core.pack.Pack`) tells a module stored
in the format (its main tensor, its codebook) and the format's rules of the pack check (:mod:`quantpack_core.check`):
one module's tensors, the format's settings in the quantization config, its manifest entries, its modules together
and their values. An installed plugin registers its format object under the entry point group :data:`PACK_FORMATS`;
:func:`pack_formats` finds them, so that quantpack-core names no format.

Plain typing; no vLLM import. The EXL3 implementation is ``quantpack_exl3.format``; docs/kernels.md says what a new
format adds.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from .kernels import ExpertSpec, LinearSpec, Platform
from .tp import TpCut

if TYPE_CHECKING:
    from .check.settings import CheckSettings
    from .codec.codebook import Codebook
    from .errors import Problem
    from .inventory import ModuleInfo, PackView, TensorInfo

#: the entry point group under which a plugin registers its format's :class:`PackFormat` (``exl3 =
#: "quantpack_exl3.format:EXL3"``), named as the format is
PACK_FORMATS = "quantpack.formats"


class LinearFormat(Protocol):
    """A quantized format's linear shards (see the module docstring)."""

    #: the format's name, e.g. ``"exl3"``
    name: ClassVar[str]
    #: how messages name it, e.g. ``"EXL3"``
    label: ClassVar[str]
    #: checkpoint suffix -> dtype of its placeholder (what the pack stores), for every quantized tensor of a shard
    suffixes: ClassVar[Mapping[str, torch.dtype]]
    #: the suffix every quantized shard has (its presence makes a shard quantized), e.g. ``"trellis"``
    main_suffix: ClassVar[str]
    #: features per block a tensor-parallel cut must keep whole (the Hadamard block), e.g. 128
    block: ClassVar[int]
    #: whether a tensor-parallel share that is not whole blocks is served by the exact fallback (the share's blocks
    #: kept, its features selected or zero-extended: docs/architecture.md) or refused at load (GeometryError)
    tp_fallback: ClassVar[bool]

    def parse(self, tensors: Mapping[str, torch.Tensor]) -> Any:
        """One shard's captured tensors -> the format's shard object.

        Raises:
            CodecError: a tensor missing, of the wrong dtype or shape, or unsound.
        """

    def stored_shape(self, shard: Any) -> tuple[int, int]:
        """The shard's stored ``(in, out)`` features (padded)."""

    def geometry_error(self, shard: Any, in_features: int, out_features: int, is_lm_head: bool) -> str | None:
        """Why the stored shard cannot be the layer's ``in_features x out_features`` part, or None."""

    def cut(self, shard: Any, cut: TpCut) -> Any:
        """The rank's part: the whole blocks of ``cut.spans`` (exactly its share when ``cut.sliced``)."""

    def spec(self, shard: Any, platform: Platform, in_f: int, out_f: int, dtype: torch.dtype, tp: str) -> LinearSpec:
        """The :class:`LinearSpec` kernels are chosen by for the rank's shard of logical size ``in_f x out_f``."""

    def release(self, shard: Any) -> None:
        """Drop any host copy the parsed shard holds beyond the captured tensors (called after its kernel built its
        form)."""


class ExpertFormat(LinearFormat, Protocol):
    """A quantized format's MoE expert banks."""

    def build_bank(
        self, layer: str, experts: Mapping[tuple[int, str], Any], device: torch.device, tp_size: int, tp_rank: int
    ) -> Any:
        """Plan and fill one rank's bank from its experts' parsed tensors ``(expert, "w1" | "w3" | "w2") -> shard``.

        Raises:
            CodecError, GeometryError: experts the bank cannot hold together (named with layer, expert and rule).
        """

    def expert_spec(self, bank: Any, platform: Platform, dtype: torch.dtype, tp: str, layer_experts: int) -> ExpertSpec:
        """The :class:`ExpertSpec` kernels are chosen by for one bank of a layer of ``layer_experts`` routed
        experts."""

    def bank_intermediate(self, bank: Any, logical: int) -> int:
        """The rank's logical intermediate channels of a bank planned from a layer of ``logical`` channels."""


class PackFormat(Protocol):
    """A quantized format as the pack reader and the pack check see it (see the module docstring): a module is
    stored in the format where it holds the format's :attr:`LinearFormat.main_suffix` as a 3-D code; its tensors
    are :attr:`LinearFormat.suffixes` (with a ``bias``; a dense ``weight`` beside the code is the format's rules' to
    name). :class:`PackRules` gives every rule as none, for a format to override what it checks."""

    name: ClassVar[str]
    label: ClassVar[str]
    suffixes: ClassVar[Mapping[str, torch.dtype]]
    main_suffix: ClassVar[str]
    block: ClassVar[int]
    tp_fallback: ClassVar[bool]
    #: how messages name a module stored in the format, e.g. ``"an EXL3 trellis"``
    storage_label: ClassVar[str]
    #: what writes packs of the format, e.g. ``"exllamav3's converter"``
    writer: ClassVar[str]

    def codebook_of(self, tensors: Mapping[str, TensorInfo]) -> Codebook | None:
        """The codebook a coded module's tensors say (None where they contradict each other)."""

    def remains(self, tensors: Mapping[str, TensorInfo]) -> bool:
        """Whether a module holding no 3-D main tensor is what is left of one stored in the format (its other
        tensors without the code, nor a dense weight): the reader then names it a module of the format."""

    def module_problems(self, pack: PackView, m: ModuleInfo, settings: CheckSettings) -> list[Problem]:
        """One module stored in the format: its tensors' layout (and, with ``settings.values``, their values)."""

    def config_problems(self, pack: PackView) -> list[Problem]:
        """The format's own settings of the quantization config against the pack's modules."""

    def manifest_problems(self, pack: PackView, module: str, entry: dict) -> list[Problem]:
        """One manifest entry (``tensor_storage[module]``) of a module stored in the format, against its tensors."""

    def pack_problems(self, pack: PackView, settings: CheckSettings) -> list[Problem]:
        """The format's modules together (one codebook per pack, ...)."""

    def value_problems(self, pack: PackView) -> list[Problem]:
        """The format's modules' values held against config.json's sizes (run with ``settings.values`` only)."""

    def unproven_sizes(self, pack: PackView) -> list[str]:
        """config.json's sizes of the format's modules that no tensor proves (``quantpack inspect``'s note)."""


class PackRules:
    """Every rule of :class:`PackFormat` as none: a format subclasses it and overrides the rules it has."""

    def remains(self, tensors: Mapping[str, TensorInfo]) -> bool:
        return False

    def module_problems(self, pack: PackView, m: ModuleInfo, settings: CheckSettings) -> list[Problem]:
        return []

    def config_problems(self, pack: PackView) -> list[Problem]:
        return []

    def manifest_problems(self, pack: PackView, module: str, entry: dict) -> list[Problem]:
        return []

    def pack_problems(self, pack: PackView, settings: CheckSettings) -> list[Problem]:
        return []

    def value_problems(self, pack: PackView) -> list[Problem]:
        return []

    def unproven_sizes(self, pack: PackView) -> list[str]:
        return []


@functools.cache
def pack_formats() -> Mapping[str, PackFormat]:
    """The formats the installed plugins register (:data:`PACK_FORMATS`), by name, in the order of their names.

    Raises:
        TypeError: an entry point whose object is named otherwise than the entry point.
    """
    from importlib.metadata import entry_points

    found: dict[str, PackFormat] = {}
    for ep in entry_points(group=PACK_FORMATS):
        fmt = ep.load()
        if getattr(fmt, "name", None) != ep.name:
            raise TypeError(f"entry point {ep.name} = {ep.value} ({PACK_FORMATS}) is no format named {ep.name!r}")
        found[ep.name] = fmt
    return MappingProxyType(dict(sorted(found.items())))
