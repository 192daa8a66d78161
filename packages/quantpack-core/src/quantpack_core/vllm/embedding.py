"""The token-embedding method for vLLM's ``VocabParallelEmbedding``: int8 rows or a dense table.

vLLM keeps the embedding table on the device, where it is often the largest tensor of a pack. A pack converted with
``quantpack embed-int8`` stores it as int8 rows (``qweight``) with one float32 scale per row (``scales``); this
method keeps exactly that on the device (as the layer's ``qweight`` / ``scales`` parameters) and dequantizes only
the rows a batch gathers, in float32 before casting to the model dtype. A pack with a dense ``weight`` table is
served from that table, converted once to the model dtype. A module that receives no table at all (a
speculative-decoding draft whose embedding vLLM replaces with the target's after loading) stays empty and raises if
it is ever used. Format-free: any quantized format's packs may carry such a table.

Follows vLLM's ``UnquantizedEmbeddingMethod`` (``vllm/model_executor/layers/vocab_parallel_embedding.py``: the
``embedding`` / ``apply`` / ``tie_weights`` contract) and :mod:`quantpack_core.embedding` (the row format).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

from quantpack_core.errors import LayerLoadError
from quantpack_core.int8_logits import int8_rows_logits

from .params import ShardParam

ROWS, SCALES, DENSE = "qweight", "scales", "weight"


def _owned(table: torch.Tensor, captured: torch.Tensor) -> torch.Tensor:
    """``table``, copied when it still shares memory with the captured checkpoint tensor (a table that needed no
    padding, cast or move): otherwise the layer would keep a view of the checkpoint's memory map, and with it the
    whole shard file mapped and its read pages in the process for as long as the model lives."""
    if table.untyped_storage().data_ptr() == captured.untyped_storage().data_ptr():
        return table.clone()
    return table


@dataclass
class EmbeddingState:
    """What the method knows about one embedding (``layer.quant_state``).

    Attributes:
        prefix: the vLLM module name.
        vocab_rows: this rank's ``[start, stop)`` rows of the whole table (the vocabulary's at size 1); None where
            vLLM gives the layer no ``shard_indices``.
        rows: rows of the layer's (padded) partition.
        width: the embedding width.
        params_dtype: the model dtype.
        int8: the table is int8 rows (parameters ``qweight`` / ``scales``) rather than a dense ``weight``.
    """

    prefix: str
    vocab_rows: tuple[int, int] | None
    rows: int
    width: int
    params_dtype: torch.dtype
    int8: bool = False


class Int8RowsEmbeddingMethod(QuantizeMethodBase):
    """int8 rows with a per-row scale, or a dense table, whichever the pack carries.

    A format whose packs name the int8 tensors differently subclasses it with its own :attr:`rows_suffix` /
    :attr:`scales_suffix` (escha: ``weight_int8`` / ``weight_scale``); the layer's parameters after loading are
    ``qweight`` / ``scales`` either way.

    Args:
        prefix: the vLLM module name, for messages.
    """

    #: the checkpoint suffixes of the int8 rows and of their per-row scales
    rows_suffix: str = ROWS
    scales_suffix: str = SCALES
    #: how to rebuild an incomplete int8 table, for messages
    rebuild_hint: str = "re-run `quantpack embed-int8` on the original pack"

    def __init__(self, prefix: str = ""):
        # vLLM builds some models' input embedding without a prefix (Llama's embed_tokens): name it for messages
        self.prefix = prefix or "embed_tokens"

    @property
    def placeholders(self) -> dict[str, torch.dtype | None]:
        """Checkpoint suffix -> placeholder dtype (None: the model dtype): int8 rows, their scales, a dense table."""
        return {self.rows_suffix: torch.int8, self.scales_suffix: torch.float32, DENSE: None}

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
        """Register placeholders for ``qweight``, ``scales`` and ``weight``; vLLM's narrowing vocab loader in
        ``extra_weight_attrs`` is not applied: the whole table is captured and this rank keeps its vocabulary rows
        (``layer.shard_indices``' ``org_vocab_start_index`` to ``org_vocab_end_index``; all of them at tensor-parallel
        size 1, where a table longer than ``vocab_size`` loses its rows past it) at the top of its partition, the
        rest zero, as vLLM lays out a dense partition."""
        for suffix, dtype in self.placeholders.items():
            layer.register_parameter(suffix, ShardParam(suffix, dtype or params_dtype, self.prefix))
        # a model file of vLLM 0.22-0.25 ties its head by ``lm_head.weight = embed_tokens.weight``: the head finds
        # this embedding through its weight (QuantLinearMethod.process_weights_after_loading)
        getattr(layer, DENSE).quantpack_embedding = weakref.ref(layer)
        si = getattr(layer, "shard_indices", None)
        vocab_rows = (int(si.org_vocab_start_index), int(si.org_vocab_end_index)) if si is not None else None
        layer.quant_state = EmbeddingState(
            self.prefix, vocab_rows, sum(output_partition_sizes), input_size_per_partition, params_dtype
        )

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Check and place the table.

        Raises:
            LayerLoadError: ``qweight`` without ``scales`` (or the reverse), both int8 rows and a dense table, wrong
                dtypes, or a table wider or longer than the layer.
        """
        state: EmbeddingState = layer.quant_state
        rows_name, scales_name = self.rows_suffix, self.scales_suffix
        got = {s: getattr(layer, s).shards.get(0) for s in self.placeholders}
        device = getattr(layer, rows_name).device
        for suffix in self.placeholders:
            getattr(layer, suffix).release()
            delattr(layer, suffix)
        q, s, w = got[rows_name], got[scales_name], got[DENSE]
        if state.vocab_rows is not None:  # this rank's vocabulary rows of the whole table (past vocab_size: dropped)
            a, b = state.vocab_rows
            q, s, w = (None if t is None else self._rank_rows(t, a, b) for t in (q, s, w))
        if (q is None) != (s is None):
            have, missing = (rows_name, scales_name) if s is None else (scales_name, rows_name)
            raise LayerLoadError(
                f"{self.prefix}: the pack has .{have} but no .{missing}; the int8 table is incomplete - "
                f"{self.rebuild_hint}"
            )
        if q is not None and w is not None:
            raise LayerLoadError(
                f"{self.prefix}: the pack stores both int8 rows (.{rows_name}) and a dense .weight; keep one of them"
            )
        if q is not None:
            if q.dtype != torch.int8 or q.dim() != 2 or s.shape != (q.shape[0],):
                raise LayerLoadError(
                    f"{self.prefix}: int8 rows must be int8 (rows, width) with (rows,) scales, got "
                    f"{q.dtype} {list(q.shape)} and {s.dtype} {list(s.shape)}"
                )
            q = self._fit(q, rows_name, state.rows, state.width)
            scales = torch.ones(state.rows, dtype=torch.float32)
            scales[: s.shape[0]] = s.float()
            layer.register_parameter(
                ROWS, torch.nn.Parameter(_owned(q.to(device), got[rows_name]), requires_grad=False)
            )
            layer.register_parameter(SCALES, torch.nn.Parameter(scales.to(device), requires_grad=False))
            layer.register_parameter(DENSE, None)  # vLLM's draft-sharing code looks the name up
            state.int8 = True
        elif w is not None:
            w = self._fit(w, DENSE, state.rows, state.width).to(device=device, dtype=state.params_dtype)
            w = _owned(w, got[DENSE])
            layer.register_parameter(DENSE, torch.nn.Parameter(w, requires_grad=False))
        else:
            layer.register_parameter(DENSE, None)  # empty: shared from a target model after loading

    def _rank_rows(self, table: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of a whole ``(vocab, ...)`` table (``scales`` too); a shorter table whole where one
        rank holds the whole vocabulary (``start`` 0: :meth:`_fit` pads it)."""
        if start == 0 and table.dim() >= 1 and table.shape[0] <= stop:
            return table
        if table.dim() < 1 or table.shape[0] < stop:
            raise LayerLoadError(
                f"{self.prefix}: the pack's table has {table.shape[0] if table.dim() else 0} rows, this "
                f"tensor-parallel rank needs rows {start} to {stop} - the pack does not match config.json"
            )
        return table[start:stop]

    def _fit(self, table: torch.Tensor, suffix: str, rows: int, width: int) -> torch.Tensor:
        """Pad a ``(vocab, width)`` table to the layer's padded row count ``rows``."""
        if table.dim() != 2 or table.shape[1] != width or table.shape[0] > rows:
            raise LayerLoadError(
                f"{self.prefix}: .{suffix} has shape {list(table.shape)}, the layer holds "
                f"{rows} rows of width {width} - the pack does not match config.json"
            )
        if table.shape[0] < rows:
            table = torch.cat([table, table.new_zeros((rows - table.shape[0], width))])
        return table.contiguous()

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        """Rows of ``input_`` (int64 ids, any shape) -> ``(*input_.shape, width)`` in the model dtype.

        Raises:
            LayerLoadError: an empty draft table used before vLLM shared the target's.
        """
        state: EmbeddingState = layer.quant_state
        if state.int8:
            rows = layer.qweight[input_].to(torch.float32) * layer.scales[input_].unsqueeze(-1)
            return rows.to(state.params_dtype)
        if layer.weight is None:
            raise LayerLoadError(
                f"{self.prefix}: this embedding has no table (a draft model's, meant to be shared "
                "with its target) and was used before vLLM shared it"
            )
        return torch.nn.functional.embedding(input_, layer.weight)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of a head tied to this table (or stored as one): ``x @ table.T``. An int8 table is never
        dequantized: ``quantpack::int8_rows_logits_`` reads its rows and applies each row's scale to its logit
        (:mod:`quantpack_core.int8_logits`).

        Raises:
            LayerLoadError: a tied head over an embedding without a table.
        """
        if layer.quant_state.int8:
            logits = int8_rows_logits(x.reshape(-1, x.shape[-1]), layer.qweight, layer.scales)
            logits = logits.reshape(*x.shape[:-1], logits.shape[-1])
            return logits if bias is None else logits + bias
        if layer.weight is not None:
            w = layer.weight
        else:
            raise LayerLoadError(f"{self.prefix}: tied head over an embedding that has no table")
        return torch.nn.functional.linear(x, w, bias)
