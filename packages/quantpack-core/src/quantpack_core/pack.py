"""Open, inventory and validate an EXL3 pack (a checkpoint directory written by exllamav3's converter).

A pack is ``config.json`` (with ``quantization_config``), an optional ``quantization_config.json`` whose
``tensor_storage`` lists every module's stored tensors (the manifest), and either one ``*.safetensors`` file or a
``model.safetensors.index.json`` with its shards. :class:`Pack` reads only the safetensors headers to build the
inventory and check the pack; tensors are read one at a time through safetensors' memory map, so the pack is never
held in host RAM as a whole. Nothing in the directory is ever written.

Follows docs/exl3-format.md ("Tensors of one layer", "Pack files"), exllamav3's
``exllamav3/conversion/convert_model.py`` (what it writes) and the safetensors file layout (8-byte little-endian
header length, JSON header, data).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from safetensors import safe_open

from .check.architectures import activation_rule, layer_sizes, stated_class
from .check.architectures.problems import architecture_problems
from .check.layers import (
    DRAFT_FUSION,
    FIX_DENSE,
    LAYER_KEY,
    OTHER_STACKS,
    decoder_layers,
    is_norm,
    sibling_problems,
    skipped_by_vllm,
    stack_problems,
    sublayer_problems,
    tensor_problems,
)
from .codec import Exl3Tensors, check_marker, unpack_signs
from .codec.codebook import Codebook
from .codec.hadamard import HAD_BLOCK
from .codec.trellis import HALF_K, TILE, k_from_width
from .errors import CodecError, LayerLoadError, PackError, Problem
from .names import FUSED_LAYERS, normalize_prefix, split_tensor_name
from .ngram import NGRAM_FILE, RECOPY

INDEX_FILE = "model.safetensors.index.json"
MANIFEST_FILE = "quantization_config.json"

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

#: suffixes that belong to an EXL3 linear layer
EXL3_SUFFIXES = frozenset({"trellis", "suh", "svh", "su", "sv", "mcg", "mul1", "bias"})

FIX_REDOWNLOAD = "re-download the pack (or re-run exllamav3's converter); the file on disk is not what it wrote"
FIX_REQUANTIZE = "re-quantize this module with exllamav3, or re-download the pack"


#: one expert's projection of an MoE bank: ``<layer>.experts.<e>.<proj>``
EXPERT_MODULE = re.compile(r"^(?P<layer>.+\.experts)\.(?P<e>\d{1,9})\.(?P<proj>[A-Za-z0-9_]+)$")


#: an escha-coded module's code tensor (docs/escha-format.md; quantpack-escha-rocm reads the format, the pack checks
#: its layout and ``layer_meta`` for ``inspect`` and for the escha config, one implementation)
ESCHA_CODE = "escha_code"
#: escha's scale vectors: input side (``(in,)``), then output side (``(out,)``)
ESCHA_IN_SCALES = ("escha_rin", "escha_s_in")
ESCHA_OUT_SCALES = ("escha_rout", "escha_s_out")
#: escha's optional geometry record of its writer (int32 ``[16, K, 2, 1, in, out]``; informational)
ESCHA_CONFIG = "escha_config"
#: storage kinds holding a trellis (K and codebook known)
CODED_FORMATS = ("exl3", "escha")
#: entry-point group of the plugins' dense decoders (``quantpack verify``, the reference model): a coded format's name
#: -> ``decode(tensors, dtype)``, a module's stored tensors by suffix -> the dense tensors of transformers' layer by
#: suffix (``weight`` as ``(out, in)``, ...)
DENSE_DECODERS = "quantpack.dense_decoders"


def dense_decoder(fmt: str):
    """The dense decoder an installed plugin registers for coded format ``fmt`` (:data:`DENSE_DECODERS`).

    Raises:
        CodecError: no installed package registers one.
    """
    from importlib.metadata import entry_points

    for ep in entry_points(group=DENSE_DECODERS):
        if ep.name == fmt:
            return ep.load()
    raise CodecError(
        f"no installed package decodes {fmt!r} modules (entry point group {DENSE_DECODERS}): install the plugin that "
        f"serves {fmt} packs"
    )


FIX_ESCHA_META = "re-download or re-convert the pack"


def escha_meta_key(name: str) -> str:
    """The key an escha module is matched by in ``layer_meta``: its tail from ``layers.`` when it has one (the
    checkpoint's and vLLM's namespaces agree there), else its canonical name
    (:func:`quantpack_core.names.normalize_prefix`). Source: docs/escha-format.md."""
    i = name.find("layers.")
    if i == 0 or (i > 0 and name[i - 1] == "."):
        return name[i:]
    return normalize_prefix(name)


def escha_layer_ks(layer_meta: object) -> dict[str, tuple[str, int]]:
    """``quantization_config.layer_meta`` of an escha pack as ``{match key: (module as listed, K)}``.

    Raises:
        LayerLoadError: ``layer_meta`` is not a mapping, or an entry has no integer K in 1..8 (the entry named).
    """
    meta = layer_meta or {}
    if not isinstance(meta, dict):
        raise LayerLoadError(
            f"quantization_config.layer_meta must map module names to entries, got {type(meta).__name__} - the "
            "pack's config.json is damaged"
        )
    ks: dict[str, tuple[str, int]] = {}
    for name, entry in meta.items():
        k = entry.get("K") if isinstance(entry, dict) else None
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 8:
            if not isinstance(entry, dict):
                said = f"is {entry!r}, not an entry with its K"
            else:
                said = f"has K={k!r}" if "K" in entry else "has no K"
            raise LayerLoadError(
                f"quantization_config.layer_meta[{name!r}] {said}; escha codes need an integer K from 1 to 8 "
                "- the pack's config.json is damaged"
            )
        ks[escha_meta_key(name)] = (name, k)
    return ks


def escha_meta_mismatches(ks: dict[str, tuple[str, int]], widths: dict[str, int]) -> list[tuple[str, str, str]]:
    """Where ``layer_meta`` and the stored codes disagree, as ``(module, what, fix)``, at most one per kind with
    the count of the others: a module storing ``.escha_code`` that ``layer_meta`` does not list (vLLM would build it
    dense and fail deep in its loader), a listed module storing none (``layer_meta`` describes another model), and a
    K that is not the code's (16*K words per tile).

    Args:
        ks: :func:`escha_layer_ks` of the pack's ``layer_meta``.
        widths: every module storing ``.escha_code`` -> that tensor's last dimension (16*K; an illegal width is the
            layout check's to report, not compared here).
    """
    out: list[tuple[str, str, str]] = []
    coded = {m: w // TILE if w % TILE == 0 and 1 <= w // TILE <= 8 else None for m, w in widths.items()}
    stored = {escha_meta_key(m): m for m in coded}

    def more(n: int, what: str = "modules") -> str:
        return f" (and {n - 1} more{' ' + what if what else ''})" if n > 1 else ""

    unlisted = [stored[k] for k in stored if k not in ks]
    if unlisted:
        out.append(
            (
                unlisted[0],
                f"the pack stores .{ESCHA_CODE} for it{more(len(unlisted))} but quantization_config.layer_meta does "
                "not list it, so vLLM would build it as a dense layer",
                "add it to layer_meta with its K, or re-convert the pack",
            )
        )
    absent = [ks[k][0] for k in ks if k not in stored]
    if absent:
        out.append(
            (
                absent[0],
                f"quantization_config.layer_meta lists it{more(len(absent), '')} but the pack stores no "
                f"{absent[0]}.{ESCHA_CODE} - config.json does not describe these tensors",
                FIX_ESCHA_META,
            )
        )
    wrong = [(ks[k][0], ks[k][1], coded[stored[k]]) for k in stored if k in ks and coded[stored[k]] is not None]
    wrong = [w for w in wrong if w[1] != w[2]]
    if wrong:
        name, want, have = wrong[0]
        out.append(
            (
                name,
                f".{ESCHA_CODE} holds K={have} (16*K words per tile), layer_meta says K={want}{more(len(wrong))} - "
                "the pack's config.json does not match its tensors",
                FIX_ESCHA_META,
            )
        )
    return out


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
        format: ``"exl3"`` (a trellis linear layer), ``"escha"`` (an escha-coded one, ``escha_code``),
            ``"dense"`` (a plain ``.weight``), ``"int8-rows"`` (an int8
            table with per-row scales: ``qweight`` / ``scales`` of ``quantpack embed-int8``, escha's
            ``weight_int8`` / ``weight_scale``) or ``"other"`` (anything else: exllamav3's 2-D embedding codec,
            ``A_log``, ``dt_bias`` ...).
        k_bits: bits per weight K of an EXL3 module, else None.
        codebook: codebook of an EXL3 module, else None.
        padded_shape: ``(in, out)`` features as stored (EXL3: multiples of 128), or None.
        logical_shape: ``(in, out)`` of the model's layer where the pack says it (dense weights; an EXL3 bias gives
            ``out``), else None: the padding of an EXL3 layer is only known once the model's layer is built.
        dtype: dtype of the main tensor (``int16`` trellis, or the dense weight's dtype).
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


def _read_header(path: Path) -> tuple[dict, int]:
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


def _bias_misfit(bias: TensorInfo, outputs: int) -> str | None:
    """Why a trellis-coded layer's stored ``bias`` cannot be its logical output width (a 1-D tensor within the last
    128-feature block of the ``outputs`` the code stores: the padding never spans a whole block), else None."""
    if len(bias.shape) == 1 and outputs - 128 < bias.shape[0] <= outputs:
        return None
    return f"shape {list(bias.shape)} does not fit the {outputs} output features (padded to 128)"


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "-" if dtype is None else str(dtype).removeprefix("torch.")


class Pack:
    """An EXL3 pack on disk: its configs, manifest, tensor index and module inventory.

    Use :meth:`open`. Reading a tensor (:meth:`get_tensor`) memory-maps its shard; nothing is cached beyond the open
    file handles.

    Attributes:
        path: the pack directory.
        config: ``config.json`` as a dict.
        quant_config: the quantization config (``config.json``'s ``quantization_config``, or its ``text_config``'s,
            updated with ``quantization_config.json``), ``{}`` if none.
        manifest: ``tensor_storage`` of ``quantization_config.json`` (module -> entry), ``{}`` if absent.
        tensors: tensor name -> TensorInfo, for every tensor in the pack's files.
        modules: module key -> ModuleInfo.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.config: dict = {}
        #: the config the server built (:meth:`open`'s ``model_config``), None to read config.json's
        self.model_config: dict | None = None
        self.quant_config: dict = {}
        self.manifest: dict = {}
        self.tensors: dict[str, TensorInfo] = {}
        self.modules: dict[str, ModuleInfo] = {}
        self.files: list[str] = []
        self._problems: list[Problem] = []
        self._in_absent_shards: set[str] = set()  # tensors already reported through their missing shard file
        self._bad_entries: set[str] = set()  # tensors already reported through their header entry
        self._bad_files: set[str] = set()  # shard files reported unreadable or truncated
        self._config_method = ""  # quant_method as config.json itself says (what vLLM reads)
        self._handles: dict[str, object] = {}
        self._scan()

    # ------------------------------------------------------------------------------------------------ opening

    def __repr__(self) -> str:
        exl3 = sum(1 for m in self.modules.values() if m.format == "exl3")
        return f"Pack({str(self.path)!r}, files={len(self.files)}, modules={len(self.modules)}, exl3={exl3})"

    def close(self) -> None:
        """Release the open safetensors handles (a later read reopens them)."""
        self._handles.clear()

    def __enter__(self) -> Pack:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        *,
        require_exl3: bool = True,
        check_values: bool = True,
        model_config: dict | None = None,
    ) -> Pack:
        """Open and validate a pack.

        Args:
            path: the pack directory.
            require_exl3: fail unless config.json says ``quant_method: "exl3"``.
            check_values: also read every EXL3 module's small tensors (markers, suh, svh: a few KiB each) and the
                other modules' 1-D floating tensors (norm weights, biases, int8 row scales), and check marker values
                and that the vectors are finite.
            model_config: the model's config as the server built it from config.json (vLLM's ``hf_config`` as a
                dict: after ``--hf-overrides``, and with a draft's class renamed); the decoder layers are held against
                the layer of its class (:func:`.check.architectures.problems.architecture_problems`) instead of
                config.json's.

        Returns:
            the Pack.

        Raises:
            PackError: listing every problem found (missing/extra/truncated files and tensors, illegal trellis
                widths, mismatched suh/svh, marker clashes ...), each naming module, tensor and fix.
        """
        pack = cls(path)
        pack.model_config = model_config
        problems = pack.problems(require_exl3=require_exl3, check_values=check_values)
        if problems:
            raise PackError(str(pack.path), problems)
        return pack

    def _problem(self, module: str, tensor: str, what: str, fix: str) -> None:
        self._problems.append(Problem(module, tensor, what, fix))

    def _object(self, value, where: str) -> dict:
        """``value`` if it is a JSON object, else ``{}`` after recording a problem naming ``where``."""
        if isinstance(value, dict):
            return value
        self._problem("", where, f"is {type(value).__name__} {str(value)[:60]!r}, not a JSON object", FIX_REDOWNLOAD)
        return {}

    def _scan(self) -> None:
        if not self.path.is_dir():
            what = "is a file, not a directory" if self.path.exists() else "does not exist"
            self._problem("", str(self.path), what, "point at the pack's folder (it holds config.json)")
            return
        cfg = self.path / "config.json"
        if not cfg.is_file():
            self._problem("", "config.json", "missing", "point at the pack's folder (it holds config.json)")
        else:
            try:
                self.config = self._object(json.loads(cfg.read_text()), "config.json")
            except (ValueError, UnicodeDecodeError, RecursionError) as e:
                self._problem("", "config.json", f"not valid JSON ({type(e).__name__}: {e})", FIX_REDOWNLOAD)
        given = self.config.get("text_config")
        text_config = {} if given is None else self._object(given, "config.json: text_config")
        qc = self._object(
            self.config.get("quantization_config") or text_config.get("quantization_config") or {},
            "config.json: quantization_config",
        )
        self.quant_config = dict(qc)
        self._config_method = str(qc.get("quant_method", "")).lower()
        for key in ("bits", "head_bits"):  # exllamav3 writes numbers; vLLM's config would stop at another value
            v = qc.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 16):
                what = f"{key} is {repr(v)[:40]}, not a bit count in (0, 16]"
                self._problem(
                    "", "config.json: quantization_config", what, "use the config.json the pack was made with"
                )
        mf = self.path / MANIFEST_FILE
        if mf.is_file():
            try:
                extra = self._object(json.loads(mf.read_text()), MANIFEST_FILE)
            except (ValueError, UnicodeDecodeError, RecursionError) as e:
                self._problem("", MANIFEST_FILE, f"not valid JSON ({type(e).__name__}: {e})", FIX_REDOWNLOAD)
                extra = {}
            storage = self._object(extra.get("tensor_storage") or {}, f"{MANIFEST_FILE}: tensor_storage")
            self.manifest = {}
            for module, entry in storage.items():
                entry = self._object(entry or {}, f"{MANIFEST_FILE}: tensor_storage.{module}")
                stored = self._object(entry.get("stored_tensors") or {}, f"{MANIFEST_FILE}: {module}.stored_tensors")
                for name, desc in list(stored.items()):
                    desc = self._object(desc or {}, f"{MANIFEST_FILE}: {module}.stored_tensors.{name}")
                    shape = desc.get("shape")
                    if "shape" in desc and not (
                        isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
                    ):
                        what = f"{MANIFEST_FILE} gives the shape {shape!r}, not a list of sizes"
                        self._problem(module, name, what, FIX_REDOWNLOAD)
                        desc = {k: v for k, v in desc.items() if k != "shape"}
                    stored[name] = desc
                self.manifest[module] = {**entry, "stored_tensors": stored}
            for k, v in extra.items():
                if k != "tensor_storage":
                    self.quant_config.setdefault(k, v)
        self._scan_files()
        self._build_modules()

    def _scan_files(self) -> None:
        index_path = self.path / INDEX_FILE
        present = []
        for entry in sorted(self.path.glob("*.safetensors")):
            if entry.name == NGRAM_FILE:  # an n-gram table, read by its own module (quantpack_core.ngram)
                continue
            if entry.is_file():
                present.append(entry.name)
            elif entry.is_symlink() and not entry.exists():
                self._problem("", entry.name, "a symbolic link to nothing", f"re-download {entry.name}")
            else:
                self._problem("", entry.name, "not a regular file (a directory?)", f"re-download {entry.name}")
        weight_map: dict[str, str] | None = None
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (ValueError, UnicodeDecodeError, KeyError, TypeError, RecursionError) as e:
                self._problem("", INDEX_FILE, f"unreadable ({type(e).__name__}: {e})", FIX_REDOWNLOAD)
                weight_map = None
            if weight_map is not None and not isinstance(weight_map, dict):
                # vLLM's loader looks each name up in it (weight_map[name]): a list of pairs stopped it in the worker
                what = f"weight_map is a JSON {type(weight_map).__name__}, not an object mapping tensor names to files"
                self._problem("", INDEX_FILE, what, FIX_REDOWNLOAD)
                weight_map = None
            odd = {n: f for n, f in (weight_map or {}).items() if not isinstance(f, str)}
            if odd:  # a file name that is a number, null, a list ...: vLLM's loader would stop on it
                name, value = next(iter(odd.items()))
                what = f"weight_map gives {name} the file {json.dumps(value)[:40]}, not a file name"
                more = f" ({len(odd)} such entries)" if len(odd) > 1 else ""
                self._problem("", INDEX_FILE, what + more, FIX_REDOWNLOAD)
                weight_map = {n: f for n, f in weight_map.items() if isinstance(f, str)}
            if weight_map is not None:
                files = sorted(set(weight_map.values()))
                for f in files:
                    if f not in present:
                        names = [n for n, s in weight_map.items() if s == f]
                        self._in_absent_shards.update(names)
                        self._problem(
                            split_tensor_name(names[0])[0],
                            f,
                            f"listed in {INDEX_FILE} for {len(names)} tensors (first: {names[0]}) but the "
                            "file is absent",
                            f"download {f} into {self.path}",
                        )
                self.files = [f for f in files if f in present]
        elif len(present) == 1:
            self.files = present
        elif not present:
            self._problem(
                "",
                "*.safetensors",
                "no safetensors file in the pack",
                "point at the pack's folder, or download its model*.safetensors files",
            )
        else:
            self._problem(
                "",
                INDEX_FILE,
                f"missing while the pack has {len(present)} safetensors files",
                f"download {INDEX_FILE}; it says which tensor lives in which shard",
            )
            self.files = present
        for f in self.files:
            try:
                header, start = _read_header(self.path / f)
            except (ValueError, OSError) as e:
                self._problem("", f, str(e), f"re-download {f}")
                self._bad_files.add(f)
                continue
            size = (self.path / f).stat().st_size
            end_max = 0
            for name, h in header.items():
                kind = h.get("dtype") if isinstance(h, dict) else None
                if isinstance(kind, str) and kind not in SAFETENSORS_DTYPES:
                    self._bad_entries.add(name)
                    what = f"dtype {kind!r} in {f}'s header: not one this check reads (float4 / float6 / complex ...)"
                    known = ", ".join(SAFETENSORS_DTYPES)
                    self._problem(
                        split_tensor_name(name)[0], name, what, f"store it as one of {known}, or re-download {f}"
                    )
                    continue
                try:
                    dtype, esize = SAFETENSORS_DTYPES[h["dtype"]]
                    shape = tuple(int(s) for s in h["shape"])
                    a, b = (int(x) for x in h["data_offsets"])
                except (KeyError, TypeError, ValueError, OverflowError):  # (a JSON 1e999 reads as inf)
                    self._bad_entries.add(name)
                    self._problem(
                        split_tensor_name(name)[0], name, f"header entry in {f} is malformed: {h!r}", f"re-download {f}"
                    )
                    continue
                nbytes = math.prod(shape) * esize
                if b - a != nbytes:
                    self._problem(
                        split_tensor_name(name)[0],
                        name,
                        f"header in {f} gives {b - a} bytes for a {h['dtype']} {list(shape)} tensor ({nbytes} bytes)",
                        f"re-download {f}",
                    )
                end_max = max(end_max, b)
                if weight_map is not None:
                    listed = weight_map.get(name)
                    if listed is None:
                        self._problem(
                            split_tensor_name(name)[0],
                            name,
                            f"present in {f} but not listed in {INDEX_FILE}",
                            f"re-download {INDEX_FILE} (or remove the stray tensor from {f})",
                        )
                    elif listed != f:
                        self._problem(
                            split_tensor_name(name)[0],
                            name,
                            f"present in {f} but {INDEX_FILE} says it lives in {listed}",
                            f"re-download {INDEX_FILE} and the shards",
                        )
                if name in self.tensors:
                    self._problem(
                        split_tensor_name(name)[0],
                        name,
                        f"stored twice ({self.tensors[name].file} and {f})",
                        "keep one copy",
                    )
                    continue
                self.tensors[name] = TensorInfo(name, f, dtype, shape, nbytes)
            if start + end_max > size:
                self._problem(
                    "",
                    f,
                    f"truncated: the header describes {start + end_max} bytes, the file has {size}",
                    f"re-download {f}",
                )
                self._bad_files.add(f)
        if weight_map is not None:
            for name, f in weight_map.items():
                if f in self.files and name not in self.tensors:
                    self._problem(
                        split_tensor_name(name)[0],
                        name,
                        f"listed in {INDEX_FILE} under {f} but absent from that file",
                        f"re-download {f}",
                    )

    def _build_modules(self) -> None:
        groups: dict[str, dict[str, TensorInfo]] = {}
        for name, info in self.tensors.items():
            module, suffix = split_tensor_name(name)
            groups.setdefault(module, {})[suffix] = info
        for key in sorted(groups):
            t = groups[key]
            nbytes = sum(i.nbytes for i in t.values())
            if "trellis" in t and len(t["trellis"].shape) == 3:
                self.modules[key] = self._exl3_module(key, t, nbytes)
            elif ESCHA_CODE in t and len(t[ESCHA_CODE].shape) == 3:
                self.modules[key] = self._escha_module(key, t, nbytes)
            elif (t.keys() & {"suh", "svh", "su", "sv", "mcg", "mul1"}) and "trellis" not in t and "weight" not in t:
                # the vectors of an EXL3 layer whose trellis is gone
                self.modules[key] = ModuleInfo(key, "exl3", None, None, None, None, None, nbytes, t)
            elif (names := self._int8_row_names(t)) is not None:
                rows = t[names[0]]
                shape = (rows.shape[1], rows.shape[0]) if len(rows.shape) == 2 else None
                self.modules[key] = ModuleInfo(key, "int8-rows", None, None, shape, shape, rows.dtype, nbytes, t)
            elif "weight" in t and "trellis" not in t:
                w = t["weight"]
                shape = (w.shape[1], w.shape[0]) if len(w.shape) == 2 else None
                self.modules[key] = ModuleInfo(key, "dense", None, None, shape, shape, w.dtype, nbytes, t)
            else:
                main = next(iter(t.values()))
                self.modules[key] = ModuleInfo(key, "other", None, None, None, None, main.dtype, nbytes, t)

    #: the (rows, scales) suffixes of an int8 table with per-row scales: quantpack embed-int8's, escha's
    INT8_ROW_NAMES = (("qweight", "scales"), ("weight_int8", "weight_scale"))

    @classmethod
    def _int8_row_names(cls, t: dict[str, TensorInfo]) -> tuple[str, str] | None:
        """``(rows, scales)`` suffixes of a module ``t`` stored as an int8 table with per-row scales (either naming
        of :data:`INT8_ROW_NAMES`, the rows int8), else None."""
        for rows, scales in cls.INT8_ROW_NAMES:
            if rows in t and scales in t and t[rows].dtype == torch.int8:
                return rows, scales
        return None

    def _escha_module(self, key: str, t: dict[str, TensorInfo], nbytes: int) -> ModuleInfo:
        """An escha-coded module (docs/escha-format.md): the mcg trellis in ``escha_code``."""
        return self._coded_module(key, t, nbytes, "escha", ESCHA_CODE, Codebook.MCG)

    def _exl3_module(self, key: str, t: dict[str, TensorInfo], nbytes: int) -> ModuleInfo:
        """An EXL3 module: the trellis in ``trellis``, the codebook from its markers (None when both are set)."""
        codebook = None if ("mcg" in t and "mul1" in t) else Codebook.from_markers("mcg" in t, "mul1" in t)
        return self._coded_module(key, t, nbytes, "exl3", "trellis", codebook)

    @staticmethod
    def _coded_module(
        key: str, t: dict[str, TensorInfo], nbytes: int, fmt: str, code: str, codebook: Codebook | None
    ) -> ModuleInfo:
        """A trellis-coded module whose ``(in/16, out/16, 16K)`` code tensor is ``t[code]``: K from its width (None
        when illegal), the padded shape from its tiles, the logical output width from a 1-D bias."""
        tr = t[code]
        try:
            k_bits = k_from_width(tr.shape[-1])
        except CodecError:
            k_bits = None
        padded = (tr.shape[0] * TILE, tr.shape[1] * TILE)
        logical = (None, t["bias"].shape[0]) if "bias" in t and len(t["bias"].shape) == 1 else None
        return ModuleInfo(key, fmt, k_bits, codebook, padded, logical, tr.dtype, nbytes, t)

    # --------------------------------------------------------------------------------------------- validation

    def problems(self, *, require_exl3: bool = True, check_values: bool = True) -> list[Problem]:
        """Every defect of the pack (empty list when it is sound). Reads only headers, plus each EXL3 module's
        markers and suh/svh and the other modules' 1-D floating tensors (norms, biases, row scales) when
        ``check_values``."""
        out = list(self._problems)
        if require_exl3 and self.config and self._config_method != "exl3":
            said = (
                f"says quantization_config.quant_method {self._config_method!r}"
                if self._config_method
                else "has no quantization_config.quant_method"
            )
            if not self._config_method and str(self.quant_config.get("quant_method", "")).lower() == "exl3":
                fix = (
                    f"copy the quantization_config of {MANIFEST_FILE} (without tensor_storage) into config.json: "
                    "vLLM reads the method from config.json only"
                )
            else:
                fix = "point at an EXL3 pack (made by exllamav3's converter)"
            out.append(Problem("", "config.json", f"{said}, not 'exl3'", fix))
        for m in self.modules.values():
            if m.format in self.STORAGE_LABELS and is_norm(m.key):
                out.append(self._coded_norm_problem(m))
            elif m.format == "int8-rows" and LAYER_KEY.search(m.key):
                out.append(self._int8_rows_in_layer_problem(m))
            if m.format in ("exl3", "escha") and m.key.rsplit(".", 1)[-1] in self.TOKEN_EMBEDDINGS:
                out.append(self._coded_embedding_problem(m))
            elif m.format == "escha" and self._config_method == "exl3":
                what = (
                    "an escha-coded module in an EXL3 pack (config.json's quant_method 'exl3'): the exl3 plugin loads "
                    "EXL3 trellises and dense weights, so vLLM's loader would stop in the worker"
                )
                fix = "re-convert the pack in one format (an escha pack says quant_method 'escha' in config.json)"
                out.append(Problem(m.key, f"{m.key}.{ESCHA_CODE}", what, fix))
            if m.format == "exl3":
                out.extend(self._exl3_problems(m, check_values))
            elif m.format == "escha":
                out.extend(self._escha_problems(m, check_values))
            else:
                out.extend(self._int8_pair_problems(m))
                out.extend(self._dense_dtype_problems(m))
                if check_values and m.format in ("dense", "int8-rows", "other"):
                    out.extend(self._vector_problems(m))
        out.extend(self._escha_meta_problems())
        out.extend(self._moe_problems())
        out.extend(self._fused_problems())
        out.extend(self._manifest_problems())
        out.extend(self._unindexed_problems())
        out.extend(self._config_problems())
        out.extend(stray_tensor_problems(self))
        out.extend(tokenizer_problems(self))
        out.extend(codebook_mixture_problems(self))
        out.extend(head_count_problems(self))
        if check_values:
            out.extend(padding_problems(self))
        named = {p.module for p in out}
        out.extend(p for p in self._layout_problems() if p.module not in named)
        return out

    @staticmethod
    def _dense_dtype_problems(m: ModuleInfo) -> list[Problem]:
        """A dense module's ``weight`` or ``bias`` stored as integers or booleans: vLLM's loader copies it into its
        floating parameter, converting each integer as a number (a float16 norm stored as its bits in uint16 then
        holds values in the tens of thousands): served without an error, and wrong."""
        if m.format != "dense":
            return []
        return [
            Problem(
                m.key,
                f"{m.key}.{suffix}",
                f"dtype {_dtype_name(m.tensors[suffix].dtype)}: a dense {suffix} is a floating tensor",
                "store it as float16, bfloat16 or float32 (as exllamav3's converter does), or re-download the pack",
            )
            for suffix in ("weight", "bias")
            if suffix in m.tensors and not m.tensors[suffix].dtype.is_floating_point
        ]

    @classmethod
    def _main_tensor(cls, m: ModuleInfo) -> str:
        """The suffix of the tensor a module's storage kind lives in: ``trellis`` (EXL3), ``escha_code``, the int8
        rows (``qweight`` / ``weight_int8``), else ``weight``."""
        rows = cls._int8_row_names(m.tensors)
        main = {"exl3": "trellis", "escha": ESCHA_CODE, "int8-rows": rows[0] if rows else ""}.get(m.format)
        return main or "weight"

    #: how the quantized storage kinds of :attr:`ModuleInfo.format` are named in messages
    STORAGE_LABELS: ClassVar[dict[str, str]] = {
        "exl3": "an EXL3 trellis",
        "escha": "escha code",
        "int8-rows": "int8 rows",
    }

    def _coded_norm_problem(self, m: ModuleInfo) -> Problem:
        """A norm (:func:`~.check.layers.is_norm`) stored quantized: vLLM builds every norm without the
        quantization config and loads a dense weight only, so its loader would stop in the worker."""
        code = self._main_tensor(m)
        what = (
            f"a norm stored as {self.STORAGE_LABELS[m.format]}: vLLM builds norms without the quantization config "
            "and loads a dense weight only, so its loader would stop in the worker"
        )
        return Problem(m.key, f"{m.key}.{code}", what, FIX_DENSE)

    def _int8_rows_in_layer_problem(self, m: ModuleInfo) -> Problem:
        """A module of a decoder layer (or a tower's) stored as int8 rows: the plugins serve int8 rows through their
        embedding method only, which vLLM builds for token embeddings and heads, never inside a layer; a projection
        so stored stops the load in the worker (vLLM: "There is no module or parameter named ...qweight"; a fused
        q / k / v or gate / up: the plugin's LayerLoadError)."""
        what = (
            "stored as int8 rows, which the plugins serve for token embeddings and heads only (`quantpack "
            "embed-int8`'s tables): vLLM's layer here loads a trellis or a dense weight, so its load would stop in "
            "the worker"
        )
        fix = "store the module as exllamav3's converter writes it (a trellis or a dense weight): re-convert the pack"
        return Problem(m.key, f"{m.key}.{self._main_tensor(m)}", what, fix)

    #: the last names of token embedding tables (vLLM's ``VocabParallelEmbedding``: Llama's ``embed_tokens``, GPT-2's
    #: ``wte``, BERT-style ``word_embeddings``, GPT-NeoX's ``embed_in``)
    TOKEN_EMBEDDINGS = ("embed_tokens", "wte", "word_embeddings", "embed_in")

    def _coded_embedding_problem(self, m: ModuleInfo) -> Problem:
        """A token embedding stored as a trellis or escha code: vLLM's embedding loads a dense table, or int8 rows
        through the project's embedding method (:mod:`quantpack_core.vllm.embedding`), nothing else; its loader
        would stop in the worker ("There is no module or parameter named 'embed_tokens.mul1'", vLLM 0.32)."""
        code = self._main_tensor(m)
        what = (
            f"the token embedding stored as {self.STORAGE_LABELS[m.format]}: vLLM's embedding takes a dense table or "
            "int8 rows only, so its loader would stop in the worker"
        )
        fix = (
            "store the table dense, as exllamav3's converter does (then `quantpack embed-int8` makes it int8 rows, "
            "half its bf16 size): re-convert the pack, or re-download it if it was altered"
        )
        return Problem(m.key, f"{m.key}.{code}", what, fix)

    def _layout_problems(self) -> list[Problem]:
        """Modules of the decoder layers that cannot be absent given those present (:mod:`.check.layers`):
        a gated MLP's or an attention block's missing member, a module every other instance of its parent holds, a
        layer short of a sublayer its stack's other layers hold, a plain module's tensor every other layer's has
        (the last three not for DeciLM's ``block_configs``, whose no-op blocks hold fewer by design); and for the
        model classes whose layer the project states (:func:`~.check.architectures.architecture_layer`), the layers
        against it, at any layer count. Nothing where a shard file could not be read: its modules are reported
        through the file, not one by one as missing."""
        if self._bad_files:
            return []
        cfg = self.config.get("text_config") if isinstance(self.config.get("text_config"), dict) else self.config
        layers = cfg.get("num_hidden_layers") if isinstance(cfg, dict) else None
        layers = layers if isinstance(layers, int) and not isinstance(layers, bool) and layers > 0 else None
        stacks = decoder_layers(self.modules, OTHER_STACKS, layers)
        blocks = isinstance(cfg, dict) and isinstance(cfg.get("block_configs"), list)
        out = [] if blocks else sublayer_problems(stacks)
        out += sibling_problems(stacks, lone=not blocks)
        out += stack_problems(stacks, self.modules, OTHER_STACKS, self.config)
        if not blocks:
            own = {k: set(m.tensors) for k, m in self.modules.items() if m.format in ("dense", "other")}
            out += tensor_problems(stacks, own, self.modules)
        # the layer vLLM builds for the config's class, where the rules above did not name the module or its parent
        built = self._built_config()
        named = {p.module for p in out}
        out += [
            p
            for p in architecture_problems(stacks, {k: set(m.tensors) for k, m in self.modules.items()}, built)
            if not any(p.module == n or p.module.startswith(n + ".") for n in named)
        ]
        return list({p.module: p for p in reversed(out)}.values())[::-1]  # one problem per module, the first

    #: config.json sizes that must be positive integers where they are given (num_experts may be 0: a dense model)
    CONFIG_SIZES = (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "head_dim",
        "moe_intermediate_size",
        "num_experts_per_tok",
    )
    #: sizes 0 is a legal value of (a dense model: Granite 4.0's dense variants say num_experts_per_tok 0)
    ZERO_SIZES = frozenset({"num_experts", "num_experts_per_tok"})
    #: sizes a config may give per layer or per modality as a list (Gemma 3n's intermediate_size, ERNIE-4.5-VL's
    #: moe_intermediate_size)
    LIST_SIZES = frozenset({"intermediate_size", "moe_intermediate_size"})

    def _config_problems(self) -> list[Problem]:
        """config.json against itself and the tensors, before vLLM builds the model from it: ``architectures`` a
        non-empty list of names; the sizes vLLM reads positive integers; every decoder layer the config counts
        present in the pack (a layer missing from both the files and the manifest would otherwise fail in vLLM's
        worker; DeciLM's blocks whose attention and FFN are both no-ops store none); the token embedding as wide as
        ``hidden_size`` (OPT's ``word_embed_proj_dim``) and at least ``vocab_size`` rows long."""
        if not self.config:
            return []
        out: list[Problem] = []
        fix = "use the config.json the pack was made with (re-download the pack)"
        arch = self.config.get("architectures")
        if not (isinstance(arch, list) and arch and all(isinstance(a, str) and a for a in arch)):
            out.append(Problem("", "config.json", f"architectures is {arch!r}, not a list of model class names", fix))
        text = self.config.get("text_config")
        cfg = text if isinstance(text, dict) and text else self.config
        sizes: dict[str, int] = {}
        for where, c in (("config.json", self.config), ("config.json: text_config", text)):
            if not isinstance(c, dict):
                continue
            for key in (*self.CONFIG_SIZES, "num_experts"):
                v = c.get(key)
                if v is None:
                    continue
                low = 0 if key in self.ZERO_SIZES else 1
                per_layer = key in self.LIST_SIZES and isinstance(v, list) and v
                values = v if per_layer else [v]
                if any(isinstance(x, bool) or not isinstance(x, int) or x < low for x in values):
                    kind = "an integer" + (" or a list of them" if key in self.LIST_SIZES else "")
                    what = f"{key} is {repr(v)[:60]} ({type(v).__name__}), not {kind} >= {low}"
                    out.append(Problem("", where, what, fix))
                elif c is cfg and not per_layer:
                    sizes[key] = v
        out.extend(self._value_setting_problems(cfg, sizes, fix))
        layers = sizes.get("num_hidden_layers")
        present = set()
        for key in self.modules:
            m = re.search(r"(?:^|\.)layers\.(\d+)\.", key)
            if m and len(m.group(1)) > 9:  # (an index of thousands of digits would not even convert to int)
                what = f"a layer index of {len(m.group(1))} digits: no model has that many layers"
                short = f"{key[:60]}..."
                out.append(Problem(short, short, what, "the pack is damaged: re-download it"))
            elif m and not OTHER_STACKS.search(key[: m.start() + 1]):
                present.add(int(m.group(1)))
        # DeciLM (Nemotron Ultra / Super): a block whose attention and FFN are both no-ops stores no tensor
        blocks = cfg.get("block_configs")
        empty = set()
        if isinstance(blocks, list):
            for i, b in enumerate(blocks):
                if isinstance(b, dict) and all(
                    isinstance(b.get(part), dict) and b[part].get("no_op") is True for part in ("attention", "ffn")
                ):
                    empty.add(i)
        present |= empty
        if layers is not None and present:
            count = layers - len({i for i in present if i < layers})  # never materializes range(layers)
            missing, i = [], 0
            while len(missing) < min(count, 8):
                if i not in present:
                    missing.append(i)
                i += 1
            if count:
                shown = ", ".join(map(str, missing)) + (f" ... ({count} in all)" if count > len(missing) else "")
                what = f"num_hidden_layers is {layers}, but the pack holds no tensor of layer(s) {shown}"
                out.append(Problem("", "config.json", what, "the pack is incomplete (re-download it), or " + fix))
        if layers is not None and not isinstance(blocks, list):
            out.extend(self._layer_norm_problems(layers))
        # a layer past the config's count (vLLM's loader finds no module for it and stops in the worker); DeepSeek's
        # multi-token-prediction layers follow the decoder's as model.layers.<num_hidden_layers + i>
        nextn = cfg.get("num_nextn_predict_layers")
        nextn = nextn if isinstance(nextn, int) and not isinstance(nextn, bool) and nextn > 0 else 0
        if layers is not None:
            extra = sorted(i for i in present - empty if i >= layers + nextn)
            if extra:
                shown = ", ".join(map(str, extra[:8])) + (f" ... ({len(extra)} in all)" if len(extra) > 8 else "")
                first = next(k for k in sorted(self.modules) if re.search(rf"(?:^|\.)layers\.{extra[0]}\.", k))
                what = (
                    f"holds tensors of layer(s) {shown} ({first}, ...), past config.json's num_hidden_layers {layers}"
                    + (f" + num_nextn_predict_layers {nextn}" if nextn else "")
                    + ": vLLM's loader has no module for them"
                )
                out.append(Problem("", "config.json", what, "remove those tensors from a copy of the pack, or " + fix))
        out.extend(self._attention_shape_problems(cfg, sizes, fix))
        out.extend(self._mlp_shape_problems(cfg, sizes, fix))
        out.extend(self._head_and_norm_shape_problems(cfg, sizes, fix))
        out.extend(self._stated_size_problems(fix))
        out.extend(self._outside_layer_problems())
        for key, m in self.modules.items():
            if not key.endswith("embed_tokens") or m.format not in ("dense", "int8-rows") or m.padded_shape is None:
                continue
            width, rows = m.padded_shape
            name = f"{key}.{'weight' if m.format == 'dense' else next(iter(m.tensors))}"
            # OPT embeds at word_embed_proj_dim and projects up; Mllama adds 8 image-token rows past vocab_size
            # (:data:`ADDED_EMBEDDING_ROWS`)
            want_width = cfg.get("word_embed_proj_dim") or sizes.get("hidden_size")
            if isinstance(want_width, int) and width != want_width:
                what = f"is {rows} x {width}, but config.json gives hidden_size {want_width}"
                out.append(Problem(key, name, what, fix))
            vocab = sizes.get("vocab_size")
            if vocab is not None and rows < vocab:
                what = f"has {rows} rows, fewer than config.json's vocab_size {vocab}"
                out.append(Problem(key, name, what, fix))
            elif vocab is not None and rows - vocab >= HAD_BLOCK and rows - vocab != self._added_rows():
                # a model may pad its vocabulary (1,024 rows for 1,000 tokens): the plugins' embedding then keeps the
                # vocabulary's rows (quantpack_core.vllm.embedding), as a coded head's padding stays within a block
                what = (
                    f"has {rows} rows, {rows - vocab} more than config.json's vocab_size {vocab}: more than the "
                    f"padding of a vocabulary (under {HAD_BLOCK} rows)"
                )
                out.append(Problem(key, name, what, fix))
        return out

    #: config.json's norm epsilons (Llama's rms_norm_eps, OPT's / Phi's layer_norm_eps, Falcon's
    #: layer_norm_epsilon, Mistral-format norm_eps)
    EPSILONS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps")

    def _value_setting_problems(self, cfg: dict, sizes: dict[str, int], fix: str) -> list[Problem]:
        """config.json's settings whose value vLLM takes without a check and then serves NaN with, or stops on at
        the first request: a norm epsilon that is not a number strictly between 0 and 1 (negative, NaN or 1e30 gave
        NaN or garbage logits), a RoPE base (``rope_theta``, top level or in ``rope_parameters``, per layer type
        too) that is not a positive finite number (NaN logits), and, for a model with experts, ``num_experts_per_tok``
        outside 1 .. the expert count (vLLM's router stopped on the first request: "selected index k out of range";
        0 with 8 experts killed the process with SIGFPE)."""
        out: list[Problem] = []

        def number(v) -> bool:
            return isinstance(v, int | float) and not isinstance(v, bool)

        for key in self.EPSILONS:
            v = cfg.get(key)
            if number(v) and not 0 < v < 1:
                out.append(Problem("", "config.json", f"{key} is {v!r}, not a number between 0 and 1", fix))
        for where, d in self._rope_settings(cfg):
            v = d.get("rope_theta")
            if number(v) and not (v > 0 and (isinstance(v, int) or math.isfinite(v))):
                out.append(Problem("", "config.json", f"{where}rope_theta is {v!r}, not a positive number", fix))
        experts = self._configured_experts()
        topk = sizes.get("num_experts_per_tok")
        if experts and topk is not None and not 1 <= topk <= experts:
            what = f"num_experts_per_tok is {topk}, but a token can pick 1 to {experts} experts (the expert count)"
            out.append(Problem("", "config.json", what, fix))
        return out + self._built_setting_problems(fix)

    #: RoPE types vLLM's ``get_rope`` builds (vllm/model_executor/layers/rotary_embedding/__init__.py: the union of
    #: 0.22.1's to 0.32's; 0.22 has ``xdrope``, 0.29 ``telechat3-yarn``, 0.32 ``bailing_mrope``), and the legacy
    #: names vLLM's config patch renames (``su``: longrope, ``mrope``: default, ``telechat3-yarn``: yarn from 0.31).
    #: Another name, or null, stopped vLLM in the worker: "Unknown RoPE scaling type".
    ROPE_TYPES = frozenset(
        {
            "default",
            "linear",
            "dynamic",
            "ntk",
            "yarn",
            "deepseek_yarn",
            "deepseek_llama_scaling",
            "longrope",
            "llama3",
            "mllama4",
            "proportional",
            "openpangu",
            "xdrope",
            "bailing_mrope",
            "telechat3-yarn",
            "su",
            "mrope",
        }
    )
    #: config.json's names of the RoPE base and of the rotated fraction of a head (vLLM's ``patch_rope_parameters``
    #: reads the alternatives of older model files)
    ROPE_BASES = ("rope_theta", "rotary_emb_base")
    ROTARY_FRACTIONS = ("partial_rotary_factor", "rotary_pct", "rotary_emb_fraction")

    @staticmethod
    def _rope_settings(cfg: dict) -> list[tuple[str, dict]]:
        """The dicts of config ``cfg`` that hold RoPE settings, each with the prefix its keys are named by in a
        message: the config itself (``""``), ``rope_parameters`` / ``rope_scaling`` (``"rope_scaling."``), or each
        layer type's dict of a nested one (``"rope_parameters.full_attention."``: vLLM's
        ``is_rope_parameters_nested``, dicts under layer-type keys, null ones skipped)."""
        out: list[tuple[str, dict]] = [("", cfg)]
        for key in ("rope_parameters", "rope_scaling"):
            v = cfg.get(key)
            if isinstance(v, dict):
                nested = [(f"{key}.{k}.", d) for k, d in v.items() if isinstance(d, dict)]
                per_type = nested and all(isinstance(d, dict) or d is None for d in v.values())
                out += nested if per_type else [(f"{key}.", v)]
        return out

    def _built_setting_problems(self, fix: str) -> list[Problem]:
        """Settings of the config vLLM builds (:meth:`_built_config`'s text part: after ``--hf-overrides``) that vLLM
        takes without a check in the user's process and then stops on in the worker: a RoPE type ``get_rope`` does
        not build (top level, in ``rope_parameters`` / ``rope_scaling``, per layer type too); a RoPE base or rotated
        fraction that is no number (``"10000"``: a TypeError in ``get_rope``); a rotated fraction outside (0, 1]
        (``get_rope`` raises); for the stated classes (:data:`~.check.architectures.KNOWN_LAYERS`), a fraction that
        rotates an odd number of a head's features (vLLM's rotary tables then disagree with the rotated width: a
        shape error, and on CPU a crash of the process) and an activation their MLP is not built with
        (:func:`~.check.architectures.activation_rule`)."""
        built = self._built_config()
        text = built.get("text_config") if isinstance(built, dict) else None
        cfg = text if isinstance(text, dict) and text else built if isinstance(built, dict) else {}
        out: list[Problem] = []

        def number(v) -> bool:  # (a JSON integer of hundreds of digits is a number too: no float of it is taken)
            return isinstance(v, int | float) and not isinstance(v, bool) and (isinstance(v, int) or math.isfinite(v))

        rope_sets = self._rope_settings(cfg)
        fractions: list[tuple[str, float]] = []  # (where, a fraction in (0, 1])
        seen_fractions: list = []
        absent = object()
        for where, d in rope_sets:
            kind_key = "rope_type" if "rope_type" in d else "type"
            kind = d.get(kind_key, absent) if where else absent
            if kind is not absent and not (isinstance(kind, str) and kind in self.ROPE_TYPES):
                known = ", ".join(sorted(self.ROPE_TYPES))
                what = f"{where}{kind_key} is {repr(kind)[:60]}: vLLM builds no such RoPE (it knows {known})"
                out.append(Problem("", "config.json", what, fix))
            for key in self.ROPE_BASES:  # (a number that is no positive finite one: _value_setting_problems)
                v = d.get(key)
                # Step-3.5 gives one base per layer (its model file picks rope_theta[layer_idx])
                per_layer = isinstance(v, list) and v and all(number(x) for x in v)
                if v is not None and not (number(v) or per_layer):
                    out.append(Problem("", "config.json", f"{where}{key} is {repr(v)[:60]}, not a number", fix))
            for key in self.ROTARY_FRACTIONS:
                v = d.get(key)
                if v is None or any(v == seen for seen in seen_fractions):  # one problem per value
                    continue
                seen_fractions.append(v)
                if not number(v) or not 0 < v <= 1:
                    what = f"{where}{key} is {repr(v)[:60]}, not a number in (0, 1]"
                    out.append(Problem("", "config.json", what, fix))
                else:
                    fractions.append((f"{where}{key}", v))
        arch = stated_class(built)
        if arch is None:
            return out
        head_dim = cfg.get("head_dim")
        hidden, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
        if head_dim is None and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (hidden, heads)):
            head_dim = hidden // heads
        if isinstance(head_dim, int) and not isinstance(head_dim, bool) and 0 < head_dim < 1 << 31:
            for where, v in fractions:
                if any(d.get("rope_dim") for w, d in rope_sets if w):  # vLLM then rotates rope_dim features
                    continue
                rotated = int(head_dim * v)
                if rotated < 2 or rotated % 2:
                    what = (
                        f"{where} is {v!r}: it rotates {rotated} of a head's {head_dim} features, and vLLM's {arch} "
                        "rotates features in pairs"
                    )
                    out.append(Problem("", "config.json", what, fix))
        rule = activation_rule(arch, cfg)
        act = cfg.get(rule.key) if rule else None
        if act is not None and not rule.takes(act):
            names = " / ".join(sorted(rule.allowed))
            out.append(
                Problem(
                    "", "config.json", f"{rule.key} is {act!r}, but vLLM's {arch} builds its MLP with {names} only", fix
                )
            )
        return out

    #: architecture name prefix -> rows its model adds to the embedding past vocab_size (Mllama's 8 image tokens:
    #: transformers' and vLLM's mllama.py build ``vocab_size + 8`` rows)
    ADDED_EMBEDDING_ROWS: ClassVar[dict[str, int]] = {"Mllama": 8}

    def _added_rows(self) -> int:
        """Rows the pack's architecture adds to its embedding table past ``vocab_size`` (0 for most models)."""
        names = self.config.get("architectures")
        for arch in names if isinstance(names, list) else []:
            for prefix, rows in self.ADDED_EMBEDDING_ROWS.items():
                if isinstance(arch, str) and arch.startswith(prefix):
                    return rows
        return 0

    def _layer_norm_problems(self, layers: int) -> list[Problem]:
        """A decoder layer without a norm (``layers.N.<...norm...>``, a dense module directly under the layer) that
        more than half of the stack's first ``layers`` layers hold: vLLM checks that every weight was loaded only for
        unquantized models (``DefaultModelLoader.load_weights``), so such a layer would serve with the norm's
        initial ones, silently wrong. DeciLM (``block_configs``, whose no-op blocks lack norms) is not checked here."""
        held: dict[tuple[str, str], set[int]] = {}
        stack_layers: dict[str, set[int]] = {}
        for key, m in self.modules.items():
            found = re.search(r"(?:^|\.)layers\.(\d{1,9})\.(?:([^.]*norm[^.]*)$)?", key)
            if not found or OTHER_STACKS.search(key[: found.start() + 1]) or int(found.group(1)) >= layers:
                continue
            stack = key[: found.start(1)]
            stack_layers.setdefault(stack, set()).add(int(found.group(1)))
            if found.group(2) and m.format == "dense":
                held.setdefault((stack, found.group(2)), set()).add(int(found.group(1)))
        out = []
        for (stack, norm), have in sorted(held.items()):
            lack = sorted(stack_layers[stack] - have)
            if lack and 2 * len(have) > len(stack_layers[stack]):
                shown = ", ".join(map(str, lack[:8])) + (f" ... ({len(lack)} in all)" if len(lack) > 8 else "")
                tensor = f"{stack}{lack[0]}.{norm}.weight"
                what = (
                    f"layer(s) {shown} hold no {norm} while {len(have)} of the stack's {len(stack_layers[stack])} "
                    "layers do: vLLM would serve them with the norm's initial ones, without a word"
                )
                out.append(Problem(f"{stack}{lack[0]}.{norm}", tensor, what, "the pack is incomplete: re-download it"))
        return out

    def _unindexed_problems(self) -> list[Problem]:
        """Files a model needs that the pack's index does not list, so copies of a pack often lack them: the hashed
        n-gram table of a model with per-layer n-gram embeddings (config ``ple_layer_ids``: Qwen3.8-Flash-Next).
        Source: docs/families.md (Flash-Next PLE)."""
        for cfg in (self.config, self.config.get("text_config") or {}):
            if isinstance(cfg, dict) and cfg.get("ple_layer_ids") and not (self.path / NGRAM_FILE).is_file():
                what = (
                    f"missing: config.json gives per-layer n-gram embeddings (ple_layer_ids {cfg['ple_layer_ids']}), "
                    "whose table is stored outside the index"
                )
                return [Problem("", NGRAM_FILE, what, f"{RECOPY} into {self.path}")]
        return []

    def _attention_shape_problems(self, cfg: dict, sizes: dict[str, int], fix: str) -> list[Problem]:
        """Attention projections against the config's heads: k / v give ``num_key_value_heads x head_dim`` outputs,
        o takes ``num_attention_heads x head_dim`` inputs (stored sizes, padded to 128 for EXL3). q is left alone:
        gated attention (Qwen3-Next, Qwen3.5) stores twice its heads' width there."""
        heads = sizes.get("num_attention_heads")
        if heads is None:
            return []
        kv = sizes.get("num_key_value_heads", heads)
        head_dim = sizes.get("head_dim") or (sizes["hidden_size"] // heads if "hidden_size" in sizes else None)
        if not head_dim:
            return []
        out: list[Problem] = []
        for key, m in self.modules.items():
            name = key.rsplit(".", 1)[-1]
            if m.padded_shape is None or ".self_attn." not in key or OTHER_STACKS.search(key):
                continue
            if name in ("k_proj", "v_proj"):
                side, want, what = 1, kv * head_dim, f"num_key_value_heads {kv} x head_dim {head_dim}"
            elif name == "o_proj":
                side, want, what = 0, heads * head_dim, f"num_attention_heads {heads} x head_dim {head_dim}"
            else:
                continue
            out.extend(self._stored_size_problem(m, side, want, f"{what} = {want}", fix))
        return out

    @staticmethod
    def _stored_size_problem(m: ModuleInfo, side: int, want: int, what: str, fix: str) -> list[Problem]:
        """A problem when module ``m`` stores other than ``want`` features on ``side`` (0: inputs, 1: outputs;
        EXL3 pads to whole 128-feature blocks), the config's size described by ``what``."""
        have = m.padded_shape[side]
        expect = -(-want // HAD_BLOCK) * HAD_BLOCK if m.format in ("exl3", "escha") else want
        if have == expect:
            return []
        tensor = f"{m.key}.{Pack._main_tensor(m)}"
        where = "outputs" if side else "inputs"
        return [Problem(m.key, tensor, f"has {have} {where}, but config.json gives {what}", fix)]

    #: the norms of a decoder layer over its hidden state (not q_norm / k_norm, which some models size per head and
    #: others per head group), and the language model's final norm
    HIDDEN_NORMS = re.compile(
        r"(?:^|\.)(?:layers\.\d+\.(?:input_layernorm|post_attention_layernorm|pre_feedforward_layernorm|"
        r"post_feedforward_layernorm)|model\.norm|model\.language_model\.norm)$"
    )

    def _head_and_norm_shape_problems(self, cfg: dict, sizes: dict[str, int], fix: str) -> list[Problem]:
        """The output head against the config (``vocab_size`` outputs of ``hidden_size`` inputs - OPT's
        ``word_embed_proj_dim``; stored sizes, padded to 128 for a coded head) and the decoder layers' and the final
        norm's weight against ``hidden_size`` (one value per feature): vLLM's head loader and its norms'
        ``weight_loader`` assert the sizes in the worker ("Attempted to load weight (torch.Size([255])) into
        parameter (torch.Size([256]))"). Not for a tower's or a draft's modules."""
        hidden = cfg.get("word_embed_proj_dim") or sizes.get("hidden_size")
        vocab = sizes.get("vocab_size")
        out: list[Problem] = []
        for key, m in self.modules.items():
            if OTHER_STACKS.search(key):
                continue
            last = key.rsplit(".", 1)[-1]
            if last in ("lm_head", "embed_tokens") and m.format == "dense" and len(m.tensors["weight"].shape) != 2:
                out.append(self._not_a_matrix(m, fix))
            elif last == "lm_head" and m.padded_shape is not None:
                if isinstance(hidden, int):
                    out.extend(self._stored_size_problem(m, 0, hidden, f"hidden_size {hidden}", fix))
                if vocab is not None:  # Mllama's head too: its image-token rows are the embedding's only
                    out.extend(self._stored_size_problem(m, 1, vocab, f"vocab_size {vocab}", fix))
            elif self.HIDDEN_NORMS.search(key) and m.format == "dense" and sizes.get("hidden_size") is not None:
                shape = m.tensors["weight"].shape
                if tuple(shape) != (sizes["hidden_size"],):
                    what = f"weight is {list(shape)}, but config.json gives hidden_size {sizes['hidden_size']}"
                    out.append(Problem(key, f"{key}.weight", what, fix))
        return out

    @staticmethod
    def _not_a_matrix(m: ModuleInfo, fix: str) -> Problem:
        """A dense linear module, head or table whose weight is not 2-D (vLLM's loaders stopped on a 3-D or 1-D one
        in the worker)."""
        shape = list(m.tensors["weight"].shape)
        return Problem(m.key, f"{m.key}.weight", f"weight is {shape}, not a 2-D (out x in) matrix", fix)

    #: the modules outside the decoder layers that vLLM's stated classes load (Qwen3-Next also drops ``mtp.*``: its
    #: multi-token-prediction layers, which vLLM's model maps to nothing)
    OUTSIDE_LAYERS = frozenset({"model.embed_tokens", "model.norm", "lm_head"})

    def _built_config(self) -> dict:
        """The config vLLM builds the model from: the plugin's (:attr:`model_config`), else config.json."""
        return self.model_config if isinstance(self.model_config, dict) else self.config

    def _outside_layer_problems(self) -> list[Problem]:
        """For the stated classes, a module outside the decoder layers other than the token embedding, the final
        norm and the head (``model.foo``, or the head stored as ``model.lm_head``): vLLM's loader has no module for
        it and stopped in the worker ("There is no module or parameter named 'foo' in LlamaModel"). Rotary tables
        and modules holding only scales are left alone (vLLM skips or maps them)."""
        arch = stated_class(self._built_config())
        outside = [k for k in self.modules if not LAYER_KEY.search(k)]
        if arch is None or any(k.rsplit(".", 1)[-1] == DRAFT_FUSION for k in outside):
            return []  # an EAGLE draft published under its target's class: vLLM builds it as a draft, with its fc
        out: list[Problem] = []
        for key in outside:
            m = self.modules[key]
            if key in self.OUTSIDE_LAYERS:
                continue
            if arch == "Qwen3NextForCausalLM" and key.startswith("mtp."):
                continue
            names = set(m.tensors)
            if skipped_by_vllm(key, names):
                continue
            what = (
                f"vLLM's {arch} has no module {key} (outside the layers it loads model.embed_tokens, model.norm and "
                "lm_head only): its loader would stop in the worker"
            )
            fix = "remove these tensors from a copy of the pack, or use the config.json the pack was made with"
            out.append(Problem(key, f"{key}.{sorted(names)[0]}", what, fix))
        return out

    #: (module path in a layer, side) the generic checks above already hold against the config: k / v outputs,
    #: o inputs, a dense MLP's intermediate side
    GENERIC_SIDES = frozenset(
        {("self_attn.k_proj", 1), ("self_attn.v_proj", 1), ("self_attn.o_proj", 0), ("mlp.gate_proj", 1),
         ("mlp.up_proj", 1), ("mlp.down_proj", 0)}
    )  # fmt: skip

    def _stated_size_problems(self, fix: str) -> list[Problem]:
        """For the model classes whose layer the project states, every module of the decoder layers against the
        sizes vLLM's class gives it (:func:`~.check.architectures.layer_sizes`: the hidden side of every projection,
        router and expert, the experts' and shared expert's intermediate side, q_norm / k_norm per head, the Gated
        DeltaNet's own A_log / dt_bias), where the
        checks above do not already: stored sizes, padded to 128 for a coded module. vLLM's loaders, or the
        plugins' geometry check, would stop on each in the worker."""
        built = self._built_config()
        arch = stated_class(built)
        if arch is None:
            return []
        out: list[Problem] = []
        plans: dict[int, dict] = {}
        for key, m in self.modules.items():
            found = re.fullmatch(r"model\.layers\.(\d{1,9})\.(.+)", key)
            if not found or m.format not in ("dense", "exl3", "escha", "other"):
                continue
            i, path = int(found.group(1)), found.group(2)
            if i not in plans:
                plans[i] = layer_sizes(arch, built, i)
            if m.format == "other":  # a block's own parameters (the Gated DeltaNet's A_log, dt_bias)
                for name, info in sorted(m.tensors.items()):
                    size = plans[i].get(f"{path}.{name}")
                    if size is not None:
                        out += self._built_shape_problem(key, name, info.shape, size, f"vLLM's {arch}", fix)
                continue
            expert = re.fullmatch(r"(.+\.experts)\.\d+\.([^.]+)", path)
            size = plans[i].get(f"{expert.group(1)}.{expert.group(2)}" if expert else path)
            if size is None:
                continue
            if len(size) != 2:  # a norm's or a convolution's weight, as vLLM builds it
                if m.format == "dense":
                    out += self._built_shape_problem(
                        key, "weight", m.tensors["weight"].shape, size, f"vLLM's {arch}", fix
                    )
                continue
            if m.format == "dense" and len(m.tensors["weight"].shape) != 2:
                out.append(self._not_a_matrix(m, fix))
                continue
            if m.padded_shape is None:
                continue
            for side, want in enumerate(size):
                if want is not None and (path, side) not in self.GENERIC_SIDES:
                    what = f"{want} for vLLM's {arch}"
                    found_problem = self._stored_size_problem(m, side, want, what, fix)
                    out.extend(found_problem[:1])
                    if found_problem:
                        break
        return out

    @staticmethod
    def _built_shape_problem(key: str, name: str, shape, size: tuple, builder: str, fix: str) -> list[Problem]:
        """A problem when tensor ``name`` of module ``key`` (shape ``shape``) is not the shape ``size`` that
        ``builder`` (``"vLLM's Qwen3NextForCausalLM"``) builds it with (None: any size there); named after the
        module's own path in the layer (a norm's weight) or the tensor's (``linear_attn.A_log``)."""
        shape = tuple(shape)
        if len(shape) == len(size) and all(w in (None, h) for w, h in zip(size, shape, strict=True)):
            return []
        want = "x".join("?" if w is None else str(w) for w in size)
        path = re.sub(r"^model\.layers\.\d+\.", "", key)
        lead, built = ("weight ", path) if name == "weight" else ("", f"{path}.{name}")
        return [Problem(key, f"{key}.{name}", f"{lead}is {list(shape)}, but {builder} builds {built} as {want}", fix)]

    #: a decoder layer's dense MLP projections (not an expert's, not a shared expert's)
    DENSE_MLP = re.compile(r"\.mlp\.(gate_proj|up_proj|down_proj)$")

    def _mlp_shape_problems(self, cfg: dict, sizes: dict[str, int], fix: str) -> list[Problem]:
        """A decoder layer's dense MLP against ``intermediate_size``: gate / up give that many outputs, down takes
        that many inputs (stored sizes, padded to 128 for EXL3). Skipped where the config sizes blocks one by one
        (DeciLM's ``block_configs``) or gives ``intermediate_size`` per layer (a list: not in ``sizes``)."""
        want = sizes.get("intermediate_size")
        if want is None or cfg.get("block_configs"):
            return []
        out: list[Problem] = []
        for key, m in self.modules.items():
            found = self.DENSE_MLP.search(key)
            if not found or m.padded_shape is None or OTHER_STACKS.search(key):
                continue
            side = 0 if found.group(1) == "down_proj" else 1
            out.extend(self._stored_size_problem(m, side, want, f"intermediate_size {want}", fix))
        return out

    def _configured_experts(self) -> int | None:
        for cfg in (self.config, self.config.get("text_config") or {}):
            if not isinstance(cfg, dict):  # recorded as a problem when the config was read
                continue
            for key in ("num_experts", "num_local_experts", "n_routed_experts"):
                if isinstance(cfg.get(key), int):
                    return cfg[key]
        return None

    def _moe_problems(self) -> list[Problem]:
        """EXL3 MoE layers as a whole: every expert has every projection the others have, gate and up of an expert
        share K (the bank runs them at one width), one codebook per layer, and as many experts as config.json says.
        Source: docs/moe-bank.md (the bank's rules); quantpack_core.moe.plan_moe_layer enforces the same at load."""
        layers: dict[str, dict[int, dict[str, ModuleInfo]]] = {}
        for m in self.modules.values():
            hit = EXPERT_MODULE.match(m.key)
            if hit and m.format == "exl3":
                layers.setdefault(hit["layer"], {}).setdefault(int(hit["e"]), {})[hit["proj"]] = m
        out: list[Problem] = []
        configured = self._configured_experts()
        for layer, experts in sorted(layers.items()):
            projs = sorted({p for e in experts.values() for p in e})
            count = max(experts) + 1
            if configured is not None and count != configured:
                out.append(
                    Problem(
                        layer,
                        f"{layer}.{max(experts)}.{projs[0]}.trellis",
                        f"the pack has EXL3 experts 0..{max(experts)} in this layer, config.json says {configured} "
                        "experts",
                        "re-download the pack if experts are missing from it (a file or tensor lost), else use the "
                        "config.json the pack was made with",
                    )
                )
            for e in range(count):
                for p in projs:
                    if p not in experts.get(e, {}):
                        out.append(
                            Problem(
                                f"{layer}.{e}.{p}",
                                f"{layer}.{e}.{p}.trellis",
                                f"expert {e} has no EXL3 {p} while other experts of the layer do",
                                "re-download the pack (a file or tensor is missing) or re-quantize the layer",
                            )
                        )
                mods = experts.get(e, {})
                pair = [mods[p] for p in ("gate_proj", "up_proj", "w1", "w3") if p in mods]
                if len(pair) == 2 and pair[0].k_bits is not None and pair[0].k_bits != pair[1].k_bits:
                    out.append(
                        Problem(
                            pair[1].key,
                            f"{pair[1].key}.trellis",
                            f"expert {e}: gate K={pair[0].k_bits:g} but up K={pair[1].k_bits:g}; an EXL3 expert bank "
                            "runs an expert's gate and up projections at one K",
                            "re-quantize the layer with one bitrate for each expert's gate_proj and up_proj",
                        )
                    )
            codebooks = {m.codebook for e in experts.values() for m in e.values() if m.codebook is not None}
            if len(codebooks) > 1:
                out.append(
                    Problem(
                        layer,
                        f"{layer}.*",
                        f"the layer's experts use several codebooks ({', '.join(sorted(c.value for c in codebooks))})",
                        "re-quantize the layer with one codebook: an expert bank holds one",
                    )
                )
        return out

    def _fused_problems(self) -> list[Problem]:
        """Modules vLLM fuses into one layer (:data:`~quantpack_core.names.FUSED_LAYERS`: q / k / v, gate / up,
        Qwen3.5's in_proj_qkv / in_proj_z and in_proj_b / in_proj_a) stored in different kinds (a dense q_proj beside
        EXL3 k_proj and v_proj): one vLLM layer is all one kind. The plugins refuse such a pack when vLLM builds its
        config (``quantpack_core.vllm.config.check_fused_storage``, from the manifest); named here from the files too,
        so that ``quantpack inspect`` reports it."""
        out: list[Problem] = []
        # each group once (q / k / v back both Llama's qkv_proj and a vision tower's qkv)
        for group in dict.fromkeys(g for alternatives in FUSED_LAYERS.values() for g in alternatives if len(g) > 1):
            parents: dict[str, dict[str, ModuleInfo]] = {}
            for m in self.modules.values():
                parent, _, last = m.key.rpartition(".")
                if last in group and m.format != "other":
                    parents.setdefault(parent, {})[last] = m
            for _parent, members in sorted(parents.items()):
                kinds = Counter(m.format for m in members.values())
                if len(kinds) < 2:
                    continue
                common = kinds.most_common(1)[0][0]
                odd = next(m for _, m in sorted(members.items()) if m.format != common)
                listing = ", ".join(f"{name} {m.format}" for name, m in sorted(members.items()))
                what = (
                    f"stored as {odd.format} while its fused siblings are not ({listing}): vLLM fuses "
                    f"{' / '.join(group)} into one layer, which takes one kind"
                )
                fix = "re-quantize the pack with one setting for all of them (or re-download it if it was altered)"
                out.append(Problem(odd.key, f"{odd.key}.{self._main_tensor(odd)}", what, fix))
        return out

    def _pack_codebook(self) -> Codebook | None:
        """The codebook the pack's quantization config names (exllamav3 writes ``codebook``), or None."""
        name = self.quant_config.get("codebook")
        try:
            return Codebook.parse(name) if isinstance(name, str) else None
        except CodecError:
            return None

    def _exl3_problems(self, m: ModuleInfo, check_values: bool) -> list[Problem]:
        key, t = m.key, m.tensors
        out: list[Problem] = []

        def bad(suffix: str, what: str, fix: str = FIX_REQUANTIZE) -> None:
            out.append(Problem(key, f"{key}.{suffix}", what, fix))

        if "trellis" not in t:
            bad(
                "trellis",
                f"missing: the module has {', '.join(sorted('.' + s for s in t))} but no trellis",
                f"the pack is incomplete: re-download the shard that should hold {key}.trellis",
            )
            return out
        tr = t["trellis"]
        if tr.dtype != torch.int16:
            bad("trellis", f"dtype {_dtype_name(tr.dtype)}, an EXL3 trellis is int16")
        width = tr.shape[-1]
        if m.k_bits is None:
            legal = "16*K for K in 1..8, or 16*KA+8 for K in 1.5/2.5/3.5"
            bad("trellis", f"width {width} (shape {list(tr.shape)}) is not {legal}")
        if tr.shape[0] * TILE % HAD_BLOCK or tr.shape[1] * TILE % HAD_BLOCK:
            bad(
                "trellis",
                f"shape {list(tr.shape)} gives {tr.shape[0] * TILE}x{tr.shape[1] * TILE} features, not "
                f"multiples of {HAD_BLOCK} (the Hadamard block)",
            )
        if "mcg" in t and "mul1" in t:
            bad(
                "mul1",
                "both .mcg and .mul1 markers present; a tensor uses exactly one codebook",
                "remove the marker that does not match how this tensor was quantized, or re-quantize it",
            )
        elif m.k_bits in HALF_K and m.codebook is not Codebook.MUL1:
            bad(
                "trellis",
                f"half-integer K={m.k_bits:g} needs the mul1 codebook, the module has "
                f"{m.codebook.value if m.codebook else 'none'}",
            )
        elif (said := self._pack_codebook()) is not None and m.codebook is not None and m.codebook is not said:
            # exllamav3 quantizes a whole pack with one codebook, marked per tensor: a lost (or stray) marker would
            # silently decode the layer with another codebook
            # (the tensor named is the marker the module has, or the one it lacks; where every coded module
            # disagrees alike, quantization_config is what is wrong)
            if m.codebook is Codebook.INST3:
                what = f"its .{said.value} marker is missing (quantization_config says codebook {said.value}; without "
                what += "the marker the layer would decode as 3inst)"
                config_fix = 'where no coded layer has a marker, set quantization_config\'s codebook to "3inst"'
            else:
                what = f"has a .{m.codebook.value} marker, but quantization_config says codebook {said.value}"
                config_fix = (
                    f"where every coded layer has that marker, set quantization_config's codebook to "
                    f'"{m.codebook.value}"'
                )
            bad(
                said.value if m.codebook is Codebook.INST3 else m.codebook.value,
                what,
                f"{config_fix} (config.json and any quantization_config.json); otherwise re-download the pack's file "
                "that holds this layer",
            )
        kp, np_ = m.padded_shape or (0, 0)
        for side, legacy, length in (("suh", "su", kp), ("svh", "sv", np_)):
            if side in t:
                v = t[side]
                if v.dtype != torch.float16:
                    bad(side, f"dtype {_dtype_name(v.dtype)}, expected float16")
                if v.shape != (length,):
                    bad(side, f"shape {list(v.shape)}, the trellis {list(tr.shape)} needs [{length}]")
            elif legacy in t:
                v = t[legacy]
                if v.dtype != torch.int16 or v.shape != (length // 16,):
                    bad(
                        legacy,
                        f"legacy packed signs are {_dtype_name(v.dtype)} {list(v.shape)}, the trellis "
                        f"{list(tr.shape)} needs int16 [{length // 16}]",
                    )
            else:
                bad(
                    side,
                    "missing (the trellis is there)",
                    f"the pack is incomplete: re-download the shard that should hold {key}.{side}",
                )
        if "bias" in t and (misfit := _bias_misfit(t["bias"], np_)):
            bad("bias", misfit)
        if "weight" in t:
            bad(
                "weight",
                "a dense .weight stored beside the module's .trellis: the pack holds two versions of this layer",
                "remove the one that does not belong, or re-download / re-quantize the pack",
            )
        if check_values and not out and not any(i.file in self._bad_files for i in t.values()):
            out.extend(self._value_problems(key, t))
        return out

    def _escha_problems(self, m: ModuleInfo, check_values: bool) -> list[Problem]:
        """The layout of one escha-coded module (docs/escha-format.md): an int16 ``(in/16, out/16, 16*K)`` code of
        an integer K and whole 128-feature blocks, its four scale vectors present, floating, of the code's widths
        (and finite, when ``check_values``), no dense ``.weight`` beside it, a bias that fits."""
        key, t = m.key, m.tensors
        out: list[Problem] = []

        def bad(suffix: str, what: str, fix: str = FIX_ESCHA_META) -> None:
            out.append(Problem(key, f"{key}.{suffix}", what, fix))

        code = t[ESCHA_CODE]
        if code.dtype != torch.int16:
            bad(ESCHA_CODE, f"dtype {_dtype_name(code.dtype)}, an escha code is int16")
        width = code.shape[-1]
        if width % TILE or not 1 <= width // TILE <= 8:
            bad(ESCHA_CODE, f"width {width} (shape {list(code.shape)}) is not 16*K for an integer K in 1..8")
        kp, np_ = m.padded_shape or (0, 0)
        if kp % HAD_BLOCK or np_ % HAD_BLOCK:
            bad(ESCHA_CODE, f"shape {list(code.shape)} gives {kp}x{np_} features, not multiples of {HAD_BLOCK}")
        for names, length, side in ((ESCHA_IN_SCALES, kp, "input"), (ESCHA_OUT_SCALES, np_, "output")):
            vectors = [t[s] for s in names if s in t]
            lengths = {v.shape for v in vectors if v.dtype.is_floating_point}
            if len(vectors) == len(names) and len(lengths) == 1 and (only := lengths.pop()) != (length,):
                # both scale vectors of the side agree: the code is the tensor that does not fit
                held = " and ".join(f".{s}" for s in names)
                bad(
                    ESCHA_CODE,
                    f"shape {list(code.shape)} gives {length} {side} features, but {held} both hold {list(only)}: "
                    "the code does not belong to its scales (cut short, or another module's)",
                )
                continue
            for suffix in names:
                v = t.get(suffix)
                if v is None:
                    bad(suffix, f"missing (the .{ESCHA_CODE} is there)", f"the pack is incomplete: {FIX_ESCHA_META}")
                elif not v.dtype.is_floating_point or v.shape != (length,):
                    bad(
                        suffix,
                        f"{_dtype_name(v.dtype)} {list(v.shape)}; the code's {side} side needs a float vector of "
                        f"[{length}]",
                    )
        if "bias" in t and (misfit := _bias_misfit(t["bias"], np_)):
            bad("bias", misfit)
        if "weight" in t:
            bad(
                "weight",
                f"a dense .weight stored beside the module's .{ESCHA_CODE}: the pack holds two versions of this layer",
                "remove the one that does not belong, or re-download / re-convert the pack",
            )
        if check_values and not out and not any(i.file in self._bad_files for i in t.values()):
            for suffix in (*ESCHA_IN_SCALES, *ESCHA_OUT_SCALES):
                name = f"{key}.{suffix}"
                v = self._read_value(key, name, out)
                if v is not None:
                    self._check_finite(key, name, v, out)
                    # (not held to be non-zero: escha's rout may hold zeros for pruned channels)
                    out.extend(implausible_vector_problems(key, name, v, scale=True, zero_ok=True))
        return out

    def _escha_meta_problems(self) -> list[Problem]:
        """For a pack whose config.json says ``quant_method: "escha"``: ``layer_meta`` against the stored codes
        (:func:`escha_layer_ks`, :func:`escha_meta_mismatches`: the checks the escha config makes when vLLM
        builds it)."""
        if self._config_method != "escha":
            return []
        qc = self.config.get("quantization_config")
        try:
            ks = escha_layer_ks(qc.get("layer_meta") if isinstance(qc, dict) else None)
        except LayerLoadError as e:
            return [Problem("", "config.json", str(e).split(" - ")[0], "re-download the pack's config.json")]
        widths = {m.key: m.tensors[ESCHA_CODE].shape[-1] for m in self.modules.values() if m.format == "escha"}
        return [Problem(module, "config.json", what, fix) for module, what, fix in escha_meta_mismatches(ks, widths)]

    def _int8_pair_problems(self, m: ModuleInfo) -> list[Problem]:
        """An int8 table's rows without their per-row scales or the reverse (either naming of
        :data:`INT8_ROW_NAMES`), rows that are not int8, and scales that are not one float per row."""
        out: list[Problem] = []
        for rows, scales in self.INT8_ROW_NAMES:
            r, sc = m.tensors.get(rows), m.tensors.get(scales)
            if r is not None and sc is not None and r.dtype != torch.int8:
                what = f"{_dtype_name(r.dtype)} {list(r.shape)}, not int8: the rows of an int8 table with .{scales}"
                out.append(Problem(m.key, f"{m.key}.{rows}", what, FIX_REDOWNLOAD))
                continue
            if (r is None) == (sc is None):
                if (
                    r is not None
                    and r.dtype == torch.int8
                    and (len(r.shape) != 2 or sc.shape != (r.shape[0],) or not sc.dtype.is_floating_point)
                ):
                    out.append(
                        Problem(
                            m.key,
                            f"{m.key}.{scales}",
                            f"{_dtype_name(sc.dtype)} {list(sc.shape)}; the int8 rows {list(r.shape)} need one float "
                            "scale per row",
                            FIX_REDOWNLOAD,
                        )
                    )
                continue
            have, lack = (rows, scales) if r is not None else (scales, rows)
            if have == scales and m.tensors.keys() & {"trellis", "weight"}:
                continue  # a coded or dense module's own scales (an FP8 weight's ``weight_scale``), not an int8 table
            out.append(
                Problem(
                    m.key,
                    f"{m.key}.{lack}",
                    f"missing: the module stores .{have} but no .{lack} (an int8 table needs both)",
                    f"the pack is incomplete: {FIX_REDOWNLOAD}",
                )
            )
        return out

    def _value_problems(self, key: str, t: dict[str, TensorInfo]) -> list[Problem]:
        """Marker values and finite suh/svh of one otherwise sound EXL3 module."""
        out: list[Problem] = []
        for suffix in ("mcg", "mul1", "suh", "svh"):
            if suffix not in t:
                continue
            name = f"{key}.{suffix}"
            v = self._read_value(key, name, out)
            if v is None:
                continue
            if suffix in ("mcg", "mul1"):
                try:
                    check_marker(v, Codebook(suffix))
                except CodecError as e:
                    out.append(Problem(key, name, str(e), FIX_REQUANTIZE))
            else:
                self._check_finite(key, name, v, out)
                out.extend(implausible_vector_problems(key, name, v, scale=True))
        return out

    #: elements up to which a dense module's floating vectors are read and checked for NaN / Inf (norm weights, biases,
    #: int8 row scales; whole tables and matrices are not read)
    VECTOR_CHECK_ELEMENTS = 1 << 20

    #: module names whose dense 2-D floating weight is scanned whole for NaN / Inf (vocabulary tables: a non-finite
    #: row poisons every token that meets it), in chunks of this many elements
    TABLE_MODULES = ("embed_tokens", "lm_head")
    TABLE_CHUNK_ELEMENTS = 1 << 24

    def _vector_problems(self, m: ModuleInfo) -> list[Problem]:
        """Non-finite values in a dense, int8-row or other module's 1-D floating tensors (a norm's weight, a bias, the
        row scales of an int8 table, the Gated DeltaNet's A_log / dt_bias: a NaN there reaches every token) and in a
        dense vocabulary table
        (:data:`TABLE_MODULES`), read in chunks of rows so the check's memory stays at one chunk (64 MiB in
        float32)."""
        out: list[Problem] = []
        if m.format == "dense" and m.key.rsplit(".", 1)[-1] in self.TABLE_MODULES:
            self._table_problems(m, out)
        for suffix, info in m.tensors.items():
            if len(info.shape) != 1 or not info.dtype.is_floating_point or info.shape[0] > self.VECTOR_CHECK_ELEMENTS:
                continue
            if info.file in self._bad_files:
                continue
            name = f"{m.key}.{suffix}"
            v = self._read_value(m.key, name, out)
            if v is not None:
                self._check_finite(m.key, name, v, out)
                if is_norm(m.key) and suffix == "weight":
                    out.extend(implausible_vector_problems(m.key, name, v, scale=False))
        return out

    def _table_problems(self, m: ModuleInfo, out: list[Problem]) -> None:
        """Record the non-finite values of module ``m``'s 2-D floating ``weight`` (rows counted, first row named)."""
        info = m.tensors.get("weight")
        if info is None or len(info.shape) != 2 or not info.dtype.is_floating_point or info.file in self._bad_files:
            return
        name = f"{m.key}.weight"
        try:
            sl = self._handle(info.file).get_slice(name)
        except Exception as e:  # bytes safetensors cannot read
            out.append(Problem(m.key, name, f"unreadable ({type(e).__name__}: {e})", FIX_REDOWNLOAD))
            return
        rows, cols = info.shape
        step = max(1, self.TABLE_CHUNK_ELEMENTS // max(cols, 1))
        bad_rows, first, huge_rows, first_huge = 0, None, 0, None
        for r0 in range(0, rows, step):
            try:
                chunk = sl[r0 : r0 + step]
            except Exception as e:
                out.append(Problem(m.key, name, f"unreadable ({type(e).__name__}: {e})", FIX_REDOWNLOAD))
                return
            bad = ~torch.isfinite(chunk).all(dim=1)
            if bool(bad.any()):
                bad_rows += int(bad.sum())
                first = r0 + int(bad.nonzero()[0, 0]) if first is None else first
            huge = ~bad & (chunk.abs().amax(dim=1) > VALUE_LIMIT) if chunk.numel() else bad
            if bool(huge.any()):
                huge_rows += int(huge.sum())
                first_huge = r0 + int(huge.nonzero()[0, 0]) if first_huge is None else first_huge
        if bad_rows:
            out.append(
                Problem(
                    m.key,
                    name,
                    f"{bad_rows} of {rows} rows hold NaN or infinite values (first: row {first})",
                    FIX_REDOWNLOAD,
                )
            )
        if huge_rows:
            what = (
                f"{huge_rows} of {rows} rows hold values beyond {VALUE_LIMIT:g} in magnitude (first: row {first_huge}):"
                " no trained model's table holds such a row"
            )
            out.append(Problem(m.key, name, what, FIX_REDOWNLOAD))

    def _read_value(self, key: str, name: str, out: list[Problem]) -> torch.Tensor | None:
        """Tensor ``name`` of module ``key``, or None after recording why safetensors cannot read its bytes."""
        try:
            return self.get_tensor(name)
        except Exception as e:  # bytes safetensors cannot read
            out.append(Problem(key, name, f"unreadable ({type(e).__name__}: {e})", FIX_REDOWNLOAD))
            return None

    @staticmethod
    def _check_finite(key: str, name: str, v: torch.Tensor, out: list[Problem]) -> None:
        """Record a problem when ``v`` holds NaN or infinite values (float8 and other types ``isfinite`` does not
        take are read as float32)."""
        if v.is_floating_point() and v.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            v = v.float()
        if not bool(torch.isfinite(v).all()):
            count = int((~torch.isfinite(v)).sum())
            out.append(Problem(key, name, f"{count} of {v.numel()} values are NaN or infinite", FIX_REDOWNLOAD))

    def _manifest_problems(self) -> list[Problem]:
        out: list[Problem] = []
        # a file whose header could not be read explains every tensor it held
        unreadable = any(p.tensor in self._bad_files and not p.what.startswith("truncated") for p in self._problems)
        for module, entry in self.manifest.items():
            stored = (entry or {}).get("stored_tensors") or {}
            for name, desc in stored.items():
                info = self.tensors.get(name)
                if info is None:
                    if name not in self._in_absent_shards and name not in self._bad_entries and not unreadable:
                        out.append(
                            Problem(
                                module,
                                name,
                                f"listed in {MANIFEST_FILE} but absent from the pack's safetensors files",
                                "the pack is incomplete: re-download it",
                            )
                        )
                    continue
                want_shape = tuple(desc.get("shape", info.shape))
                want_dtype = str(desc.get("dtype", str(info.dtype)))
                if want_shape != info.shape or want_dtype != str(info.dtype):
                    out.append(
                        Problem(
                            module,
                            name,
                            f"{MANIFEST_FILE} says {want_dtype} {list(want_shape)}, the file "
                            f"holds {info.dtype} {list(info.shape)}",
                            FIX_REDOWNLOAD,
                        )
                    )
            # exllamav3 records each coded module's codebook multiplier: a module without its marker would decode
            # as 3INST, silently wrong (where the quantization config names no codebook; where it does, the marker
            # check names the module already)
            m = self.modules.get(module)
            stated = manifest_states_codebooks(self)
            for marker in ("mcg", "mul1") if self._pack_codebook() is None else ():
                if not isinstance(entry, dict) or m is None or m.format != "exl3":
                    continue
                if f"{marker}_multiplier" in entry and marker not in m.tensors:
                    what = (
                        f"{MANIFEST_FILE} records a {marker} multiplier for this module, but it has no .{marker} "
                        "marker: it would decode with the 3INST codebook, silently wrong"
                    )
                    out.append(Problem(module, f"{module}.{marker}", what, FIX_REDOWNLOAD))
                elif stated and f"{marker}_multiplier" not in entry and marker in m.tensors:
                    # (a manifest that records multipliers records every marker: this one was added)
                    what = (
                        f"has a .{marker} marker, but {MANIFEST_FILE}, which records the codebook multipliers, "
                        "records none for this module: it was quantized with another codebook"
                    )
                    out.append(Problem(module, f"{module}.{marker}", what, FIX_REDOWNLOAD))
        return out

    # ------------------------------------------------------------------------------------------------ reading

    def _handle(self, file: str):
        h = self._handles.get(file)
        if h is None:
            h = safe_open(str(self.path / file), framework="pt")
            self._handles[file] = h
        return h

    def get_tensor(self, name: str) -> torch.Tensor:
        """Read one tensor (CPU).

        Raises:
            KeyError: the pack has no such tensor (the message lists the module's tensors).
        """
        info = self.tensors.get(name)
        if info is None:
            module, _ = split_tensor_name(name)
            have = sorted(n for n in self.tensors if split_tensor_name(n)[0] == module)
            raise KeyError(f"{self.path}: no tensor {name!r}; module {module!r} has {have or 'no tensors'}")
        return self._handle(info.file).get_tensor(name)

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` for every tensor, one shard file at a time, one tensor at a time."""
        for f in self.files:
            for name in sorted(n for n, i in self.tensors.items() if i.file == f):
                yield name, self.get_tensor(name)

    def module_tensors(self, key: str) -> dict[str, torch.Tensor]:
        """``{suffix: tensor}`` of one module."""
        return {s: self.get_tensor(i.name) for s, i in self.modules[key].tensors.items()}

    def exl3_tensors(self, key: str) -> Exl3Tensors:
        """The EXL3 tensors of one module, legacy ``su``/``sv`` unpacked.

        Raises:
            KeyError: no such module, or not an EXL3 one (the message lists the EXL3 modules beside it).
            CodecError: not a sound EXL3 module.
        """
        m = self.modules.get(key)
        if m is None or m.format != "exl3":
            parent = key.rsplit(".", 1)[0]
            near = sorted(k for k, v in self.modules.items() if v.format == "exl3" and k.rsplit(".", 1)[0] == parent)
            what = "no such module" if m is None else f"a {m.format} module, not an EXL3 one"
            raise KeyError(f"{self.path}: {key!r}: {what}; EXL3 modules beside it: {near or 'none'}")
        t = self.module_tensors(key)
        if "suh" not in t and "su" in t:
            t["suh"] = unpack_signs(t.pop("su"))
        if "svh" not in t and "sv" in t:
            t["svh"] = unpack_signs(t.pop("sv"))
        try:
            return Exl3Tensors.from_tensors(t)
        except CodecError as e:
            raise CodecError(f"{key}: {e}") from None

    def dense_state_dict(
        self, dtype: torch.dtype = torch.float32, shapes: dict[str, tuple[int, ...]] | None = None
    ) -> dict[str, torch.Tensor]:
        """The whole pack as a dense HF state dict: every EXL3 module dequantized to ``<key>.weight`` (``(out, in)``,
        nn.Linear layout), a module of another coded format by its plugin's decoder (:func:`dense_decoder`), every
        int8-row table to ``<key>.weight = rows * scales``
        (:func:`quantpack_core.codec.int8_rows.dequantize_rows`), everything else cast to ``dtype``.

        Args:
            dtype: result dtype (the codec computes in it).
            shapes: optional ``{name: shape}`` of the target model's parameters; padded EXL3 weights (and biases) are
                trimmed to them.

        Returns:
            ``{name: tensor}`` (host memory: the size of the dense model).

        Raises:
            GeometryError: a target shape larger than the stored one.
            CodecError: no installed package decodes a module's format.
        """
        from .codec import dequantize
        from .codec.int8_rows import dequantize_rows
        from .errors import GeometryError

        out: dict[str, torch.Tensor] = {}
        for key, m in self.modules.items():
            if m.format == "int8-rows":
                rows_name, scales_name = self._int8_row_names(m.tensors)
                rows = self.get_tensor(f"{key}.{rows_name}")
                scales = self.get_tensor(f"{key}.{scales_name}").reshape(-1)
                out[f"{key}.weight"] = dequantize_rows(rows, scales, dtype)
                for suffix, info in m.tensors.items():
                    if suffix not in (rows_name, scales_name):
                        out[info.name] = self.get_tensor(info.name).to(dtype)
                continue
            if m.format in CODED_FORMATS and m.format != "exl3":  # another plugin's format: its decoder
                stored = {suffix: self.get_tensor(info.name) for suffix, info in m.tensors.items()}
                out |= {f"{key}.{suffix}": v for suffix, v in dense_decoder(m.format)(stored, dtype).items()}
                continue
            if m.format != "exl3":
                for info in m.tensors.values():
                    out[info.name] = self.get_tensor(info.name).to(dtype)
                continue
            t = self.exl3_tensors(key)
            w = dequantize(t, dtype).T
            want = (shapes or {}).get(f"{key}.weight")
            if want is not None:
                if want[0] > w.shape[0] or want[1] > w.shape[1]:
                    raise GeometryError(
                        f"{key}: the model wants a {list(want)} weight, the pack stores {list(w.shape)} (out x in)"
                    )
                w = w[: want[0], : want[1]]
            out[f"{key}.weight"] = w.contiguous()
            if t.bias is not None:
                b = t.bias.to(dtype)
                want_b = (shapes or {}).get(f"{key}.bias")
                out[f"{key}.bias"] = b[: want_b[0]] if want_b is not None else b
        return out

    # ---------------------------------------------------------------------------------------------- reporting

    def config_logical_shape(self, m: ModuleInfo) -> tuple[int, int] | None:
        """The logical (unpadded) ``(in, out)`` of a trellis-coded module as config.json's sizes give it (hidden,
        intermediate, expert and shared-expert widths, heads x head width, vocabulary, the gated delta net's key and
        value heads), for the projections whose widths those sizes fix; None for other modules, or where the sizes
        do not pad (to whole 128-feature blocks) to the stored shape."""
        if m.format not in CODED_FORMATS or m.padded_shape is None:
            return None
        cfg = self.config.get("text_config") if isinstance(self.config.get("text_config"), dict) else self.config

        def size(*names: str) -> int | None:
            for n in names:
                v = cfg.get(n)
                if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                    return v
            return None

        hidden, heads, kv = size("hidden_size"), size("num_attention_heads"), size("num_key_value_heads")
        head_dim = size("head_dim") or (hidden // heads if hidden and heads else None)
        leaf = m.key.rsplit(".", 1)[-1]
        if ".experts." in m.key + ".":
            inter = size("moe_intermediate_size")
        elif ".shared_expert." in m.key + "." or ".shared_experts." in m.key + ".":
            inter = size("shared_expert_intermediate_size", "moe_intermediate_size")
        else:
            inter = size("intermediate_size")
        q = heads * head_dim if heads and head_dim else None
        kvw = kv * head_dim if kv and head_dim else None
        shapes = {
            "q_proj": (hidden, q), "k_proj": (hidden, kvw), "v_proj": (hidden, kvw), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
            "lm_head": (hidden, size("vocab_size")),
        }  # fmt: skip
        if ".linear_attn." in m.key:  # Qwen3-Next / Qwen3.5 gated delta net: q, k of the key heads, v, z of the value
            keys, values = size("linear_num_key_heads"), size("linear_num_value_heads")
            kd = keys * size("linear_key_head_dim") if keys and size("linear_key_head_dim") else None
            vd = values * size("linear_value_head_dim") if values and size("linear_value_head_dim") else None
            shapes = {"in_proj_qkvz": (hidden, 2 * (kd + vd) if kd and vd else None), "out_proj": (vd, hidden)}
        shape = shapes.get(leaf)
        if shape is None or None in shape:
            return None
        if tuple(-(-d // 128) * 128 for d in shape) != tuple(-(-d // 128) * 128 for d in m.padded_shape):
            return None
        return shape[0], shape[1]

    #: module-name endings of input embedding tables (the token's row out of the vocabulary): their summary shapes
    #: read vocabulary x width, where a linear layer's stored (out, in) weight reads in x out
    INPUT_EMBEDDINGS = ("embed_tokens", "embedding", "wte", "word_embeddings", "embed_in")

    def summary_rows(self) -> list[tuple[str, ...]]:
        """One row of strings per module: key, format, K, codebook, padded (in x out), logical (stored, or from
        config.json: :meth:`config_logical_shape`), dtype, bytes. An input embedding's in is its vocabulary (a
        token id in, a row of the width out: ``1024x256``), the head's the width (``256x1024``)."""

        def shape(s, table: bool) -> str:
            if s is not None and table:
                s = tuple(reversed(s))
            return "-" if s is None else "x".join("?" if d is None else str(d) for d in s)

        rows = []
        for m in self.modules.values():
            table = m.key.rsplit(".", 1)[-1] in self.INPUT_EMBEDDINGS

            rows.append(
                (
                    m.key,
                    m.format,
                    "-" if m.k_bits is None else f"{m.k_bits:g}",
                    m.codebook.value if m.codebook else "-",
                    shape(m.padded_shape, table),
                    shape(m.logical_shape or self.config_logical_shape(m), table),
                    _dtype_name(m.dtype),
                    str(m.nbytes),
                )
            )
        return rows

    def bits_histogram(self) -> dict[float, int]:
        """K -> number of trellis-coded modules (EXL3, or escha in an escha pack)."""
        hist: dict[float, int] = {}
        for m in self.modules.values():
            if m.format in CODED_FORMATS and m.k_bits is not None:
                hist[m.k_bits] = hist.get(m.k_bits, 0) + 1
        return dict(sorted(hist.items()))


# ---------------------------------------------------------------------------------------- rules (pack -> problems)
#
# Each rule below is a plain function of an opened (scanned) Pack that returns its problems; Pack.problems runs them.

#: the tensors a trellis-coded module holds, per storage kind (a dense ``weight`` beside the code is reported by the
#: layout check on its own)
CODED_SUFFIXES: dict[str, frozenset[str]] = {
    "exl3": EXL3_SUFFIXES | {"weight"},
    "escha": frozenset({ESCHA_CODE, *ESCHA_IN_SCALES, *ESCHA_OUT_SCALES, ESCHA_CONFIG, "bias", "weight"}),
}
#: the tensors vLLM loads into a dense module of a stated class's decoder layers (whether a bias belongs is the
#: layout check's), and into its token embedding, final norm and head (none of them has a bias in those classes)
DENSE_SUFFIXES = frozenset({"weight", "bias"})
OUTSIDE_SUFFIXES = frozenset({"weight"})
FIX_STRAY = "remove the stray tensor(s) from a copy of the pack (and from its index), or re-download the pack"


def stray_tensor_problems(pack: Pack) -> list[Problem]:
    """Tensors a module holds beside its weight that its vLLM layer has no parameter for: on a trellis or escha
    module, anything but its code's tensors (``q_proj.weird``, ``gate_proj.bias0``); for the model classes whose
    layer the project states (:func:`~.check.architectures.stated_class`), on a dense module of the decoder layers
    anything but ``weight`` and ``bias``, on the token embedding, the final norm or the head anything but
    ``weight``. vLLM's loader stopped on each in the worker without naming it (vLLM 0.32: ``AttributeError:
    'QKVParallelLinear' object has no attribute 'data'``). One problem per module, naming its stray tensors;
    modules that hold only scales or rotary tables are vLLM's to skip
    (:func:`~.check.layers.skipped_by_vllm`)."""
    stated = stated_class(pack._built_config()) is not None
    out: list[Problem] = []
    for key, m in pack.modules.items():
        allowed = CODED_SUFFIXES.get(m.format)
        if allowed is None and stated and m.format == "dense" and not skipped_by_vllm(key, set(m.tensors)):
            in_layers = re.match(r"model\.layers\.\d{1,9}\.", key) and not OTHER_STACKS.search(key)
            allowed = DENSE_SUFFIXES if in_layers else OUTSIDE_SUFFIXES if key in Pack.OUTSIDE_LAYERS else None
        stray = sorted(set(m.tensors) - allowed) if allowed is not None else []
        if stray:
            shown = ", ".join(f".{s}" for s in stray[:6]) + (f" ... ({len(stray)} in all)" if len(stray) > 6 else "")
            kind = {"exl3": "an EXL3", "escha": "an escha"}.get(m.format, "a dense")
            what = (
                f"holds {shown} beside its weight, which {kind} layer has no parameter for: vLLM's loader would stop "
                "on it in the worker without naming it"
            )
            out.append(Problem(key, f"{key}.{stray[0]}", what, FIX_STRAY))
    return out


#: the tokenizer files vLLM reads from the pack folder (when it is also the tokenizer's), each a JSON object
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
FIX_TOKENIZER = "re-download the pack's tokenizer files (or give vLLM --tokenizer with a sound copy)"


def tokenizer_problems(pack: Pack) -> list[Problem]:
    """The pack's tokenizer files where vLLM (transformers) cannot read them: not a JSON object, a ``tokenizer.json``
    without its ``model``, or one the ``tokenizers`` library refuses (where it is installed, as beside vLLM). vLLM
    reads them after the pack's check, in its own process, and stopped there with a parse error naming no file."""
    out: list[Problem] = []
    for name in TOKENIZER_FILES:
        path = pack.path / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            out.append(Problem("", name, f"not valid JSON ({type(e).__name__}: {str(e)[:80]})", FIX_TOKENIZER))
            continue
        if not isinstance(data, dict):
            out.append(Problem("", name, f"is a JSON {type(data).__name__}, not an object", FIX_TOKENIZER))
        elif name == "tokenizer.json" and (why := _tokenizer_refusal(path, data)):
            out.append(Problem("", name, why, FIX_TOKENIZER))
    return out


def _tokenizer_refusal(path: Path, data: dict) -> str | None:
    """Why the ``tokenizers`` library cannot build the tokenizer ``path`` (holding ``data``), else None."""
    if not isinstance(data.get("model"), dict):
        return "has no tokenizer model (its 'model' object is missing)"
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    try:
        Tokenizer.from_file(str(path))
    except Exception as e:  # the library's own refusal (a Rust error raised as an Exception)
        return f"the tokenizers library cannot read it ({str(e)[:120]})"
    return None


def manifest_states_codebooks(pack: Pack) -> bool:
    """Whether the pack's manifest records codebook multipliers (``mcg_multiplier`` / ``mul1_multiplier``, as
    exllamav3 writes them into ``tensor_storage``): it then states each coded module's codebook (none recorded:
    3INST), and :meth:`Pack._manifest_problems` holds every module's markers against it."""
    return any(
        isinstance(e, dict) and ("mcg_multiplier" in e or "mul1_multiplier" in e) for e in pack.manifest.values()
    )


def codebook_mixture_problems(pack: Pack) -> list[Problem]:
    """One codebook per pack, unless the config says otherwise: exllamav3 quantizes a whole pack with one codebook
    and marks it on every coded module (``.mcg`` / ``.mul1``; none for 3INST), so where ``quantization_config``
    names no codebook and the manifest records no multipliers (:func:`manifest_states_codebooks`), EXL3 modules of
    several codebooks mean markers lost or added. A lost ``.mul1`` decodes its layer as 3INST: accepted before, one
    layer of 29 so decoded gave KL 5.50 nats, top-1 2.4% (vLLM 0.32, llama-tiny). Each module of the codebooks
    fewer modules use is named (ties: the marked ones' minority is the unmarked). Where the config names one, each
    module is held against it (:meth:`Pack._exl3_problems`)."""
    if pack._pack_codebook() is not None or manifest_states_codebooks(pack):
        return []
    groups: dict[Codebook, list[str]] = {}
    for key, m in pack.modules.items():
        if m.format == "exl3" and m.codebook is not None:
            groups.setdefault(m.codebook, []).append(key)
    if len(groups) < 2:
        return []
    # the codebook most modules use is taken as the pack's; on a tie the marked one (a marker is not lost by chance)
    main = max(groups, key=lambda c: (len(groups[c]), c is not Codebook.INST3))
    counts = ", ".join(f"{len(v)} {c.value}" for c, v in sorted(groups.items(), key=lambda kv: -len(kv[1])))
    fix = (
        f"re-download the file that holds the module (or re-quantize the pack); a pack quantized with several "
        f"codebooks on purpose states them: quantization_config's codebook, or {MANIFEST_FILE}'s per-module "
        "mcg_multiplier / mul1_multiplier as exllamav3 writes them"
    )
    out: list[Problem] = []
    for codebook, keys in groups.items():
        if codebook is main:
            continue
        for key in keys:
            if codebook is Codebook.INST3:
                tensor = f"{key}.{main.value}"
                what = f"has no codebook marker (3INST) while the pack's other coded modules are {main.value}"
            else:
                tensor = f"{key}.{codebook.value}"
                what = f"has a .{codebook.value} marker while the pack's other coded modules are {main.value}"
            what += f" ({counts}; quantization_config names no codebook): one codebook per pack"
            out.append(Problem(key, tensor, what, fix))
    return out


#: the largest magnitude a norm weight, an EXL3 ``suh`` / ``svh``, an escha scale or a value of a dense vocabulary
#: table may have. Measured on the bundled packs (11 EXL3, their bf16 sources, the EAGLE draft) and the packs
#: converted from them (3 escha, 2 with int8 tables): norm weights up to 1.72 (llama-tiny 2.5 bpw's model.norm),
#: svh 2.67, suh 0.249, escha scales 2.0, embedding tables 0.283, a dense head 0.381. The limit lies some 3,700 times
#: above the largest of those and below float16's largest value (65,504), the activations' dtype in exllamav3's
#: kernels: a gain past it would overflow any float16 activation above 6.6, so no trained model holds it. A norm
#: weight of 3.0e38 was served before with every logprob NaN (vLLM 0.32, float32).
VALUE_LIMIT = 1e4


def implausible_vector_problems(
    key: str, name: str, v: torch.Tensor, *, scale: bool, zero_ok: bool = False
) -> list[Problem]:
    """A 1-D vector's finite values beyond :data:`VALUE_LIMIT` in magnitude (counted, the first index and value
    named; NaN / Inf are the finiteness check's), and for a ``scale`` vector (EXL3 ``suh`` / ``svh``, escha scales)
    unless ``zero_ok``, one that is all zero: every weight of its layer is then 0 (an all-zero ``suh`` was served
    before at KL 5.2 nats).
    Vectorised: one pass over the vector."""
    a = v.detach().float().abs()
    out: list[Problem] = []
    huge = torch.isfinite(a) & (a > VALUE_LIMIT)
    if bool(huge.any()):
        i = int(huge.nonzero()[0, 0])
        what = (
            f"{int(huge.sum())} of {v.numel()} values lie beyond {VALUE_LIMIT:g} in magnitude (first: index {i}, "
            f"{float(v[i]):.3g}): no trained model keeps such a {'scale' if scale else 'norm weight'}"
        )
        out.append(Problem(key, name, what, FIX_REDOWNLOAD))
    if scale and not zero_ok and v.numel() and not bool(a.any()):
        what = f"all {v.numel()} values are 0: every weight of the layer would be 0"
        out.append(Problem(key, name, what, FIX_REDOWNLOAD))
    return out


#: which config.json sizes fix a projection's outputs (:meth:`Pack.config_logical_shape`), for messages
OUTPUT_SIZES = {
    "q_proj": "num_attention_heads x head_dim",
    "k_proj": "num_key_value_heads x head_dim",
    "v_proj": "num_key_value_heads x head_dim",
    "gate_proj": "intermediate_size",
    "up_proj": "intermediate_size",
    "in_proj_qkvz": "the linear attention's heads x their widths",
}


def padding_problems(pack: Pack) -> list[Problem]:
    """Sizes inside EXL3's 128-feature padding, which the stored shapes cannot tell apart (``num_key_value_heads`` 1
    or 2 of 64 features both store 128; ``intermediate_size`` 520, 600 or 640 store 640), held against the padded
    outputs' scales: exllamav3's converter zero-pads a layer to whole blocks (``Linear.pad_out``) and its
    quantizer sets the output scale of an all-zero output channel to 0 (``regularize``: ``sv[zero_out_scales] =
    0``; ``refit_scales`` keeps it), so ``svh`` is 0 past the layer's real outputs. Where config.json's sizes
    (:meth:`Pack.config_logical_shape`) end inside the stored outputs of an EXL3 projection and ``svh`` is not 0
    beyond them, the layer holds more features than config.json says: vLLM would serve it as garbage without a word
    (``num_key_value_heads`` 1 for 2: KL 3.98 nats, top-1 10%; ``intermediate_size`` 600 for 640: KL 0.077).
    Not for the head (a vocabulary a model pads itself), a tower's or a draft's modules, or escha modules (whose
    writers are not exllamav3's)."""
    out: list[Problem] = []
    for key, m in pack.modules.items():
        leaf = key.rsplit(".", 1)[-1]
        if m.format != "exl3" or leaf == "lm_head" or OTHER_STACKS.search(key) or "svh" not in m.tensors:
            continue
        logical = pack.config_logical_shape(m)
        stored = m.padded_shape[1] if m.padded_shape else None
        if logical is None or stored is None or logical[1] >= stored:
            continue
        svh = pack._read_value(key, f"{key}.svh", out)
        if svh is None or svh.shape != (stored,):
            continue
        live = svh[logical[1] :].float().nonzero()
        if live.numel():
            first = logical[1] + int(live[0, 0])
            sizes = OUTPUT_SIZES.get(leaf, "sizes")
            if ".shared_expert" in key and leaf in ("gate_proj", "up_proj"):
                sizes = "shared_expert_intermediate_size"
            elif ".experts." in key and leaf in ("gate_proj", "up_proj"):
                sizes = "moe_intermediate_size"
            what = (
                f"config.json gives it {logical[1]} outputs ({sizes}) of the {stored} stored, but svh scales output "
                f"{first} (and {live.numel() - 1} more past {logical[1]}): exllamav3 writes 0 there for padding, so "
                "the layer holds more features than config.json says and would be served as garbage"
            )
            out.append(Problem(key, f"{key}.svh", what, "use the config.json the pack was made with"))
    return out


def head_count_problems(pack: Pack) -> list[Problem]:
    """``num_attention_heads`` that is not a multiple of ``num_key_value_heads``: vLLM's attention shares each
    key-value head among a whole group of query heads and refuses the model in the worker (3 heads over 2: the shapes
    pad alike to 128, so the projection checks pass it)."""
    cfg = pack.config.get("text_config") if isinstance(pack.config.get("text_config"), dict) else pack.config
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (heads, kv)) or heads % kv == 0:
        return []
    what = (
        f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}: vLLM's attention gives each "
        "key-value head a whole group of query heads and refuses the model in the worker"
    )
    return [Problem("", "config.json", what, "use the config.json the pack was made with")]


def unproven_sizes(pack: Pack) -> list[str]:
    """config.json's sizes that no tensor of the pack proves, for ``quantpack inspect``'s note: how the attention's
    width splits into heads (``num_attention_heads`` x ``head_dim``: the projections hold only the products, and 8
    heads of 32 store exactly as 4 of 64) unless per-head norms (``q_norm`` / ``k_norm``, one weight per head
    feature) give ``head_dim``; and escha modules' outputs that end inside the padding (:func:`padding_problems`
    reads exllamav3's padded scales, not escha's). ``quantpack verify`` runs the pack to catch what these hide."""
    cfg = pack.config.get("text_config") if isinstance(pack.config.get("text_config"), dict) else pack.config

    def size(key: str) -> int | None:
        v = cfg.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    out: list[str] = []
    heads, kv, hidden = size("num_attention_heads"), size("num_key_value_heads"), size("hidden_size")
    head_dim = size("head_dim") or (hidden // heads if heads and hidden else None)
    per_head = any(
        k.rsplit(".", 1)[-1] in ("q_norm", "k_norm") and m.format == "dense" for k, m in pack.modules.items()
    )
    attention = any(k.endswith("self_attn.k_proj") for k in pack.modules)
    if heads and head_dim and attention and not per_head:
        kv_part = f" and num_key_value_heads {kv}" if kv else ""
        out.append(
            f"the split of the attention into num_attention_heads {heads} x head_dim {head_dim}{kv_part} (the "
            f"projections hold only the products, {heads * head_dim} and {(kv or heads) * head_dim} features)"
        )
    padded = [
        k
        for k, m in pack.modules.items()
        if m.format == "escha"
        and (shape := pack.config_logical_shape(m)) is not None
        and m.padded_shape is not None
        and shape[1] < m.padded_shape[1]
    ]
    if padded:
        out.append(f"the outputs of {len(padded)} escha module(s) ending inside their padding ({padded[0]}, ...)")
    return out
