"""Placeholder parameters that capture whole checkpoint tensors per shard (linear layers) or per expert (MoE layers).

vLLM wants a Parameter of known shape per weight name, but a quantized shard's shape (and K) is only known once the
file is read, and differs between the shards of a fused layer and between experts. So each placeholder stays empty
and carries its own ``weight_loader``, which keeps the whole tensor it is handed, keyed by shard slot or by
``(expert, projection)``; vLLM never narrows or copies it, and every rank keeps its part later. Follows vLLM's
``BasevLLMParameter`` (``vllm/model_executor/parameter.py``; the placeholder-with-own-loader pattern is
vllm-gguf-plugin's per-shard parameters) and ``RoutedExperts.weight_loader`` (the expert loader's signature).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from vllm.model_executor.parameter import BasevLLMParameter

from quantpack_core.errors import LayerLoadError
from quantpack_core.moe import PROJ_DOWN, PROJ_GATE, PROJ_MODULES, PROJ_UP, PROJECTIONS
from quantpack_core.names import shard_slot

from .mapped import drop_file_pages

#: vLLM's expert shard id -> the stacked parameter family it belongs to
STACK = {PROJ_GATE: "w13", PROJ_UP: "w13", PROJ_DOWN: "w2"}


class ShardParam(BasevLLMParameter):
    """Empty placeholder for one checkpoint suffix of a layer; the real tensors land in :attr:`shards`.

    vLLM's generic loaders call ``param.weight_loader(param, tensor[, shard_id])``; its ``weight_loader_v2`` path
    calls the ``load_*_weight`` hooks, routed here to the same capture.

    Attributes:
        suffix: checkpoint suffix (``trellis``, ``suh``, ``weight`` ...).
        layer_name: the vLLM module, for messages.
        shards: slot -> captured tensor (a view of the safetensors memory map until the layer is processed).
        shard_ids: slot -> the loader's shard id (``None``, ``"q"``, ``1``, ``(0, 1, 2)``).
    """

    def __new__(cls, suffix: str, dtype: torch.dtype, layer_name: str):
        return super().__new__(cls, data=torch.empty(0, dtype=dtype))

    def __init__(self, suffix: str, dtype: torch.dtype, layer_name: str):
        super().__init__(data=torch.empty(0, dtype=dtype), weight_loader=self._capture)
        self.suffix = suffix
        self.layer_name = layer_name
        self.shards: dict[int, torch.Tensor] = {}
        self.shard_ids: dict[int, Hashable | None] = {}

    def _capture(
        self, param: torch.nn.Parameter, loaded_weight: torch.Tensor, shard_id: Hashable | None = None, **_: object
    ) -> None:
        slot = shard_slot(shard_id)
        if slot in self.shards:
            raise LayerLoadError(
                f"{self.layer_name}: .{self.suffix} of shard {shard_id!r} arrived twice; the "
                "checkpoint stores it twice or two names map to it - fix the pack's tensor names"
            )
        self.shards[slot] = loaded_weight
        self.shard_ids[slot] = shard_id

    def release(self) -> None:
        """Drop every captured tensor, and its pages of a memory-mapped checkpoint file from the process
        (:func:`.mapped.drop_file_pages`)."""
        drop_file_pages(list(self.shards.values()))
        self.shards.clear()
        self.shard_ids.clear()

    def load_column_parallel_weight(self, loaded_weight: torch.Tensor, **kw: object) -> None:
        self._capture(self, loaded_weight, kw.get("shard_id"))

    load_row_parallel_weight = load_column_parallel_weight
    load_merged_column_weight = load_column_parallel_weight
    load_qkv_weight = load_column_parallel_weight


class ExpertParam(torch.nn.Parameter):
    """Empty placeholder for one checkpoint suffix of one stacked family (``w13`` or ``w2``) of an MoE layer.

    Its ``weight_loader`` (vLLM calls ``param.weight_loader(param, loaded_weight, weight_name, shard_id, expert_id,
    return_success)``, positionally or by keyword) keeps each expert's whole tensor in :attr:`captured`, keyed by
    ``(expert_id, shard_id)``; nothing is narrowed or copied.

    Attributes:
        suffix: checkpoint suffix (``trellis``, ``suh`` ...).
        family: ``"w13"`` or ``"w2"``.
        layer_name: the vLLM module, for messages.
        num_experts: experts of the layer (ids outside ``[0, num_experts)`` are refused).
        captured: ``(global expert id, "w1" | "w3" | "w2") -> tensor`` (views of the checkpoint until processed).
    """

    def __new__(cls, suffix: str, dtype: torch.dtype, family: str, layer_name: str, num_experts: int):
        return super().__new__(cls, torch.empty(0, dtype=dtype), requires_grad=False)

    def __init__(self, suffix: str, dtype: torch.dtype, family: str, layer_name: str, num_experts: int):
        self.suffix = suffix
        self.family = family
        self.layer_name = layer_name
        self.num_experts = num_experts
        self.captured: dict[tuple[int, str], torch.Tensor] = {}
        self.weight_loader = self._capture

    def _capture(
        self,
        param: torch.nn.Parameter | None = None,
        loaded_weight: torch.Tensor | None = None,
        weight_name: str = "",
        shard_id: str | None = None,
        expert_id: int | None = None,
        return_success: bool = False,
        **_: object,
    ) -> bool | None:
        if loaded_weight is None or shard_id not in PROJECTIONS or expert_id is None:
            raise LayerLoadError(
                f"{self.layer_name}: .{self.suffix} {weight_name!r} arrived without an expert id and a w1/w3/w2 "
                f"shard id (got expert {expert_id!r}, shard {shard_id!r}); quantized packs store experts one by one "
                "(experts.{e}.gate_proj.trellis ...) - this checkpoint's expert names are not in that layout"
            )
        if STACK[shard_id] != self.family:
            raise LayerLoadError(
                f"{self.layer_name}: {shard_id} ({PROJ_MODULES[shard_id]}) tensor routed to {self.family}_"
                f"{self.suffix}; the model's expert mapping does not match the checkpoint"
            )
        if not 0 <= int(expert_id) < self.num_experts:
            raise LayerLoadError(
                f"{self.layer_name}: checkpoint tensor {weight_name or PROJ_MODULES[shard_id] + '.' + self.suffix!r} "
                f"names expert {expert_id}, but the layer has {self.num_experts} experts (config.json's expert count) "
                "- use the config the pack was made with"
            )
        key = (int(expert_id), shard_id)
        if key in self.captured:
            raise LayerLoadError(
                f"{self.layer_name}: expert {expert_id} {PROJ_MODULES[shard_id]}.{self.suffix} arrived twice; the "
                "checkpoint stores it twice or two names map to it - fix the pack's tensor names"
            )
        self.captured[key] = loaded_weight
        return True if return_success else None

    def release(self) -> None:
        """Drop every captured tensor, and its pages of a memory-mapped checkpoint file from the process
        (:func:`.mapped.drop_file_pages`)."""
        drop_file_pages(list(self.captured.values()))
        self.captured.clear()


# vLLM checks this mark on expert weight loaders (llama4.py) before passing expert ids.
ExpertParam._capture.supports_moe_loading = True  # type: ignore[attr-defined]
