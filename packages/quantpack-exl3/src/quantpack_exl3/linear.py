"""The EXL3 linear method for vLLM's linear layers and ``ParallelLMHead``.

An EXL3 pack stores every projection self-contained (trellis, suh, svh, codebook marker, own K), so the shards of a
fused vLLM layer (q/k/v in ``qkv_proj``, gate/up in ``gate_up_proj``, Qwen3.5's ``in_proj_qkv`` + ``in_proj_z`` in
``in_proj_qkvz``) cannot be concatenated into one quantized matrix. And nothing about a shard's shape or K is known
before its tensors arrive. Hence:

* ``create_weights`` registers empty placeholder parameters under the checkpoint's suffixes; each carries its own
  loader that captures whole checkpoint tensors per shard id (str, int or tuple), so vLLM never narrows a trellis;
* ``process_weights_after_loading`` checks what arrived against the layer (every shard present, one kind per layer,
  sound tensors, stored sizes = logical sizes rounded up to 128), lets the backend build its form, and drops the
  captured host tensors;
* ``apply`` runs one registered custom op per shard.

Follows vLLM's ``LinearMethodBase`` / ``BasevLLMParameter`` (``vllm/model_executor/layers/linear.py``,
``vllm/model_executor/parameter.py``; the placeholder-plus-own-loader pattern is vllm-gguf-plugin's per-shard
parameters) and exllamav3's ``LinearEXL3`` (padding: inputs zero-extended to the stored width, outputs trimmed).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
from vllm.model_executor.layers.linear import LinearMethodBase
from vllm.model_executor.parameter import BasevLLMParameter

from quantpack_core.codec import Exl3Tensors
from quantpack_core.errors import CodecError, GeometryError, QuantpackError
from quantpack_core.hadamard import HAD_BLOCK
from quantpack_core.names import expand_fused, shard_partitions, shard_slot
from quantpack_core.tp import (
    COLUMN,
    ROW,
    TpCut,
    cut_dense,
    cut_tensors,
    make_cut,
    partition_ranges,
    plan_cut,
    sliced_tp_sizes,
)

logger = logging.getLogger("vllm.quantpack.exl3")

#: checkpoint suffix -> dtype of its placeholder (and of what the pack stores)
PLACEHOLDERS: dict[str, torch.dtype | None] = {
    "trellis": torch.int16,
    "suh": torch.float16,
    "svh": torch.float16,
    "su": torch.int16,  # legacy packed signs
    "sv": torch.int16,
    "mcg": torch.int32,
    "mul1": torch.int32,
    "weight": None,  # a dense shard: the model dtype
}
EXL3_PARTS = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1")


class LayerLoadError(QuantpackError):
    """A layer's loaded tensors do not fit it; raised while loading, before any forward pass."""


class UnsupportedLayerError(QuantpackError):
    """A layer kind this version of quantpack-exl3 cannot serve; raised when vLLM builds the layer."""


