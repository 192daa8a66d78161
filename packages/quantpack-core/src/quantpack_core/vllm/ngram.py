"""The embedding method of a hashed n-gram table stored as exllamav3's row rings (Qwen3.8-Flash-Next's per-layer
embedding, ``ple_embedding.ngram_embedding``), on vLLM's PLE embedding layer.

vLLM's layer (``PLEVocabParallelEmbedding`` and, from vLLM 0.30, its ``Qwen4ExpPLEEmbedding`` subclasses) is a
``VocabParallelEmbedding`` over the whole table: it turns n-gram ids into this rank's row ids and asks its method
for the rows (``embedding``), then (0.30+) for their conversion to the activation dtype (``dequantize``). This
method keeps the table as the pack stores it, int16 ring rows (``1 + 10 K`` words per row: about a sixth of the bf16
table at K 5), as the layer's ``weight`` on the device, and decodes only the rows a batch gathers, adding each row's
head bias (its head found from the global row id). The rows are read at load from ``ngram_embedding.safetensors``,
which the pack's index does not list (so vLLM's loader never yields them): only this rank's vocabulary partition,
straight from the file. The table's hash layout (``layer_multipliers``, head offsets and sizes) is the pack's:
where the n-gram module that owns the layer is known (:meth:`NgramRingsEmbeddingMethod.bind`), its id buffers take
the pack's values, as vLLM's own loader does with a checkpoint's.

Source: docs/exl3-format.md ("Row rings"), docs/families.md (Flash-Next PLE); exllamav3 1.6.5
``modules/ngram_embedding.py`` (``fetch_rows``: decode in float32 with the head bias, then cast); vLLM
``vllm/models/qwen4_exp/common/ngram_embedding.py`` (0.31+; ``nvidia/`` in 0.30, ``nvidia/ple_layer.py`` in 0.29).
"""

from __future__ import annotations

import logging
import os
import weakref
from pathlib import Path

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

from quantpack_core.codec.ring import NGRAM_ROW_DIM, decode_ring_rows
from quantpack_core.errors import LayerLoadError, PackError, Problem
from quantpack_core.ngram import NGRAM_FILE, RECOPY, NgramTable

logger = logging.getLogger("vllm.quantpack")

#: the last component of the PLE table's module name in vLLM and in packs
NGRAM_MODULE = "ngram_embedding"


def ngram_file(source: tuple[str, str | None] | None, prefix: str) -> Path:
    """Where the pack's :data:`~quantpack_core.ngram.NGRAM_FILE` is: beside a local pack's shards, or fetched from
    the Hugging Face hub for a hub pack.

    Args:
        source: ``(model, revision)`` as vLLM names the pack (a directory or a hub id), or None when unknown.
        prefix: the module, for messages.

    Raises:
        PackError: the pack is unknown, or the file is not in it (the index omits it, so copies often lack it).
    """
    if source is None:
        what = "the pack's location is unknown (the quant config was not given the model)"
        raise PackError("<pack>", [Problem(prefix, NGRAM_FILE, what, "load the pack through vLLM's LLM / vllm serve")])
    model, revision = source
    if os.path.isdir(model):
        return Path(model) / NGRAM_FILE
    try:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(model, NGRAM_FILE, revision=revision))
    except Exception as e:
        what = f"missing: the n-gram table is stored outside the index ({type(e).__name__}: {e})"
        raise PackError(model, [Problem(prefix, NGRAM_FILE, what, f"{RECOPY} into the pack")]) from e


