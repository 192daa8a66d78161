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

Plain typing; no vLLM import. The EXL3 implementation is ``quantpack_exl3.format``; docs/kernels.md says what a new
format adds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

import torch

from .kernels import ExpertSpec, LinearSpec, Platform
from .tp import TpCut


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

    def expert_spec(self, bank: Any, platform: Platform, dtype: torch.dtype, tp: str) -> ExpertSpec:
        """The :class:`ExpertSpec` kernels are chosen by for one bank."""

    def bank_intermediate(self, bank: Any, logical: int) -> int:
        """The rank's logical intermediate channels of a bank planned from a layer of ``logical`` channels."""
