"""What a pack holds, as its files' headers describe it (nothing is read beyond them): the tensors
(:class:`TensorInfo`), the modules they form (:class:`ModuleInfo`), each shard file's header as read
(:class:`ShardHeader`), what could not be read (:class:`Unread`), and :class:`PackView`, the interface through which
the pack check (:mod:`quantpack_core.check`) and the formats' rules read an opened pack
(:class:`quantpack_core.pack.Pack`).

Follows the safetensors file layout (8-byte little-endian header length, JSON header, data) and the files
exllamav3's converter writes (docs/exl3-format.md, "Pack files").
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from .codec.codebook import Codebook
from .codec.trellis import TILE, k_from_width
from .errors import CodecError, Problem

INDEX_FILE = "model.safetensors.index.json"
MANIFEST_FILE = "quantization_config.json"
#: the fix of a file whose bytes are not what its writer wrote
FIX_REDOWNLOAD = "re-download the pack (or re-run exllamav3's converter); the file on disk is not what it wrote"

#: safetensors dtype names -> (torch dtype, bytes per element)
SAFETENSORS_DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F64": (torch.float64, 8),
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "U16": (torch.uint16, 2),
    "U32": (torch.uint32, 4),
    "U64": (torch.uint64, 8),
    "BOOL": (torch.bool, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
}

#: the (rows, scales) suffixes of an int8 table with per-row scales: quantpack embed-int8's, and ``weight_int8`` /
#: ``weight_scale`` (the int8-row codec's other naming, :mod:`quantpack_core.codec.int8_rows`)
INT8_ROW_NAMES = (("qweight", "scales"), ("weight_int8", "weight_scale"))
#: the storage kinds of :attr:`ModuleInfo.format` that are no quantized format's
DENSE, INT8_ROWS, OTHER = "dense", "int8-rows", "other"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the safetensors header describes it (nothing is read).

    Attributes:
        name: full tensor name.
        file: the shard file name (relative to the pack).
        dtype: torch dtype.
        shape: tensor shape.
        nbytes: size in bytes.
    """

    name: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class ModuleInfo:
    """Inventory row of one module of a pack.

    Attributes:
        key: HF module name (``model.layers.0.mlp.down_proj``).
        format: the name of the quantized format it is stored in (``"exl3"``: a trellis linear layer; a format an
            installed plugin registers, :func:`quantpack_core.format.pack_formats`), ``"dense"`` (a plain
            ``.weight``), ``"int8-rows"`` (an int8 table with per-row scales, :data:`INT8_ROW_NAMES`) or ``"other"``
            (anything else: exllamav3's 2-D embedding codec, ``A_log``, ``dt_bias`` ...).
        k_bits: bits per weight K of a coded module, else None.
        codebook: codebook of a coded module, else None.
        padded_shape: ``(in, out)`` features as stored (a coded module's: multiples of 128), or None.
        logical_shape: ``(in, out)`` of the model's layer where the pack says it (dense weights; a coded module's
            bias gives ``out``), else None: the padding of a coded layer is only known once the model's layer is
            built.
        dtype: dtype of the main tensor (``int16`` code, or the dense weight's dtype).
        nbytes: bytes of all the module's tensors.
        tensors: suffix -> TensorInfo.
    """

    key: str
    format: str
    k_bits: float | None
    codebook: Codebook | None
    padded_shape: tuple[int, int] | None
    logical_shape: tuple[int | None, int | None] | None
    dtype: torch.dtype | None
    nbytes: int
    tensors: dict[str, TensorInfo] = field(default_factory=dict)


def coded_module(
    key: str, t: dict[str, TensorInfo], nbytes: int, fmt: str, code: str, codebook: Codebook | None
) -> ModuleInfo:
    """A trellis-coded module of format ``fmt`` whose ``(in/16, out/16, 16K)`` code tensor is ``t[code]``: K from its
    width (None when illegal), the padded shape from its tiles, the logical output width from a 1-D bias."""
    tr = t[code]
    try:
        k_bits = k_from_width(tr.shape[-1])
    except CodecError:
        k_bits = None
    padded = (tr.shape[0] * TILE, tr.shape[1] * TILE)
    logical = (None, t["bias"].shape[0]) if "bias" in t and len(t["bias"].shape) == 1 else None
    return ModuleInfo(key, fmt, k_bits, codebook, padded, logical, tr.dtype, nbytes, t)


def int8_row_names(t: dict[str, TensorInfo]) -> tuple[str, str] | None:
    """``(rows, scales)`` suffixes of a module ``t`` stored as an int8 table with per-row scales (either naming of
    :data:`INT8_ROW_NAMES`, the rows int8), else None."""
    for rows, scales in INT8_ROW_NAMES:
        if rows in t and scales in t and t[rows].dtype == torch.int8:
            return rows, scales
    return None


def dtype_name(dtype: torch.dtype | None) -> str:
    """A dtype as messages name it (``int16``), ``-`` for none."""
    return "-" if dtype is None else str(dtype).removeprefix("torch.")


class _DuplicateKey(Exception):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """``json.loads`` object hook: a JSON object, refusing a key given twice (:class:`_DuplicateKey`)."""
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