class NgramRingsEmbeddingMethod(QuantizeMethodBase):
    """Ring-row n-gram table on vLLM's PLE embedding layer (see the module).

    Layer state after :meth:`create_weights`: ``weight`` int16 ``(partition rows, 1 + 10 K)`` (the packed rows of
    this rank's vocabulary partition; padding rows stay zero), ``head_bias`` float32 ``(heads, 160)``,
    ``head_offsets`` int64 ``(heads,)``.

    Args:
        quant_config: the pack's :class:`~.config.QuantpackConfig` (``pack_source`` says where the pack is).
        prefix: the layer's vLLM name (``language_model.model.layers.1.ple.ple_embedding.ngram_embedding``).

    Raises:
        PackError: at construction, the table file is missing or holds no sound table for this module.
    """

    requires_device_loading = False  # rows are read from the file into the parameter where it lives

    def __init__(self, quant_config, prefix: str):
        super().__init__()
        self.prefix = prefix
        self.path = ngram_file(getattr(quant_config, "pack_source", None), prefix)
        self.table = NgramTable.open_layout(self.path, prefix)
        self.owner: weakref.ref | None = None

    # ------------------------------------------------------------------------------------------------ weights

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        """Allocate the ring rows of this rank's partition and the head tensors.

        Raises:
            LayerLoadError: the layer's row width is not the rings' 160 (the model config's ``ple_embed_dim`` /
                heads disagree with the pack), the table has more rows than the layer's vocabulary, or the layer
                keeps its table in pinned host memory (vLLM's engram CPU offload copies raw rows of the model dtype,
                which ring rows are not).
        """
        t = self.table
        if input_size_per_partition != NGRAM_ROW_DIM:
            raise LayerLoadError(
                f"{self.prefix}: vLLM builds rows of {input_size_per_partition} values, the pack's ring rows hold "
                f"{NGRAM_ROW_DIM} - the model config's ple_embed_dim / (ngram_size - 1) / heads_per_ngram must match "
                "the pack's (use the config.json that came with the pack)"
            )
        vocab = getattr(layer, "org_vocab_size", output_size)
        if t.num_rows > vocab:
            raise LayerLoadError(
                f"{self.prefix}: {NGRAM_FILE} holds {t.num_rows} rows ({t.key}), the model config sizes the table at "
                f"{vocab} - use the config.json that came with the pack"
            )
        if getattr(layer, "supports_prefetch", False):
            raise LayerLoadError(
                f"{self.prefix}: the EXL3 n-gram table is decoded on the device as rows are gathered; vLLM's engram "
                "CPU offload (pinned host table) copies raw rows instead - serve without engram cpu_offload"
            )
        rows = sum(output_partition_sizes)
        words = t.shards[0].shape[1]
        alloc = getattr(layer, "allocate_embedding_weight", None)
        weight = alloc(rows, words, torch.int16) if alloc is not None else torch.empty(rows, words, dtype=torch.int16)
        layer.register_parameter("weight", torch.nn.Parameter(weight.zero_(), requires_grad=False))
        heads = t.head_offsets.numel()
        layer.register_parameter(
            "head_bias", torch.nn.Parameter(torch.zeros(heads, NGRAM_ROW_DIM), requires_grad=False)
        )
        layer.register_buffer("head_offsets", torch.zeros(heads, dtype=torch.int64), persistent=False)
        layer.ring_k = t.k_bits
        layer.ring_dtype = params_dtype

    def bind(self, owner: torch.nn.Module) -> None:
        """Remember the n-gram module that computes this table's row ids (vLLM's ``Qwen4ExpNGramEmbedding``), so
        that loading gives its id buffers the pack's hash layout (family fix, docs/families.md)."""
        self.owner = weakref.ref(owner)

    def _rank_rows(self, layer: torch.nn.Module) -> tuple[int, int]:
        idx = getattr(layer, "shard_indices", None)
        if idx is None:
            return 0, min(self.table.num_rows, layer.weight.shape[0])
        return idx.org_vocab_start_index, min(idx.org_vocab_end_index, self.table.num_rows)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Read this rank's ring rows and the head tensors from the table file; give the bound n-gram module the
        pack's hash layout.

        Raises:
            LayerLoadError: the bound module hashes into a different number of heads or n-gram positions than
                the pack's table.
        """
        t = self.table
        start, stop = self._rank_rows(layer)
        if stop > start:
            rows = t.read_rows(self.path, start, stop)
            with torch.no_grad():
                layer.weight[: stop - start].copy_(rows.to(layer.weight.device))
        with torch.no_grad():
            layer.head_bias.copy_(t.head_bias.to(layer.head_bias.device))
            layer.head_offsets.copy_(t.head_offsets.to(layer.head_offsets.device))
        owner = self.owner() if self.owner is not None else None
        if owner is not None:
            self._give_layout(owner)
        logger.info(
            "quantpack: %s: n-gram table %s, %d rows (this rank: %d) of K=%d ring rows, %.1f MiB on the device",
            self.prefix,
            t.key,
            t.num_rows,
            stop - start,
            t.k_bits,
            layer.weight.numel() * 2 / 2**20,
        )

    def _give_layout(self, owner: torch.nn.Module) -> None:
        t = self.table
        stored = {
            "layer_multipliers": t.layer_multipliers,
            "ngram_heads_offsets": t.head_offsets,
            "ngram_heads_vocab_sizes": t.head_vocab_sizes,
        }
        changed = []
        for name, value in stored.items():
            buf = getattr(owner, name, None)
            if buf is None:
                continue
            if buf.shape != value.shape:
                raise LayerLoadError(
                    f"{self.prefix}: the model config gives {name} {tuple(buf.shape)}, the pack's table "
                    f"{tuple(value.shape)} ({t.key}) - use the config.json that came with the pack"
                )
            if not torch.equal(buf.cpu(), value.to(buf.dtype)):
                changed.append(name)
            with torch.no_grad():
                buf.copy_(value.to(device=buf.device, dtype=buf.dtype))
        if changed:
            logger.info("quantpack: %s: hashing with the pack's stored %s", self.prefix, ", ".join(changed))

    # ------------------------------------------------------------------------------------------------ lookup

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        """Rows of this rank's row ids ``input_`` (any shape, int64): ``(*input_.shape, 160)`` in the model dtype,
        decoded in float32 with each row's head bias (exllamav3's ``fetch_rows``)."""
        flat = input_.reshape(-1)
        start = layer.shard_indices.org_vocab_start_index if hasattr(layer, "shard_indices") else 0
        heads = torch.searchsorted(layer.head_offsets, flat + start, right=True) - 1
        bias = layer.head_bias[heads.clamp_(0, layer.head_offsets.numel() - 1)]
        rows = decode_ring_rows(layer.weight[flat], layer.ring_k, bias)
        return rows.to(layer.ring_dtype).reshape(*input_.shape, NGRAM_ROW_DIM)

    def dequantize(self, layer: torch.nn.Module, embeddings: torch.Tensor, output_dtype: torch.dtype) -> torch.Tensor:
        """vLLM 0.30+'s conversion of looked-up rows: they are decoded already, only the dtype changes."""
        return embeddings.to(output_dtype)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Not a head: an n-gram table is only looked up.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError(f"{self.prefix}: an n-gram table is only looked up, never multiplied")
