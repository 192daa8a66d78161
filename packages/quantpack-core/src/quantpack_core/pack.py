"""Open and read a pack (a checkpoint directory written by exllamav3's converter, or another format's).

A pack is ``config.json`` (with ``quantization_config``), an optional ``quantization_config.json`` whose
``tensor_storage`` lists every module's stored tensors (the manifest), and either one ``*.safetensors`` file or a
``model.safetensors.index.json`` with its shards. :class:`Pack` reads only the safetensors headers to build the
inventory (:mod:`quantpack_core.inventory`), noting what it could not read; tensors are read one at a time through
safetensors' memory map, so the pack is never held in host RAM as a whole. Nothing in the directory is ever written.
The pack check (:mod:`quantpack_core.check`) holds what was read against itself, the config and the formats' rules;
:meth:`Pack.open` runs it.

Follows docs/exl3-format.md ("Tensors of one layer", "Pack files"), exllamav3's
``exllamav3/conversion/convert_model.py`` (what it writes) and the safetensors file layout (8-byte little-endian
header length, JSON header, data).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from .check import CheckSettings, problems
from .codec import Exl3Tensors, unpack_signs
from .codec.exl3 import FORMAT as EXL3
from .errors import CodecError, PackError, Problem
from .format import PackFormat, pack_formats
from .inventory import (
    DENSE,
    FIX_REDOWNLOAD,
    INDEX_FILE,
    INT8_ROWS,
    MANIFEST_FILE,
    OTHER,
    HeaderEntry,
    ModuleInfo,
    ShardHeader,
    TensorInfo,
    Unread,
    coded_module,
    dtype_name,
    int8_row_names,
    read_header,
)
from .names import split_tensor_name
from .ngram import NGRAM_FILE

#: entry-point group of the plugins' dense decoders (``quantpack verify``, the reference model): a coded format's name
#: -> ``decode(tensors, dtype)``, a module's stored tensors by suffix -> the dense tensors of transformers' layer by
#: suffix (``weight`` as ``(out, in)``, ...)
DENSE_DECODERS = "quantpack.dense_decoders"
#: the fix where the pack folder was not given
FIX_FOLDER = "point at the pack's folder (it holds config.json)"


def dense_decoder(fmt: str):
    """The dense decoder an installed plugin registers for coded format ``fmt`` (:data:`DENSE_DECODERS`).

    Raises:
        CodecError: no installed package decodes one.
    """
    from importlib.metadata import entry_points

    for ep in entry_points(group=DENSE_DECODERS):
        if ep.name == fmt:
            return ep.load()
    raise CodecError(
        f"no installed package decodes {fmt!r} modules (entry point group {DENSE_DECODERS}): install the plugin that "
        f"serves {fmt} packs"
    )


class Pack:
    """A pack on disk: its configs, manifest, tensor index and module inventory (implements
    :class:`~quantpack_core.inventory.PackView`).

    Use :meth:`open`. Reading a tensor (:meth:`get_tensor`) memory-maps its shard; nothing is cached beyond the open
    file handles.

    Attributes:
        path: the pack directory.
        config: ``config.json`` as a dict.
        quant_config: the quantization config (``config.json``'s ``quantization_config``, or its ``text_config``'s,
            updated with ``quantization_config.json``), ``{}`` if none.
        stated_quant_config: the quantization config as config.json states it (what vLLM reads).
        config_method: its ``quant_method``, lowercased.
        manifest: ``tensor_storage`` of ``quantization_config.json`` (module -> entry), ``{}`` if absent.
        tensors: tensor name -> TensorInfo, for every tensor in the pack's files.
        modules: module key -> ModuleInfo.
        (and what :class:`~quantpack_core.inventory.PackView` names: the files and headers as read, what could not be
        read.)
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.config: dict = {}
        self.quant_config: dict = {}
        self.stated_quant_config: dict = {}
        self.config_method = ""
        self.manifest: dict = {}
        self.tensors: dict[str, TensorInfo] = {}
        self.modules: dict[str, ModuleInfo] = {}
        self.files: list[str] = []
        self.present: list[str] = []
        self.has_index = False
        self.weight_map: dict[str, str] | None = None
        self.headers: list[ShardHeader] = []
        self.unread = Unread()
        self.bad_files: set[str] = set()  # shard files whose header is unreadable, or that are truncated
        self.bad_entries: set[str] = set()  # tensors whose header entry is unreadable
        self.in_absent_shards: set[str] = set()  # tensors the index lists in a file the pack lacks
        self._handles: dict[str, object] = {}
        self._scan()

    # ------------------------------------------------------------------------------------------------ opening

    def __repr__(self) -> str:
        coded = {name: sum(1 for m in self.modules.values() if m.format == name) for name in pack_formats()}
        counts = "".join(f", {name}={n}" for name, n in coded.items() if n)
        return f"Pack({str(self.path)!r}, files={len(self.files)}, modules={len(self.modules)}{counts})"

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
        """Open a pack and check it (:func:`quantpack_core.check.problems`).

        Args:
            path: the pack directory.
            require_exl3: fail unless config.json says ``quant_method: "exl3"``.
            check_values: also read every coded module's small tensors (markers, scales: a few KiB each) and the
                other modules' 1-D floating tensors (norm weights, biases, int8 row scales), and check their values.
            model_config: the model's config as the server built it from config.json (vLLM's ``hf_config`` as a
                dict: after ``--hf-overrides``, and with a draft's class renamed); the decoder layers are held against
                the layer of its class instead of config.json's.

        Returns:
            the Pack.

        Raises:
            PackError: listing every problem found (missing/extra/truncated files and tensors, illegal trellis
                widths, mismatched suh/svh, marker clashes ...), each naming module, tensor and fix.
        """
        pack = cls(path)
        found = problems(pack, CheckSettings(EXL3 if require_exl3 else None, check_values, model_config))
        if found:
            raise PackError(str(pack.path), found)
        return pack

    def problems(self, *, require_exl3: bool = True, check_values: bool = True) -> list[Problem]:
        """Every defect of the pack (empty list when it is sound): :func:`quantpack_core.check.problems` with
        :meth:`open`'s settings."""
        return problems(self, CheckSettings(EXL3 if require_exl3 else None, check_values))

    def _object(self, value, where: str, into: list[Problem]) -> dict:
        """``value`` if it is a JSON object, else ``{}`` after noting, in ``into``, that ``where`` is not one."""
        if isinstance(value, dict):
            return value
        into.append(
            Problem("", where, f"is {type(value).__name__} {str(value)[:60]!r}, not a JSON object", FIX_REDOWNLOAD)
        )
        return {}

    def _scan(self) -> None:
        if not self.path.is_dir():
            what = "is a file, not a directory" if self.path.exists() else "does not exist"
            self.unread.config.append(Problem("", str(self.path), what, FIX_FOLDER))
            return
        self._read_config()
        self._read_manifest()
        self._list_files()
        self._read_index()
        self._read_headers()
        self._build_modules()

    def _read_json(self, name: str, into: list[Problem]) -> dict:
        """File ``name`` of the pack as a JSON object (``{}``, noted in ``into``, where it is not valid JSON or no
        object)."""
        try:
            return self._object(json.loads((self.path / name).read_text()), name, into)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            into.append(Problem("", name, f"not valid JSON ({type(e).__name__}: {e})", FIX_REDOWNLOAD))
            return {}

    def _read_config(self) -> None:
        """config.json, its text config and quantization config."""
        into = self.unread.config
        if not (self.path / "config.json").is_file():
            into.append(Problem("", "config.json", "missing", FIX_FOLDER))
        else:
            self.config = self._read_json("config.json", into)
        given = self.config.get("text_config")
        text_config = {} if given is None else self._object(given, "config.json: text_config", into)
        qc = self._object(
            self.config.get("quantization_config") or text_config.get("quantization_config") or {},
            "config.json: quantization_config",
            into,
        )
        self.stated_quant_config = qc
        self.quant_config = dict(qc)
        self.config_method = str(qc.get("quant_method", "")).lower()

    def _read_manifest(self) -> None:
        """quantization_config.json: its ``tensor_storage`` (a shape that is no list of sizes dropped), its other
        keys into :attr:`quant_config` (config.json's win)."""
        if not (self.path / MANIFEST_FILE).is_file():
            return
        into = self.unread.manifest
        extra = self._read_json(MANIFEST_FILE, into)
        storage = self._object(extra.get("tensor_storage") or {}, f"{MANIFEST_FILE}: tensor_storage", into)
        for module, entry in storage.items():
            entry = self._object(entry or {}, f"{MANIFEST_FILE}: tensor_storage.{module}", into)
            stored = self._object(entry.get("stored_tensors") or {}, f"{MANIFEST_FILE}: {module}.stored_tensors", into)
            for name, desc in list(stored.items()):
                desc = self._object(desc or {}, f"{MANIFEST_FILE}: {module}.stored_tensors.{name}", into)
                shape = desc.get("shape")
                if "shape" in desc and not (
                    isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
                ):
                    what = f"{MANIFEST_FILE} gives the shape {shape!r}, not a list of sizes"
                    into.append(Problem(module, name, what, FIX_REDOWNLOAD))
                    desc = {k: v for k, v in desc.items() if k != "shape"}
                stored[name] = desc
            self.manifest[module] = {**entry, "stored_tensors": stored}
        for k, v in extra.items():
            if k != "tensor_storage":
                self.quant_config.setdefault(k, v)

    def _list_files(self) -> None:
        """The folder's ``*.safetensors`` files (an n-gram table, read by its own module, :mod:`quantpack_core.ngram`,
        left out)."""
        for entry in sorted(self.path.glob("*.safetensors")):
            if entry.name == NGRAM_FILE:
                continue
            if entry.is_file():
                self.present.append(entry.name)
            elif entry.is_symlink() and not entry.exists():
                self.unread.files.append(
                    Problem("", entry.name, "a symbolic link to nothing", f"re-download {entry.name}")
                )
            else:
                what = "not a regular file (a directory?)"
                self.unread.files.append(Problem("", entry.name, what, f"re-download {entry.name}"))

    def _read_index(self) -> None:
        """The index's ``weight_map`` (its entries whose file is no name left out) and the files to read: those it
        lists that the folder holds; without an index, the folder's files (none where the index is unreadable)."""
        self.has_index = (self.path / INDEX_FILE).is_file()
        if not self.has_index:
            self.files = list(self.present)
            return
        into = self.unread.files
        try:
            weight_map = json.loads((self.path / INDEX_FILE).read_text())["weight_map"]
        except (ValueError, UnicodeDecodeError, KeyError, TypeError, RecursionError) as e:
            into.append(Problem("", INDEX_FILE, f"unreadable ({type(e).__name__}: {e})", FIX_REDOWNLOAD))
            return
        if not isinstance(weight_map, dict):
            # vLLM's loader looks each name up in it (weight_map[name]): a list of pairs stopped it in the worker
            what = f"weight_map is a JSON {type(weight_map).__name__}, not an object mapping tensor names to files"
            into.append(Problem("", INDEX_FILE, what, FIX_REDOWNLOAD))
            return
        odd = {n: f for n, f in weight_map.items() if not isinstance(f, str)}
        if odd:  # a file name that is a number, null, a list ...: vLLM's loader would stop on it
            name, value = next(iter(odd.items()))
            what = f"weight_map gives {name} the file {json.dumps(value)[:40]}, not a file name"
            more = f" ({len(odd)} such entries)" if len(odd) > 1 else ""
            into.append(Problem("", INDEX_FILE, what + more, FIX_REDOWNLOAD))
        self.weight_map = {n: f for n, f in weight_map.items() if isinstance(f, str)}
        self.in_absent_shards = {n for n, f in self.weight_map.items() if f not in self.present}
        self.files = [f for f in sorted(set(self.weight_map.values())) if f in self.present]

    def _read_headers(self) -> None:
        """Each file's header; the tensors of its readable entries (the first of a name stored twice)."""
        for f in self.files:
            try:
                header, start = read_header(self.path / f)
            except (ValueError, OSError) as e:
                self.headers.append(ShardHeader(f, error=str(e)))
                self.bad_files.add(f)
                continue
            shard = ShardHeader(
                f, (self.path / f).stat().st_size, start, {n: HeaderEntry(h) for n, h in header.items()}
            )
            self.headers.append(shard)
            for name, e in shard.entries.items():
                if not e.readable:
                    self.bad_entries.add(name)
                elif name not in self.tensors:
                    self.tensors[name] = TensorInfo(name, f, e.dtype, e.shape, e.nbytes)
            if shard.truncated:
                self.bad_files.add(f)

    def _build_modules(self) -> None:
        groups: dict[str, dict[str, TensorInfo]] = {}
        for name, info in self.tensors.items():
            module, suffix = split_tensor_name(name)
            groups.setdefault(module, {})[suffix] = info
        # where a module holds two formats' codes, the pack's own format (config.json's quant_method) reads it
        formats = sorted(pack_formats().values(), key=lambda fmt: fmt.name != self.config_method)
        for key in sorted(groups):
            t = groups[key]
            self.modules[key] = self._module(key, t, sum(i.nbytes for i in t.values()), formats)

    @staticmethod
    def _module(key: str, t: dict[str, TensorInfo], nbytes: int, formats: list[PackFormat]) -> ModuleInfo:
        """One module's inventory row: stored in the first of ``formats`` whose 3-D code it holds, or whose remains
        (:meth:`~quantpack_core.format.PackFormat.remains`); else an int8 table, a dense weight or other."""
        for fmt in formats:
            code = t.get(fmt.main_suffix)
            if code is not None and len(code.shape) == 3:
                return coded_module(key, t, nbytes, fmt.name, fmt.main_suffix, fmt.codebook_of(t))
        for fmt in formats:
            if fmt.remains(t):
                return ModuleInfo(key, fmt.name, None, None, None, None, None, nbytes, t)
        if (names := int8_row_names(t)) is not None:
            rows = t[names[0]]
            shape = (rows.shape[1], rows.shape[0]) if len(rows.shape) == 2 else None
            return ModuleInfo(key, INT8_ROWS, None, None, shape, shape, rows.dtype, nbytes, t)
        if "weight" in t and not any(fmt.main_suffix in t for fmt in formats):
            w = t["weight"]
            shape = (w.shape[1], w.shape[0]) if len(w.shape) == 2 else None
            return ModuleInfo(key, DENSE, None, None, shape, shape, w.dtype, nbytes, t)
        main = next(iter(t.values()))
        return ModuleInfo(key, OTHER, None, None, None, None, main.dtype, nbytes, t)

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

    def get_slice(self, name: str):
        """safetensors' lazy slice of tensor ``name`` (its rows read on indexing).

        Raises:
            KeyError: the pack has no such tensor.
            Exception: safetensors' own, for bytes it cannot read.
        """
        return self._handle(self.tensors[name].file).get_slice(name)

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
        if m is None or m.format != EXL3:
            parent = key.rsplit(".", 1)[0]
            near = sorted(k for k, v in self.modules.items() if v.format == EXL3 and k.rsplit(".", 1)[0] == parent)
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
        from .codec.int8_rows import dequantize_rows

        out: dict[str, torch.Tensor] = {}
        for key, m in self.modules.items():
            if m.format == INT8_ROWS:
                rows_name, scales_name = int8_row_names(m.tensors)
                rows = self.get_tensor(f"{key}.{rows_name}")
                scales = self.get_tensor(f"{key}.{scales_name}").reshape(-1)
                out[f"{key}.weight"] = dequantize_rows(rows, scales, dtype)
                for suffix, info in m.tensors.items():
                    if suffix not in (rows_name, scales_name):
                        out[info.name] = self.get_tensor(info.name).to(dtype)
            elif m.format == EXL3:
                out |= self._dense_exl3(key, dtype, shapes or {})
            elif m.format in pack_formats():  # another plugin's format: its decoder
                stored = {suffix: self.get_tensor(info.name) for suffix, info in m.tensors.items()}
                out |= {f"{key}.{suffix}": v for suffix, v in dense_decoder(m.format)(stored, dtype).items()}
            else:
                for info in m.tensors.values():
                    out[info.name] = self.get_tensor(info.name).to(dtype)
        return out

    def _dense_exl3(self, key: str, dtype: torch.dtype, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """EXL3 module ``key`` dequantized to its ``weight`` (and ``bias``), trimmed to ``shapes``' sizes."""
        from .codec import dequantize
        from .errors import GeometryError

        t = self.exl3_tensors(key)
        w = dequantize(t, dtype).T
        want = shapes.get(f"{key}.weight")
        if want is not None:
            if want[0] > w.shape[0] or want[1] > w.shape[1]:
                raise GeometryError(
                    f"{key}: the model wants a {list(want)} weight, the pack stores {list(w.shape)} (out x in)"
                )
            w = w[: want[0], : want[1]]
        out = {f"{key}.weight": w.contiguous()}
        if t.bias is not None:
            b = t.bias.to(dtype)
            want_b = shapes.get(f"{key}.bias")
            out[f"{key}.bias"] = b[: want_b[0]] if want_b is not None else b
        return out

    # ---------------------------------------------------------------------------------------------- reporting

    def config_logical_shape(self, m: ModuleInfo) -> tuple[int, int] | None:
        """The logical (unpadded) ``(in, out)`` of a trellis-coded module as config.json's sizes give it (hidden,
        intermediate, expert and shared-expert widths, heads x head width, vocabulary, the gated delta net's key and
        value heads), for the projections whose widths those sizes fix; None for other modules, or where the sizes
        do not pad (to whole 128-feature blocks) to the stored shape."""
        if m.format not in pack_formats() or m.padded_shape is None:
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
                    dtype_name(m.dtype),
                    str(m.nbytes),
                )
            )
        return rows

    def bits_histogram(self) -> dict[float, int]:
        """K -> number of trellis-coded modules (of any format an installed plugin registers)."""
        hist: dict[float, int] = {}
        for m in self.modules.values():
            if m.format in pack_formats() and m.k_bits is not None:
                hist[m.k_bits] = hist.get(m.k_bits, 0) + 1
        return dict(sorted(hist.items()))
