"""Module names: checkpoint <-> vLLM prefixes, fused-layer constituents and shard ids.

A pack names modules as its HF checkpoint does (``model.language_model.layers.3.mlp.up_proj``); vLLM builds them
under its own tree (``language_model.model.layers.3.mlp.gate_up_proj``) and fuses some of them. This module gives one
canonical key for both sides and the rules that map a fused vLLM layer to the checkpoint tensors behind it.

Follows vLLM's ``packed_modules_mapping`` of the Llama, Qwen3-Next and Qwen3.5 model files and the shard ids their
weight loaders pass (``"q"/"k"/"v"``, ints, and tuples such as Qwen3.5's ``in_proj_qkv`` -> ``(0, 1, 2)``, from
``Qwen3_5Model.hf_to_vllm_mapper`` in ``vllm/model_executor/models/qwen3_5.py``).
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Iterable

#: Leading path components that wrap the text model differently in checkpoints and in vLLM
#: (``model.``, ``model.language_model.``, ``language_model.model.``, Nemotron's ``backbone.``).
WRAPPER_COMPONENTS = frozenset({"model", "language_model", "backbone"})

#: vLLM fused layer -> the checkpoint modules it can be loaded from, one alternative per list, in shard order.
FUSED_LAYERS: dict[str, tuple[tuple[str, ...], ...]] = {
    "qkv_proj": (("q_proj", "k_proj", "v_proj"),),
    "gate_up_proj": (("gate_proj", "up_proj"),),
    # Qwen3-Next stores one interleaved in_proj_qkvz; Qwen3.5 stores in_proj_qkv and in_proj_z.
    "in_proj_qkvz": (("in_proj_qkvz",), ("in_proj_qkv", "in_proj_z")),
    "in_proj_ba": (("in_proj_ba",), ("in_proj_b", "in_proj_a")),
    # the Qwen3-VL vision tower's attention: exllamav3 splits it into q_proj / k_proj / v_proj; dense checkpoints keep
    # the fused qkv (and exllamav3's converter's packs hold both: the split parts are served, docs/families.md)
    "qkv": (("q_proj", "k_proj", "v_proj"), ("qkv",)),
}

#: QKVParallelLinear's string shard ids, in output order.
QKV_SHARDS = ("q", "k", "v")


def normalize_prefix(name: str) -> str:
    """Canonical key of a module name, equal for the checkpoint's and vLLM's spelling of the same module.

    Leading wrapper components (``model``, ``language_model``, ``backbone``) are dropped, so
    ``model.language_model.layers.3.mlp`` (Qwen3.5 checkpoint), ``language_model.model.layers.3.mlp`` (vLLM) and
    ``model.layers.3.mlp`` (Llama) all give ``layers.3.mlp``; ``lm_head`` and ``language_model.lm_head`` give
    ``lm_head``; ``model.visual.blocks.0`` and ``visual.blocks.0`` give ``visual.blocks.0``.

    Args:
        name: dotted module name (no tensor suffix).

    Returns:
        the canonical dotted name.
    """
    parts = [p for p in name.split(".") if p]
    while len(parts) > 1 and parts[0] in WRAPPER_COMPONENTS:
        parts.pop(0)
    return ".".join(parts)


def split_tensor_name(name: str) -> tuple[str, str]:
    """``"a.b.trellis"`` -> ``("a.b", "trellis")``; a name without a dot is a module-less tensor (``("", name)``)."""
    module, _, suffix = name.rpartition(".")
    return module, suffix


def expand_fused(prefix: str) -> list[list[str]]:
    """The checkpoint modules that can stand behind a vLLM layer, one list per alternative layout.

    Args:
        prefix: vLLM module name, e.g. ``language_model.model.layers.0.linear_attn.in_proj_qkvz``.

    Returns:
        A list of alternatives, each a list of module names in shard order, keeping ``prefix``'s leading path:
        ``...qkv_proj`` -> ``[[...q_proj, ...k_proj, ...v_proj]]``; ``...in_proj_qkvz`` ->
        ``[[...in_proj_qkvz], [...in_proj_qkv, ...in_proj_z]]``; an unfused name -> ``[[prefix]]``.
    """
    head, _, last = prefix.rpartition(".")
    alternatives = FUSED_LAYERS.get(last)
    if alternatives is None:
        return [[prefix]]
    join = (lambda x: f"{head}.{x}") if head else (lambda x: x)
    return [[join(part) for part in alt] for alt in alternatives]


def constituents(prefix: str) -> list[str]:
    """Every checkpoint module name that may back the vLLM layer ``prefix`` (all alternatives, flattened, no
    duplicates, in order)."""
    seen: dict[str, None] = {}
    for alt in expand_fused(prefix):
        for name in alt:
            seen.setdefault(name, None)
    return list(seen)


def shard_slot(shard_id: Hashable | None) -> int:
    """Slot of a loader shard id: the position of the shard's first output partition.

    Sorting slots gives vLLM's output concatenation order. ``None`` (unfused, or fused on disk) -> 0;
    ``"q"/"k"/"v"`` -> 0/1/2; an int -> itself; a tuple of consecutive partitions such as ``(0, 1, 2)`` -> its first.

    Raises:
        ValueError: for any other shard id.
    """
    if shard_id is None:
        return 0
    if isinstance(shard_id, str):
        if shard_id in QKV_SHARDS:
            return QKV_SHARDS.index(shard_id)
        raise ValueError(f"unknown shard id {shard_id!r}: expected one of {QKV_SHARDS}, an int or a tuple of ints")
    if isinstance(shard_id, bool):
        raise ValueError(f"unknown shard id {shard_id!r}")
    if isinstance(shard_id, int):
        return shard_id
    if isinstance(shard_id, tuple) and shard_id and all(isinstance(i, int) for i in shard_id):
        return shard_id[0]
    raise ValueError(f"unknown shard id {shard_id!r}: expected 'q'/'k'/'v', an int or a tuple of ints")


def shard_partitions(shard_id: Hashable | None, num_partitions: int) -> tuple[int, ...]:
    """Which logical output partitions of a fused layer one loaded tensor covers.

    Args:
        shard_id: the id vLLM's loader passes (see :func:`shard_slot`).
        num_partitions: how many output partitions the vLLM layer has (``len(output_partition_sizes)``).

    Returns:
        Partition indices, e.g. ``"k"`` -> ``(1,)``, ``(0, 1, 2)`` -> ``(0, 1, 2)``, ``None`` -> all.

    Raises:
        ValueError: for an unknown shard id or one outside the layer's partitions.
    """
    if shard_id is None:
        parts: tuple[int, ...] = tuple(range(num_partitions))
    elif isinstance(shard_id, tuple):
        shard_slot(shard_id)
        parts = tuple(shard_id)
    else:
        parts = (shard_slot(shard_id),)
    if any(p < 0 or p >= num_partitions for p in parts):
        raise ValueError(f"shard id {shard_id!r} is outside the layer's {num_partitions} output partitions")
    return parts


def canonical_set(names: Iterable[str]) -> frozenset[str]:
    """:func:`normalize_prefix` of every name."""
    return frozenset(normalize_prefix(n) for n in names)


#: one expert's projection of an MoE bank in a checkpoint: ``<layer>.experts.<e>.<proj>``
EXPERT_MODULE = re.compile(r"^(?P<layer>.+\.experts)\.(?P<e>\d{1,9})\.(?P<proj>[A-Za-z0-9_]+)$")
