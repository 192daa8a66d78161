"""What the rules of the pack check share: how a module's storage is named in messages (:func:`storage_label`,
:func:`main_tensor`), a stored size held against the config's (:func:`stored_size_problem`), the config's expert count
(:func:`configured_experts`) and a coded layer's bias (:func:`bias_misfit`). A module is coded where its
:attr:`~quantpack_core.inventory.ModuleInfo.format` is a format an installed plugin registers
(:func:`quantpack_core.format.pack_formats`); the rules name no format themselves.
"""

from __future__ import annotations

from ..errors import Problem
from ..format import pack_formats
from ..inventory import INT8_ROW_NAMES, INT8_ROWS, ModuleInfo, PackView, TensorInfo, int8_row_names

#: the last names of token embedding tables (vLLM's ``VocabParallelEmbedding``: Llama's ``embed_tokens``, GPT-2's
#: ``wte``, BERT-style ``word_embeddings``, GPT-NeoX's ``embed_in``)
TOKEN_EMBEDDINGS = ("embed_tokens", "wte", "word_embeddings", "embed_in")
#: how the storage kinds of :attr:`~quantpack_core.inventory.ModuleInfo.format` that are no format's are named in
#: messages (a format's: its :attr:`~quantpack_core.format.PackFormat.storage_label`)
STORAGE_LABELS = {INT8_ROWS: "int8 rows"}


def quantized_tensors() -> frozenset[str]:
    """The tensors a module stored quantized loads its weight from: a format's code
    (:attr:`~quantpack_core.format.LinearFormat.main_suffix`), int8 rows."""
    return frozenset({*(fmt.main_suffix for fmt in pack_formats().values()), *(r for r, _ in INT8_ROW_NAMES)})


def weight_tensors() -> frozenset[str]:
    """The tensors of a module that vLLM loads its weight from: a dense ``weight``, or :func:`quantized_tensors`."""
    return quantized_tensors() | {"weight"}


def is_coded(m: ModuleInfo) -> bool:
    """Whether module ``m`` is stored in a quantized format (one an installed plugin registers)."""
    return m.format in pack_formats()


def is_quantized(m: ModuleInfo) -> bool:
    """Whether module ``m`` is stored coded or as int8 rows."""
    return is_coded(m) or m.format in STORAGE_LABELS


def storage_label(m: ModuleInfo) -> str:
    """How messages name module ``m``'s quantized storage (``"an EXL3 trellis"``, ``"int8 rows"``)."""
    fmt = pack_formats().get(m.format)
    return fmt.storage_label if fmt is not None else STORAGE_LABELS[m.format]


def with_article(label: str) -> str:
    """``label`` after its indefinite article (``"an EXL3"``)."""
    return f"{'an' if label[:1].lower() in 'aeiou' else 'a'} {label}"


def main_tensor(m: ModuleInfo) -> str:
    """The suffix of the tensor a module's storage kind lives in: a format's code
    (:attr:`~quantpack_core.format.LinearFormat.main_suffix`), the int8 rows (``qweight`` / ``weight_int8``), else
    ``weight``."""
    fmt = pack_formats().get(m.format)
    if fmt is not None:
        return fmt.main_suffix
    rows = int8_row_names(m.tensors) if m.format == INT8_ROWS else None
    return rows[0] if rows else "weight"


def stored_size_problem(m: ModuleInfo, side: int, want: int, what: str, fix: str) -> list[Problem]:
    """A problem when module ``m`` stores other than ``want`` features on ``side`` (0: inputs, 1: outputs; a coded
    module pads to whole blocks of its format's :attr:`~quantpack_core.format.LinearFormat.block`), the config's
    size described by ``what``."""
    fmt = pack_formats().get(m.format)
    have = m.padded_shape[side]
    expect = -(-want // fmt.block) * fmt.block if fmt is not None else want
    if have == expect:
        return []
    where = "outputs" if side else "inputs"
    return [Problem(m.key, f"{m.key}.{main_tensor(m)}", f"has {have} {where}, but config.json gives {what}", fix)]


def not_a_matrix(m: ModuleInfo, fix: str) -> Problem:
    """A dense linear module, head or table whose weight is not 2-D (vLLM's loaders stopped on a 3-D or 1-D one
    in the worker)."""
    shape = list(m.tensors["weight"].shape)
    return Problem(m.key, f"{m.key}.weight", f"weight is {shape}, not a 2-D (out x in) matrix", fix)


def configured_experts(pack: PackView) -> int | None:
    """The expert count config.json (or its text config) gives (``num_experts``, ``num_local_experts``,
    ``n_routed_experts``), None where it gives none."""
    for cfg in (pack.config, pack.config.get("text_config") or {}):
        if not isinstance(cfg, dict):  # named by the reader already
            continue
        for key in ("num_experts", "num_local_experts", "n_routed_experts"):
            if isinstance(cfg.get(key), int):
                return cfg[key]
    return None


def bias_misfit(bias: TensorInfo, outputs: int) -> str | None:
    """Why a trellis-coded layer's stored ``bias`` cannot be its logical output width (a 1-D tensor within the last
    128-feature block of the ``outputs`` the code stores: the padding never spans a whole block), else None."""
    if len(bias.shape) == 1 and outputs - 128 < bias.shape[0] <= outputs:
        return None
    return f"shape {list(bias.shape)} does not fit the {outputs} output features (padded to 128)"