class Exl3ShardParam(BasevLLMParameter):
    """Empty placeholder for one checkpoint suffix of a layer; the real tensors land in :attr:`shards`.

    vLLM wants a Parameter of known shape per weight name, but EXL3 shard shapes (and K) are only known once the file
    is read and differ between the shards of a fused layer. So this Parameter stays empty and carries its own
    ``weight_loader``, which keeps each whole checkpoint tensor keyed by shard slot; vLLM's generic loaders call
    ``param.weight_loader(param, tensor[, shard_id])``.

    Attributes:
        suffix: checkpoint suffix (``trellis``, ``suh`` ...).
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

    # vLLM's weight_loader_v2 path calls these hooks; route them to the same capture.
    def load_column_parallel_weight(self, loaded_weight: torch.Tensor, **kw: object) -> None:
        self._capture(self, loaded_weight, kw.get("shard_id"))

    load_row_parallel_weight = load_column_parallel_weight
    load_merged_column_weight = load_column_parallel_weight
    load_qkv_weight = load_column_parallel_weight


@dataclass(frozen=True)
class ShardRun:
    """How ``apply`` runs one prepared shard.

    Attributes:
        fn: the op wrapper, ``fn(x, *params, *static, out, col)``.
        params: names of the layer parameters holding the shard's tensors.
        static: Python scalars of the op (codebook, K, widths).
        col: the shard's first output column.
    """

    fn: Callable[..., None]
    params: tuple[str, ...]
    static: tuple
    col: int


@dataclass(frozen=True)
class ShardPlan:
    """Where one loaded shard goes in the layer's output.

    Attributes:
        slot: sort key (vLLM's concatenation order).
        shard_id: the loader's id.
        partitions: the layer's output partitions it covers.
        in_features: logical input features.
        out_features: logical output features (sum of its partitions).
        label: human name for messages (checkpoint module when known).
    """

    slot: int
    shard_id: Hashable | None
    partitions: tuple[int, ...]
    in_features: int
    out_features: int
    label: str


def _padded(n: int) -> int:
    return (n + HAD_BLOCK - 1) // HAD_BLOCK * HAD_BLOCK


@dataclass(frozen=True)
class LinearTp:
    """How tensor parallelism splits one vLLM linear layer on this rank (read from the layer when vLLM builds it).

    Attributes:
        kind: ``"column"`` (output features split; the input is whole) or ``"row"`` (input features split; vLLM
            all-reduces the ranks' outputs).
        size, rank: tensor-parallel size and this rank.
        in_features: the layer's full logical input features (row: ``size`` times the rank's input).
        local_sizes: per output partition, the features this rank produces (vLLM's ``output_partition_sizes``).
        replicas: per output partition, how many consecutive ranks hold the same features (``QKVParallelLinear``'s
            ``num_kv_head_replicas`` for k and v, else 1).

    Source: vLLM ``ColumnParallelLinear`` / ``MergedColumnParallelLinear`` / ``QKVParallelLinear`` /
    ``RowParallelLinear`` / ``ParallelLMHead`` (the splits they apply to a dense weight in their loaders).
    """

    kind: str
    size: int
    rank: int
    in_features: int
    local_sizes: tuple[int, ...]
    replicas: tuple[int, ...]

    def cut(self, partitions: tuple[int, ...]) -> TpCut:
        """The cut of one checkpoint tensor that covers ``partitions`` of the layer's outputs (all of the input, for
        a row cut)."""
        if self.kind == ROW:
            return plan_cut(ROW, self.in_features, self.size, self.rank)
        ranges, features = partition_ranges(self.local_sizes, partitions, self.size, self.rank, self.replicas)
        return make_cut(COLUMN, ranges, features)


#: (layer kind, geometry) already reported, so a model with 64 identical layers logs each fallback once
_reported: set[tuple] = set()


class Exl3LinearMethod(LinearMethodBase):
    """Linear method for EXL3 layers (and dense layers a pack stores as ``.weight``), per shard.

    Args:
        backend: kernel backend class (see :mod:`quantpack_exl3.backends`).
        prefix: the vLLM module name, for messages.
        is_lm_head: the layer is ``ParallelLMHead`` (its vocabulary rows are padded by vLLM to a multiple of 64).
    """

    def __init__(self, backend, prefix: str = "", is_lm_head: bool = False):
        self.backend = backend
        self.prefix = prefix
        self.is_lm_head = is_lm_head

    # ------------------------------------------------------------------------------------------------ create

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: object,
    ) -> None:
        """Register the placeholders; see :class:`Exl3ShardParam`. ``extra_weight_attrs`` (vLLM's own narrowing
        weight_loader) is deliberately not applied: whole checkpoint tensors are captured on every rank and each
        rank keeps its part when the layer is processed (:class:`LinearTp`).

        Raises:
            GeometryError: a tensor-parallel ``ParallelLMHead`` whose vocabulary does not fill every rank's
                partition (vLLM pads it; an EXL3 head is cut to whole vocabulary rows only).
        """
        layer.exl3_tp = self._tp_layout(layer, input_size_per_partition, output_partition_sizes, input_size)
        for suffix, dtype in PLACEHOLDERS.items():
            layer.register_parameter(suffix, Exl3ShardParam(suffix, dtype or params_dtype, self.prefix))
        layer.exl3_in_features = input_size_per_partition
        layer.exl3_partitions = list(output_partition_sizes)
        layer.exl3_params_dtype = params_dtype
        layer.exl3_runs: list[ShardRun] = []
        layer.exl3_out_total = sum(output_partition_sizes)
        layer.exl3_out_width = sum(output_partition_sizes)
        layer.exl3_row_pad = None
        layer.exl3_col_select = None

    def _tp_layout(self, layer: torch.nn.Module, in_local: int, partitions: list[int], in_full: int) -> LinearTp | None:
        """This rank's split of the layer, or None when the layer is whole on every rank (TP 1, replicated layers,
        ``disable_tp``)."""
        size = int(getattr(layer, "tp_size", 1) or 1)
        if size == 1:
            return None
        rank = getattr(layer, "tp_rank", None)
        if rank is None:  # vLLM before 0.26 keeps no tp_rank on a VocabParallelEmbedding
            from vllm.distributed import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
        rank = int(rank)
        if self.is_lm_head:
            vocab = int(getattr(layer, "org_vocab_size", 0) or 0)
            si = getattr(layer, "shard_indices", None)
            if si is not None:  # the rank vLLM split the vocabulary for (its own record, on every version)
                rank = int(si.org_vocab_start_index) // partitions[0]
            if vocab != partitions[0] * size:
                raise GeometryError(
                    f"{self.prefix}: the vocabulary ({vocab} rows) does not fill the {size} tensor-parallel "
                    f"partitions of {partitions[0]} rows vLLM pads it to, so the last rank's partition is padded. "
                    "Rule: an EXL3 head is cut to whole vocabulary rows per rank and padded partitions are not "
                    f"supported -> serve this pack with --tensor-parallel-size 1, or re-quantize it with a "
                    f"vocabulary padded to a multiple of {64 * size} (of {HAD_BLOCK * size} for each rank's rows to "
                    "be whole Hadamard blocks, with no fallback)"
                )
            tp = LinearTp(COLUMN, size, rank, in_full, tuple(partitions), (1,))
            self._report_fallbacks(tp)
            return tp
        if in_local != in_full:
            tp = LinearTp(ROW, size, rank, in_full, tuple(partitions), (1,) * len(partitions))
        else:
            replicas = [1] * len(partitions)
            kv_replicas = int(getattr(layer, "num_kv_head_replicas", 1) or 1)
            if hasattr(layer, "total_num_kv_heads") and len(partitions) == 3:  # QKVParallelLinear: q, k, v
                replicas[1] = replicas[2] = kv_replicas
            tp = LinearTp(COLUMN, size, rank, in_full, tuple(partitions), tuple(replicas))
        self._report_fallbacks(tp)
        return tp

    def _report_fallbacks(self, tp: LinearTp) -> None:
        """Log, before any weight is loaded, the partitions whose rank share falls inside a 128-feature block (they
        will run the fallback on the blocks it touches) with the rule and the sizes that avoid it; once per layer
        kind."""
        if tp.kind == ROW:
            cuts = {"input": tp.cut(())}
            features = [tp.in_features]
        else:
            cuts = {f"output partition {j}": tp.cut((j,)) for j in range(len(tp.local_sizes))}
            features = [c.features for c in cuts.values()]
        off = [f"{name} ({c.width} of {c.features} features)" for name, c in cuts.items() if not c.sliced]
        key = (self.prefix.rsplit(".", 1)[-1], tp.kind, tp.size, tp.in_features, tp.local_sizes)
        if not off or key in _reported or tp.rank != 0:
            return
        _reported.add(key)
        ok = sliced_tp_sizes(features) or ["none"]
        logger.warning(
            "quantpack-exl3: %s (and layers like it) at tensor-parallel size %d: each rank's share of %s lies "
            "inside a %d-feature Hadamard block, so every rank keeps the whole blocks its share touches (up to one "
            "block more at each end) and %s (exact; costs that memory and compute). Sizes up to 16 that cut this "
            "layer alone on whole blocks: %s",
            self.prefix,
            tp.size,
            ", ".join(off),
            HAD_BLOCK,
            "zero-extends its input slice" if tp.kind == ROW else "selects its output columns",
            ", ".join(map(str, ok)),
        )

    # -------------------------------------------------------------------------------------------------- load

    def _plans(self, layer: torch.nn.Module, captured: dict[str, Exl3ShardParam], kind: str) -> list[ShardPlan]:
        main = captured["trellis" if kind == "exl3" else "weight"]
        parts = layer.exl3_partitions
        slots = sorted(main.shards)
        if kind == "exl3":
            for s in EXL3_PARTS:
                for slot, sid in captured[s].shard_ids.items():
                    if slot not in main.shards:
                        raise LayerLoadError(
                            f"{self.prefix}: shard {sid!r} has .{s} but no .trellis; the pack is incomplete - "
                            "re-download the file that should hold that trellis"
                        )
        labels = self._labels(len(slots))
        plans, covered = [], []
        for i, slot in enumerate(slots):
            sid = main.shard_ids[slot]
            try:
                p = shard_partitions(sid, len(parts))
            except ValueError as e:
                raise LayerLoadError(f"{self.prefix}: {e}") from None
            covered.extend(p)
            plans.append(ShardPlan(slot, sid, p, layer.exl3_in_features, sum(parts[j] for j in p), labels[i]))
        if sorted(covered) != list(range(len(parts))):
            missing = sorted(set(range(len(parts))) - set(covered))
            dup = sorted({c for c in covered if covered.count(c) > 1})
            what = (
                f"output partitions {missing} received no tensor"
                if missing
                else f"output partitions {dup} received two tensors"
            )
            raise LayerLoadError(
                f"{self.prefix}: {what} (got {kind} shards {[pl.shard_id for pl in plans]}); the pack lacks a "
                f"module behind this fused layer (expected one of {expand_fused(self.prefix)}) - re-download it"
            )
        return plans

    def _labels(self, count: int) -> list[str]:
        """Checkpoint module names of ``count`` shards, in shard order, when the fused layout is known."""
        for alt in expand_fused(self.prefix):
            if len(alt) == count:
                return alt
        return [self.prefix] * count

    @staticmethod
    def _shard_name(plan: ShardPlan) -> str:
        return plan.label if plan.shard_id is None else f"shard {plan.shard_id!r} ({plan.label})"

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Validate the captured tensors, build the backend's per-shard weights, release the host copies.

        Raises:
            LayerLoadError: no tensor at all, trellis and dense shards mixed, a shard missing or doubled, a tensor
                of a shard missing (e.g. ``svh`` without ``trellis``), or an unsound EXL3 tensor.
            GeometryError: stored sizes that are not the layer's logical sizes rounded up to 128.
        """
        captured: dict[str, Exl3ShardParam] = {s: getattr(layer, s) for s in PLACEHOLDERS}
        has_exl3 = any(captured[s].shards for s in EXL3_PARTS)
        has_dense = bool(captured["weight"].shards)
        if has_exl3 and has_dense:
            raise LayerLoadError(
                f"{self.prefix}: the pack stores some shards of this layer as EXL3 trellis "
                f"({sorted(captured['trellis'].shard_ids.values(), key=str)}) and others as dense weights "
                f"({sorted(captured['weight'].shard_ids.values(), key=str)}); a fused layer must be all one kind - "
                "re-quantize the pack with the same setting for all of "
                f"{', '.join(n.rsplit('.', 1)[-1] for n in self._labels(len(layer.exl3_partitions)))}"
            )
        if not has_exl3 and not has_dense:
            if self.is_lm_head:
                # A speculative-decoding draft's head: vLLM replaces it with the target's after loading. Left
                # empty; apply() says so if it is ever used.
                for suffix in PLACEHOLDERS:
                    delattr(layer, suffix)
                layer.exl3_empty_head = True
                return
            raise LayerLoadError(
                f"{self.prefix}: no tensor of this layer was loaded (neither .trellis nor .weight); "
                "the pack lacks it - check that the pack matches config.json's architecture"
            )
        device = self._device(layer, captured)
        dtype = layer.exl3_params_dtype
        tp: LinearTp | None = layer.exl3_tp
        kernels, selects = [], []
        for plan in self._plans(layer, captured, "exl3" if has_exl3 else "dense"):
            cut = tp.cut(plan.partitions) if tp is not None else None
            in_f, out_f = self._full_sizes(plan, cut)
            select = None
            if has_exl3:
                t = self._shard_tensors(captured, plan)
                self._check_geometry(t, plan, in_f, out_f)
                if cut is not None:  # the blocks the rank's share touches (exactly its share when sliced)
                    t = cut_tensors(t, cut)
                    in_f, out_f = (cut.kept_features, out_f) if cut.kind == ROW else (in_f, cut.kept_features)
                    if not cut.sliced and cut.kind == ROW:  # fallback: input zero-extended to the kept span
                        layer.exl3_row_pad = cut.row_pad()
                    elif not cut.sliced:  # fallback: this rank's columns selected from the kept spans' product
                        select = cut.kept_positions()
                kernels.append(self.backend.prepare_shard(t, in_f, out_f, dtype, device))
            else:
                w = self._fit_dense(captured["weight"].shards[plan.slot], plan, in_f, out_f)
                if cut is not None:
                    w = cut_dense(w, cut)
                kernels.append(self.backend.prepare_dense(w, dtype, device))
            selects.append(select)
        for suffix, param in captured.items():
            param.shards.clear()
            param.shard_ids.clear()
            delattr(layer, suffix)
        col, columns = 0, []
        for i, (kernel, select) in enumerate(zip(kernels, selects, strict=True)):
            names = []
            for name, tensor in kernel.tensors.items():
                layer.register_parameter(f"exl3_{i}_{name}", torch.nn.Parameter(tensor, requires_grad=False))
                names.append(f"exl3_{i}_{name}")
            layer.exl3_runs.append(ShardRun(kernel.run, tuple(names), kernel.static, col))
            columns.extend(range(col, col + kernel.out_features) if select is None else [col + c for c in select])
            col += kernel.out_features
        layer.exl3_out_total = col
        layer.exl3_out_width = len(columns)
        if any(s is not None for s in selects):
            layer.exl3_col_select = torch.tensor(columns, dtype=torch.int64, device=device)

    @staticmethod
    def _full_sizes(plan: ShardPlan, cut: TpCut | None) -> tuple[int, int]:
        """The logical (in, out) features of the whole checkpoint tensor behind ``plan``."""
        if cut is None:
            return plan.in_features, plan.out_features
        if cut.kind == ROW:
            return cut.features, plan.out_features
        return plan.in_features, cut.features

    @staticmethod
    def _device(layer: torch.nn.Module, captured: dict[str, Exl3ShardParam]) -> torch.device:
        # The placeholders were created on the layer's target device; captured tensors may still be on the host.
        return captured["trellis"].device

    def _shard_tensors(self, captured: dict[str, Exl3ShardParam], plan: ShardPlan) -> Exl3Tensors:
        got = {s: captured[s].shards[plan.slot] for s in EXL3_PARTS if plan.slot in captured[s].shards}
        try:
            return Exl3Tensors.from_tensors(got)
        except CodecError as e:
            raise LayerLoadError(
                f"{self.prefix}: {self._shard_name(plan)}: {e}; the pack's "
                f"{plan.label} is incomplete or corrupt - re-download or re-quantize it"
            ) from None

    def _check_geometry(self, t: Exl3Tensors, plan: ShardPlan, in_f: int, out_f: int) -> None:
        k, n = t.padded_shape
        want_k = _padded(in_f)
        want_n = _padded(out_f)
        ok_n = n == want_n or (self.is_lm_head and n >= out_f and n - out_f < HAD_BLOCK)
        if k != want_k or not ok_n:
            raise GeometryError(
                f"{self.prefix}: {self._shard_name(plan)} stores a {k}x{n} (in x out) EXL3 matrix, "
                f"the model's layer needs {in_f}x{out_f} (stored as {want_k}x{want_n} after "
                "padding to 128): the pack does not match config.json - use the config the pack was made with"
            )

    def _fit_dense(self, w: torch.Tensor, plan: ShardPlan, in_f: int, out_f: int) -> torch.Tensor:
        if w.dim() != 2 or w.shape[1] != in_f or w.shape[0] > out_f or (w.shape[0] < out_f and not self.is_lm_head):
            raise GeometryError(
                f"{self.prefix}: dense {self._shard_name(plan)} has shape "
                f"{list(w.shape)}, the layer needs [{out_f}, {in_f}] "
                "(out x in) - the pack does not match config.json"
            )
        if w.shape[0] < out_f:  # a dense lm_head over the unpadded vocabulary
            w = torch.nn.functional.pad(w, (0, 0, 0, out_f - w.shape[0]))
        return w

    def tie_weights(self, layer: torch.nn.Module, embed_tokens: torch.nn.Module) -> torch.nn.Module:
        """A head tied to the embedding is the embedding module itself: its method's ``apply`` computes the logits
        (vLLM >= 0.24 calls this from ``ParallelLMHead.tie_weights``)."""
        return embed_tokens

    # ------------------------------------------------------------------------------------------------- apply

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x (..., in)`` -> ``(..., sum of output partitions)`` in ``x``'s dtype (this rank's input and output
        features under tensor parallelism): one registered custom op per shard, each writing its columns of one
        output; then, for fallbacks (shares off the blocks), this rank's columns are selected from the kept blocks'
        product (column parallel) or its input was zero-extended to the kept blocks first (row parallel); then
        ``bias``."""
        runs = layer.exl3_runs
        if not runs:
            if getattr(layer, "exl3_empty_head", False):
                raise LayerLoadError(
                    f"{self.prefix}: this head received no weights (a draft model's, meant to be "
                    "shared with its target) and was used before vLLM shared it"
                )
            raise LayerLoadError(f"{self.prefix}: forward before process_weights_after_loading built its weights")
        x2 = x.reshape(-1, x.shape[-1])
        if layer.exl3_row_pad is not None:  # a row-parallel fallback: this rank's input slice at its place
            x2 = torch.nn.functional.pad(x2, layer.exl3_row_pad)
        out = torch.empty((x2.shape[0], layer.exl3_out_total), dtype=x.dtype, device=x.device)
        for run in runs:
            run.fn(x2, *[getattr(layer, name) for name in run.params], *run.static, out, run.col)
        if layer.exl3_col_select is not None:  # a column-parallel fallback: this rank's columns
            out = out.index_select(1, layer.exl3_col_select)
        if bias is not None:
            out += bias
        return out.reshape(*x.shape[:-1], layer.exl3_out_width)
