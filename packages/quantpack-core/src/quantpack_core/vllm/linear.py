"""The per-shard linear method for vLLM's linear layers and ``ParallelLMHead``, for any quantized format.

A quantized pack stores every projection self-contained (its own K, codebook and scales), so the shards of a fused
vLLM layer (q/k/v in ``qkv_proj``, gate/up in ``gate_up_proj``, Qwen3.5's ``in_proj_qkv`` + ``in_proj_z`` in
``in_proj_qkvz``) cannot be concatenated into one quantized matrix, and nothing about a shard's shape or K is known
before its tensors arrive. Hence:

* ``create_weights`` registers one empty placeholder per checkpoint suffix of the format (plus ``weight`` for dense
  shards), each capturing whole checkpoint tensors per shard id (:class:`~.params.ShardParam`), and reads vLLM's
  tensor-parallel split of the layer (:class:`LinearTp`), announcing the shares that fall inside a block;
* ``process_weights_after_loading`` checks what arrived (every output partition covered once, one kind per layer,
  sound tensors, the format's geometry), cuts each shard to this rank's part, chooses a kernel per shard from the
  platform's priority list (:func:`quantpack_core.kernels.choose_kernel`), lets it build its form, registers its
  tensors as parameters and drops the captured host tensors;
* ``apply`` runs one registered custom op per run into one output: a run is one shard, or consecutive shards of one
  kernel that its ``fuse`` combined (one GEMM or launch for q / k / v, gate / up).

The layer's state is one :class:`LinearState` (``layer.quant_state``); its tensors are the layer's parameters
``shard{i}_{name}`` and, for a column-parallel fallback, the buffer ``col_select``.

Follows vLLM's ``LinearMethodBase`` (``vllm/model_executor/layers/linear.py``) and exllamav3's ``LinearEXL3``
(padding: inputs zero-extended to the stored width, outputs trimmed); docs/architecture.md walks one shard through it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from vllm.model_executor.layers.linear import LinearMethodBase

from quantpack_core.errors import CodecError, GeometryError, LayerLoadError
from quantpack_core.format import LinearFormat
from quantpack_core.kernels import (
    TP_COLUMN_FALLBACK,
    TP_ROW_FALLBACK,
    TP_SLICED,
    TP_WHOLE,
    PreparedShard,
    choose_kernel,
)
from quantpack_core.names import expand_fused, normalize_prefix, shard_partitions
from quantpack_core.tp import COLUMN, ROW, TpCut, cut_dense, make_cut, partition_ranges, plan_cut, sliced_tp_sizes

from .compile_key import engine_max_rows, op_name
from .params import ShardParam

logger = logging.getLogger("vllm.quantpack")

#: the placeholder of a dense shard (the model dtype)
DENSE_SUFFIX = "weight"


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


@dataclass(frozen=True)
class ShardPlan:
    """One loaded shard: which checkpoint tensor it is and where it goes in the layer's output.

    Attributes:
        slot: sort key (vLLM's concatenation order).
        shard_id: the loader's id.
        partitions: the layer's output partitions it covers.
        in_features: logical input features (this rank's).
        out_features: logical output features (sum of its partitions, this rank's).
        label: human name for messages (the checkpoint module when known).
    """

    slot: int
    shard_id: Hashable | None
    partitions: tuple[int, ...]
    in_features: int
    out_features: int
    label: str

    @property
    def name(self) -> str:
        """The shard as messages name it."""
        return self.label if self.shard_id is None else f"shard {self.shard_id!r} ({self.label})"


@dataclass(frozen=True)
class ShardRun:
    """How ``apply`` runs one prepared shard.

    Attributes:
        kernel: the chosen kernel's name.
        fn: the op wrapper, ``fn(x, *params, *static, out, col)``.
        params: names of the layer parameters holding the shard's tensors.
        static: Python scalars of the op (codebook, K, widths).
        col: the shard's first output column.
    """

    kernel: str
    fn: Callable[..., None]
    params: tuple[str, ...]
    static: tuple
    col: int


@dataclass
class LinearState:
    """Everything the method knows about one layer (``layer.quant_state``), filled in when the weights are created
    and completed when they are processed.

    Attributes:
        prefix: the vLLM module name.
        is_lm_head: the layer is a ``ParallelLMHead``.
        tp: this rank's split, or None (no tensor parallelism, or a replicated layer).
        in_features: this rank's logical input features.
        partitions: this rank's output partition sizes.
        params_dtype: the model dtype.
        runs: one per shard or fused group of shards, in output order (empty before processing, and for an empty
            head).
        out_total: output columns the shards write.
        out_width: columns ``apply`` returns (``out_total``, or fewer after a column fallback's selection).
        row_pad: zeros ``(before, after)`` a row-parallel fallback puts around the input slice, or None.
        col_select: whether the buffer ``col_select`` selects this rank's columns (a column-parallel fallback).
        empty_head: a head that received no weights (a draft's, shared from its target after loading).
        tied: the embedding module whose method computes this head's logits: a head tied by assignment of the
            embedding's weight (``lm_head.weight = embed_tokens.weight``, model files of vLLM 0.22-0.25), which
            bypasses ``tie_weights``; else None.
        returns: the only run's ``returns`` callable when ``apply`` hands its product back directly (one run
            writing every column, no fallback selection or padding, and the kernel offers one); else None.
    """

    prefix: str
    is_lm_head: bool
    tp: LinearTp | None
    in_features: int
    partitions: tuple[int, ...]
    params_dtype: torch.dtype
    runs: tuple[ShardRun, ...] = ()
    out_total: int = 0
    out_width: int = 0
    row_pad: tuple[int, int] | None = None
    col_select: bool = False
    empty_head: bool = False
    tied: torch.nn.Module | None = None
    returns: Callable[..., torch.Tensor] | None = None


#: (layer kind, geometry) already reported, so a model with 64 identical layers logs each fallback once
_reported: set[tuple] = set()


class QuantLinearMethod(LinearMethodBase):
    """Linear method for a quantized format's layers (and dense layers a pack stores as ``.weight``), per shard.

    A format binds it in a subclass: ``class Exl3LinearMethod(QuantLinearMethod): format = EXL3``.

    Args:
        config: the model's quant config (a :class:`~.config.QuantpackConfig`: platform, kernel lists, kernel log).
        prefix: the vLLM module name, for messages.
        is_lm_head: the layer is ``ParallelLMHead`` (its vocabulary rows are padded by vLLM to a multiple of 64).
    """

    format: ClassVar[LinearFormat]

    def __init__(self, config, prefix: str = "", is_lm_head: bool = False):
        self.config = config
        self.prefix = prefix
        self.is_lm_head = is_lm_head

    @property
    def suffixes(self) -> dict[str, torch.dtype | None]:
        """Placeholder suffix -> dtype (None: the model dtype, for dense shards)."""
        return {**self.format.suffixes, DENSE_SUFFIX: None}

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
        """Register the placeholders and the layer's :class:`LinearState`. ``extra_weight_attrs`` (vLLM's own
        narrowing weight_loader) is deliberately not applied: whole checkpoint tensors are captured on every rank
        and each rank keeps its part when the layer is processed.

        Raises:
            GeometryError: a tensor-parallel ``ParallelLMHead`` whose vocabulary does not fill every rank's
                partition (vLLM pads it; a quantized head is cut to whole vocabulary rows only).
        """
        tp = self._tp_layout(layer, input_size_per_partition, output_partition_sizes, input_size)
        for suffix, dtype in self.suffixes.items():
            layer.register_parameter(suffix, ShardParam(suffix, dtype or params_dtype, self.prefix))
        layer.quant_state = LinearState(
            self.prefix, self.is_lm_head, tp, input_size_per_partition, tuple(output_partition_sizes), params_dtype
        )
        self.config.kernel_log.expect(layer)

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
        block = self.format.block
        if self.is_lm_head:
            vocab = int(getattr(layer, "org_vocab_size", 0) or 0)
            si = getattr(layer, "shard_indices", None)
            if si is not None:  # the rank vLLM split the vocabulary for (its own record, on every version)
                rank = int(si.org_vocab_start_index) // partitions[0]
            if vocab != partitions[0] * size:
                raise GeometryError(
                    f"{self.prefix}: the vocabulary ({vocab} rows) does not fill the {size} tensor-parallel "
                    f"partitions of {partitions[0]} rows vLLM pads it to, so the last rank's partition is padded. "
                    f"Rule: a {self.format.label} head is cut to whole vocabulary rows per rank and padded partitions "
                    f"are not supported -> serve this pack with --tensor-parallel-size 1, or re-quantize it with a "
                    f"vocabulary padded to a multiple of {64 * size} (of {block * size} for each rank's rows to "
                    "be whole Hadamard blocks, with no fallback)"
                )
            tp = LinearTp(COLUMN, size, rank, in_full, tuple(partitions), (1,))
        elif in_local != in_full:
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
        """Log, before any weight is loaded, the partitions whose rank share falls inside a block (they will run the
        fallback on the blocks it touches) with the rule and the sizes that avoid it; once per layer kind."""
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
            "quantpack: %s (and layers like it) at tensor-parallel size %d: each rank's share of %s lies "
            "inside a %d-feature Hadamard block, so every rank keeps the whole blocks its share touches (up to one "
            "block more at each end) and %s (exact; costs that memory and compute). Sizes up to 16 that cut this "
            "layer alone on whole blocks: %s",
            self.prefix,
            tp.size,
            ", ".join(off),
            self.format.block,
            "zero-extends its input slice" if tp.kind == ROW else "selects its output columns",
            ", ".join(map(str, ok)),
        )

    # -------------------------------------------------------------------------------------------------- load

    def _plans(self, state: LinearState, captured: dict[str, ShardParam], kind: str) -> list[ShardPlan]:
        main = captured[self.format.main_suffix if kind != "dense" else DENSE_SUFFIX]
        parts = state.partitions
        slots = sorted(main.shards)
        if kind != "dense":
            for s in self.format.suffixes:
                for slot, sid in captured[s].shard_ids.items():
                    if slot not in main.shards:
                        raise LayerLoadError(
                            f"{self.prefix}: shard {sid!r} has .{s} but no .{self.format.main_suffix}; the pack is "
                            f"incomplete - re-download the file that should hold that {self.format.main_suffix}"
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
            plans.append(ShardPlan(slot, sid, p, state.in_features, sum(parts[j] for j in p), labels[i]))
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

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Validate the captured tensors, choose a kernel per shard, build its form, release the host copies.

        Steps: what the layer received (:meth:`_loaded_kind`); per shard, its checks and this rank's cut with the
        tensor-parallel fallbacks, its kernel and its prepared form (:meth:`_prepare_shards`); the placeholders
        dropped; the runs fused and their tensors registered (:meth:`_register_runs`).

        Raises:
            LayerLoadError: no tensor at all, quantized and dense shards mixed, a shard missing or doubled, a tensor
                of a shard missing (e.g. ``svh`` without ``trellis``), or an unsound tensor.
            GeometryError: stored sizes that break the format's geometry rule.
            NoKernelError: no kernel of the platform's list runs a shard (every kernel's reason named).
        """
        state: LinearState = layer.quant_state
        log = self.config.kernel_log
        embedding = getattr(getattr(layer, DENSE_SUFFIX, None), "quantpack_embedding", None)
        if self.is_lm_head and embedding is not None:
            state.tied = embedding()  # tied by assignment (LinearState.tied)
            self._drop_placeholders(layer, {s: getattr(layer, s) for s in self.suffixes})
            log.finish(layer)
            return
        captured: dict[str, ShardParam] = {s: getattr(layer, s) for s in self.suffixes}
        kind = self._loaded_kind(state, captured)
        if kind is None:
            # A speculative-decoding draft's head: vLLM replaces it with the target's after loading. Left empty;
            # apply() says so if it is ever used.
            self._drop_placeholders(layer, captured)
            state.empty_head = True
            log.finish(layer)
            return
        device = captured[self.format.main_suffix].device  # the placeholders live on the layer's target device
        prepared, selects, row_pad = self._prepare_shards(state, captured, kind, device)
        self._drop_placeholders(layer, captured)
        self._register_runs(layer, state, prepared, selects, row_pad, device)
        log.finish(layer)

    def _loaded_kind(self, state: LinearState, captured: dict[str, ShardParam]) -> str | None:
        """What the layer received: ``"quantized"`` or ``"dense"`` shards, or None for a head that received none
        (a draft's).

        Raises:
            LayerLoadError: quantized and dense shards mixed, or no tensor at all in a layer other than a head.
        """
        quantized = any(captured[s].shards for s in self.format.suffixes)
        dense = bool(captured[DENSE_SUFFIX].shards)
        if quantized and dense:
            raise LayerLoadError(
                f"{self.prefix}: the pack stores some shards of this layer as {self.format.label} "
                f"{self.format.main_suffix} ({sorted(captured[self.format.main_suffix].shard_ids.values(), key=str)}) "
                f"and others as dense weights ({sorted(captured[DENSE_SUFFIX].shard_ids.values(), key=str)}); a fused "
                "layer must be all one kind - re-quantize the pack with the same setting for all of "
                f"{', '.join(n.rsplit('.', 1)[-1] for n in self._labels(len(state.partitions)))}"
            )
        if not quantized and not dense:
            if self.is_lm_head:
                return None
            raise LayerLoadError(
                f"{self.prefix}: no tensor of this layer was loaded (neither .{self.format.main_suffix} nor .weight); "
                "the pack lacks it - re-download the pack, or check that it matches config.json's architecture"
            )
        return "quantized" if quantized else "dense"

    def _prepare_shards(
        self, state: LinearState, captured: dict[str, ShardParam], kind: str, device: torch.device
    ) -> tuple[list[tuple[type, PreparedShard]], list[list[int] | None], tuple[int, int] | None]:
        """Every shard prepared by its kernel (:meth:`_prepare_shard`), in output order: ``(prepared, selects,
        row_pad)``, with per shard the columns a column fallback selects (else None), and the input padding of a
        row fallback (else None)."""
        prepared, selects, row_pad = [], [], None
        for plan in self._plans(state, captured, kind):
            prepared_shard, select, pad = self._prepare_shard(state, captured, plan, kind, device)
            prepared.append(prepared_shard)
            selects.append(select)
            if pad is not None:
                row_pad = pad
        return prepared, selects, row_pad

    def _prepare_shard(
        self, state: LinearState, captured: dict[str, ShardParam], plan: ShardPlan, kind: str, device: torch.device
    ) -> tuple[tuple[type, PreparedShard], list[int] | None, tuple[int, int] | None]:
        """One shard cut to this rank, its kernel chosen from the platform's list and its form prepared on
        ``device``: ``((kernel, prepared), select, row_pad)`` (see :meth:`_quantized_spec`); a quantized shard's host
        tensors are released.

        Raises:
            LayerLoadError: a kernel's refusal of the shard's values (naming the layer and the shard).
            NoKernelError: no kernel of the list runs the shard.
        """
        cut = state.tp.cut(plan.partitions) if state.tp is not None else None
        in_f, out_f = self._full_sizes(plan, cut)
        select = row_pad = None
        if kind == "quantized":
            shard, spec, select, row_pad = self._quantized_spec(state, captured, plan, cut, in_f, out_f)
            kernels = self.config.linear_kernels
        else:
            shard = self._fit_dense(captured[DENSE_SUFFIX].shards[plan.slot], plan, in_f, out_f)
            if cut is not None:
                shard = cut_dense(shard, cut)
            out_n, in_n = shard.shape
            spec = self.config.dense_spec(in_n, out_n, state.params_dtype, TP_WHOLE if cut is None else TP_SLICED)
            kernels = self.config.dense_kernels
        spec = replace(spec, max_rows=engine_max_rows())
        choice = choose_kernel(kernels, spec, self.where(plan))
        self.config.kernel_log.record("linear", choice)
        try:
            prepared = choice.kernel.prepare(shard, spec, device)
        except LayerLoadError as e:  # a kernel's refusal of the shard's values: name the layer and the shard
            raise LayerLoadError(f"{self.where(plan)}: {e}") from None
        if kind == "quantized":
            self.format.release(shard)
        return (choice.kernel, prepared), select, row_pad

    def _quantized_spec(
        self,
        state: LinearState,
        captured: dict[str, ShardParam],
        plan: ShardPlan,
        cut: TpCut | None,
        in_f: int,
        out_f: int,
    ) -> tuple[Any, Any, list[int] | None, tuple[int, int] | None]:
        """A quantized shard parsed, checked (:meth:`_check_quantized`) and cut to the blocks this rank's share
        touches (exactly its share when sliced), and its kernel spec: ``(shard, spec, select, row_pad)``. A share
        inside a block takes a tensor-parallel fallback: a row cut's input is zero-extended to the kept span
        (``row_pad``), a column cut's columns are selected from the kept spans' product (``select``); else both are
        None."""
        shard = self._parse(captured, plan)
        self._check_quantized(shard, plan, cut, in_f, out_f)
        tp, select, row_pad = (TP_WHOLE if cut is None else TP_SLICED), None, None
        if cut is not None:
            shard = self.format.cut(shard, cut)
            in_f, out_f = (cut.kept_features, out_f) if cut.kind == ROW else (in_f, cut.kept_features)
            if not cut.sliced and cut.kind == ROW:
                row_pad, tp = cut.row_pad(), TP_ROW_FALLBACK
            elif not cut.sliced:
                select, tp = cut.kept_positions(), TP_COLUMN_FALLBACK
        spec = self.format.spec(shard, self.config.platform, in_f, out_f, state.params_dtype, tp)
        return shard, spec, select, row_pad

    def _check_quantized(self, shard: Any, plan: ShardPlan, cut: TpCut | None, in_f: int, out_f: int) -> None:
        """:class:`GeometryError` when the shard's stored sizes break the format's geometry for the layer's whole
        ``(in_f, out_f)``, or when this rank's share falls inside a block and the format has no fallback."""
        why = self.format.geometry_error(shard, in_f, out_f, self.is_lm_head)
        if why is not None:
            raise GeometryError(
                f"{self.where(plan)} {why}: the pack does not match config.json - use the config the pack was made with"
            )
        if cut is not None and not cut.sliced and not self.format.tp_fallback:
            side = "output" if cut.column else "input"
            raise GeometryError(
                f"{self.where(plan)}: tensor parallelism gives this rank {side} features "
                f"{list(cut.ranges)} of {cut.features}, not whole {self.format.block}-feature blocks; "
                f"{self.format.label} shards are cut in whole blocks per rank - serve with a tensor-parallel "
                f"size whose shares of {cut.features} are multiples of {self.format.block}"
            )

    def _register_runs(
        self,
        layer: torch.nn.Module,
        state: LinearState,
        prepared: list[tuple[type, PreparedShard]],
        selects: list[list[int] | None],
        row_pad: tuple[int, int] | None,
        device: torch.device,
    ) -> None:
        """Fuse the prepared shards into runs (:meth:`_fused`), finalize each and register its tensors as the
        layer's parameters ``shard{i}_{name}``; register a column fallback's selection as the buffer
        ``col_select``; complete ``state`` (``returns`` where one run writes every column) and add the layer's runs
        to the compile key. Each run's unpacked form is freed once it is packed (``prepared`` is emptied)."""
        col, columns = self._columns(prepared, selects)
        runs, first = [], 0
        fused = self._fused(prepared)
        prepared.clear()
        for i in range(len(fused)):
            (kernel, p), fused[i] = fused[i], None  # each run's unpacked form is freed once it is packed
            p = kernel.finalize(p)
            names = []
            for name, tensor in p.tensors.items():
                layer.register_parameter(f"shard{i}_{name}", torch.nn.Parameter(tensor, requires_grad=False))
                names.append(f"shard{i}_{name}")
            runs.append(ShardRun(kernel.name, p.run, tuple(names), p.static, first))
            first += p.out_features
        state.runs, state.out_total, state.out_width, state.row_pad = tuple(runs), col, len(columns), row_pad
        if any(s is not None for s in selects):
            layer.register_buffer("col_select", torch.tensor(columns, dtype=torch.int64, device=device), False)
            state.col_select = True
        elif len(runs) == 1 and row_pad is None:  # one run writing every column: its product is the output
            state.returns = p.returns
        self.config.compile_key.add(
            self.prefix,
            tuple((r.kernel, op_name(r.fn), r.params, r.static, r.col) for r in runs),
            op_name(state.returns),
            state.col_select,
            row_pad,
        )

    @staticmethod
    def _columns(prepared: list[tuple[type, PreparedShard]], selects: list[list[int] | None]) -> tuple[int, list[int]]:
        """``(columns the shards write, the columns apply returns)``: every column, or a column fallback's selection
        of them."""
        col, columns = 0, []
        for (_, p), select in zip(prepared, selects, strict=True):
            columns.extend(range(col, col + p.out_features) if select is None else [col + c for c in select])
            col += p.out_features
        return col, columns

    @staticmethod
    def _fused(prepared: list[tuple[type, PreparedShard]]) -> list[tuple[type, PreparedShard]]:
        """The runs of a layer: each maximal group of consecutive shards one kernel prepared, fused into one run when
        the kernel's :meth:`~quantpack_core.kernels.LinearKernel.fuse` accepts the group (the shards share the
        layer's input and write adjacent columns), else one run per shard."""
        runs, i = [], 0
        while i < len(prepared):
            j = i
            while j + 1 < len(prepared) and prepared[j + 1][0] is prepared[i][0]:
                j += 1
            kernel = prepared[i][0]
            one = kernel.fuse([p for _, p in prepared[i : j + 1]]) if j > i else None
            runs.extend([(kernel, one)] if one is not None else prepared[i : j + 1])
            i = j + 1
        return runs

    @staticmethod
    def _drop_placeholders(layer: torch.nn.Module, captured: dict[str, ShardParam]) -> None:
        """Take the placeholders off ``layer`` and release their captured tensors, except an embedding's placeholder
        a head holds by assignment (its table is the embedding's to keep)."""
        for suffix, param in captured.items():
            if not hasattr(param, "quantpack_embedding"):
                param.release()
            delattr(layer, suffix)

    @staticmethod
    def _full_sizes(plan: ShardPlan, cut: TpCut | None) -> tuple[int, int]:
        """The logical (in, out) features of the whole checkpoint tensor behind ``plan``."""
        if cut is None:
            return plan.in_features, plan.out_features
        if cut.kind == ROW:
            return cut.features, plan.out_features
        return plan.in_features, cut.features

    def where(self, plan: ShardPlan) -> str:
        """The layer and shard as messages name them: ``"<layer>: <shard>"``, or the layer alone when the shard is
        the whole layer under the same name."""
        same = plan.shard_id is None and normalize_prefix(plan.label) == normalize_prefix(self.prefix)
        return self.prefix if same else f"{self.prefix}: {plan.name}"

    def _parse(self, captured: dict[str, ShardParam], plan: ShardPlan) -> Any:
        got = {s: captured[s].shards[plan.slot] for s in self.format.suffixes if plan.slot in captured[s].shards}
        try:
            return self.format.parse(got)
        except CodecError as e:
            raise LayerLoadError(
                f"{self.where(plan)}: {e}; the pack's {plan.label} is incomplete or corrupt - re-download or "
                "re-quantize it"
            ) from None

    def _fit_dense(self, w: torch.Tensor, plan: ShardPlan, in_f: int, out_f: int) -> torch.Tensor:
        if w.dim() != 2 or w.shape[1] != in_f or w.shape[0] > out_f or (w.shape[0] < out_f and not self.is_lm_head):
            raise GeometryError(
                f"{self.prefix}: dense {plan.name} has shape {list(w.shape)}, the layer needs [{out_f}, {in_f}] "
                "(out x in) - the pack does not match config.json"
            )
        if w.shape[0] < out_f:  # a dense lm_head over the unpadded vocabulary
            w = torch.nn.functional.pad(w, (0, 0, 0, out_f - w.shape[0]))
        return w

    def tie_weights(self, layer: torch.nn.Module, embed_tokens: torch.nn.Module) -> torch.nn.Module:
        """A head tied to the embedding is the embedding module itself: its method's ``apply`` computes the logits
        (vLLM >= 0.24 calls this from ``ParallelLMHead.tie_weights``, older releases through
        :func:`.layers.delegate_tie_weights`); this layer will not be processed."""
        self.config.kernel_log.forget(layer)
        return embed_tokens

    # ------------------------------------------------------------------------------------------------- apply

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x (..., in)`` -> ``(..., sum of output partitions)`` in ``x``'s dtype (this rank's input and output
        features under tensor parallelism): one registered custom op per run, each writing its columns of one
        output; then, for fallbacks (shares off the blocks), this rank's columns are selected from the kept blocks'
        product (column parallel) or its input was zero-extended to the kept blocks first (row parallel); then
        ``bias``. A layer whose one run offers ``returns`` (``LinearState.returns``: vLLM's CPU GEMM) returns that
        op's product, bias included, instead.

        Raises:
            LayerLoadError: an empty draft head used before vLLM shared the target's, or a forward before
                ``process_weights_after_loading``.
        """
        state: LinearState = layer.quant_state
        if not state.runs:
            if state.tied is not None:  # tied by assignment (see LinearState.tied): the embedding's logits
                return state.tied.quant_method.apply(state.tied, x, bias)
            if state.empty_head:
                raise LayerLoadError(
                    f"{self.prefix}: this head received no weights (a draft model's, meant to be "
                    "shared with its target) and was used before vLLM shared it"
                )
            raise LayerLoadError(f"{self.prefix}: forward before process_weights_after_loading built its weights")
        x2 = x.reshape(-1, x.shape[-1])
        if state.returns is not None:  # one run gives the whole product (vLLM's CPU GEMM, as its own method does)
            y = state.returns(x2, *[getattr(layer, name) for name in state.runs[0].params], bias)
            return y.reshape(*x.shape[:-1], state.out_width)
        if state.row_pad is not None:  # a row-parallel fallback: this rank's input slice at its place
            x2 = torch.nn.functional.pad(x2, state.row_pad)
        out = torch.empty((x2.shape[0], state.out_total), dtype=x.dtype, device=x.device)
        for run in state.runs:
            run.fn(x2, *[getattr(layer, name) for name in run.params], *run.static, out, run.col)
        if state.col_select:  # a column-parallel fallback: this rank's columns
            out = out.index_select(1, layer.col_select)
        if bias is not None:
            out += bias
        return out.reshape(*x.shape[:-1], state.out_width)