def read_header(path: Path) -> tuple[dict, int]:
    """Parse a safetensors header. Returns (header without __metadata__, data start offset).

    Raises:
        ValueError: with a message naming what is broken.
    """
    size = path.stat().st_size
    if size < 8:
        raise ValueError(f"file is {size} bytes, too short for a safetensors header")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8 or n > 100 * 1024 * 1024:
            raise ValueError(
                f"header length {n} does not fit in the file's {size} bytes (truncated, or not a safetensors file)"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw, object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"header is not valid JSON ({type(e).__name__}): the file is corrupt") from None
    except _DuplicateKey as e:
        raise ValueError(f"header names {e.key!r} twice: the file is corrupt") from None
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object: the file is corrupt")
    header.pop("__metadata__", None)
    return header, 8 + n


class HeaderEntry:
    """One entry of a safetensors header as read: its dtype, element size, shape and data offsets, or why it cannot
    be read (:attr:`unknown_dtype`: a dtype name this reader does not know; :attr:`malformed`: anything else)."""

    def __init__(self, entry: object):
        self.raw = entry
        kind = entry.get("dtype") if isinstance(entry, dict) else None
        self.unknown_dtype: str | None = kind if isinstance(kind, str) and kind not in SAFETENSORS_DTYPES else None
        self.malformed = False
        if self.unknown_dtype is not None:
            return
        try:
            self.dtype, self.esize = SAFETENSORS_DTYPES[entry["dtype"]]
            self.shape = tuple(int(s) for s in entry["shape"])
            self.start, self.end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError, OverflowError):  # (a JSON 1e999 reads as inf)
            self.malformed = True

    @property
    def readable(self) -> bool:
        return self.unknown_dtype is None and not self.malformed

    @property
    def nbytes(self) -> int:
        """The bytes the dtype and shape take."""
        return math.prod(self.shape) * self.esize


@dataclass
class ShardHeader:
    """One shard file's header as read.

    Attributes:
        file: the file name.
        size: the file's size in bytes (0 where the header could not be read).
        start: where the data starts.
        entries: tensor name -> :class:`HeaderEntry`, in the header's order.
        error: why the header could not be read, or None.
    """

    file: str
    size: int = 0
    start: int = 0
    entries: dict[str, HeaderEntry] = field(default_factory=dict)
    error: str | None = None

    @property
    def end(self) -> int:
        """The largest data offset the readable entries name."""
        return max((e.end for e in self.entries.values() if e.readable), default=0)

    @property
    def truncated(self) -> bool:
        """Whether the header describes more bytes than the file has."""
        return self.error is None and self.start + self.end > self.size


@dataclass
class Unread:
    """What a pack's reader could not read, each as a :class:`~quantpack_core.errors.Problem`, by source, in the
    order read: ``config.json`` (and the pack folder itself), ``quantization_config.json`` (the manifest), and the
    safetensors listing and the index."""

    config: list[Problem] = field(default_factory=list)
    manifest: list[Problem] = field(default_factory=list)
    files: list[Problem] = field(default_factory=list)


class PackView(Protocol):
    """An opened pack as the pack check and the formats' rules read it (:class:`quantpack_core.pack.Pack`).

    Attributes:
        path: the pack directory.
        config: ``config.json`` as a dict (``{}`` where it could not be read).
        quant_config: the quantization config, updated with ``quantization_config.json``.
        stated_quant_config: the quantization config as config.json states it (what vLLM reads).
        config_method: ``quant_method`` as config.json itself says it (what vLLM reads), lowercased.
        manifest: ``tensor_storage`` of ``quantization_config.json`` (module -> entry).
        tensors: tensor name -> TensorInfo (the first of a name stored twice).
        modules: module key -> ModuleInfo.
        files: the shard files read (those the index lists and the pack holds, or the one file).
        present: the ``*.safetensors`` files in the folder (not the n-gram table).
        has_index: whether the pack holds ``model.safetensors.index.json``.
        weight_map: the index's ``weight_map`` as read (its file names strings), None without one.
        headers: each file of :attr:`files` with its header as read.
        unread: what could not be read.
        bad_files: files whose header could not be read, or that are truncated.
        bad_entries: tensors whose header entry could not be read.
        in_absent_shards: tensors the index lists in a file the pack lacks.
    """

    path: Path
    config: dict
    quant_config: dict
    stated_quant_config: dict
    config_method: str
    manifest: dict
    tensors: dict[str, TensorInfo]
    modules: dict[str, ModuleInfo]
    files: list[str]
    present: list[str]
    has_index: bool
    weight_map: dict[str, str] | None
    headers: list[ShardHeader]
    unread: Unread
    bad_files: set[str]
    bad_entries: set[str]
    in_absent_shards: set[str]

    def get_tensor(self, name: str) -> torch.Tensor:
        """Read one tensor (CPU); KeyError for a name the pack lacks."""

    def get_slice(self, name: str) -> Any:
        """safetensors' lazy slice of one tensor (rows read on indexing)."""

    def config_logical_shape(self, m: ModuleInfo) -> tuple[int, int] | None:
        """The logical ``(in, out)`` of a coded module as config.json's sizes give it, or None."""
