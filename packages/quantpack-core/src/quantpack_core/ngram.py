"""A hashed n-gram embedding table as exllamav3 stores it (Qwen3.8-Flash-Next's per-layer embedding): read it, check
it, and decode only the rows a batch gathers.

The table of one module ``<key>`` (e.g. ``model.language_model.layers.1.ple.ple_embedding.ngram_embedding``) lives
in ``ngram_embedding.safetensors``, a file the pack's index does not list:

- ``<key>.shard_N.trellis`` (N = 0, 1, ...; or one ``<key>.trellis``): int16 rows of the ring codec
  (:mod:`quantpack_core.codec.ring`, 160 positions at K bits each); every shard but the last holds the same number of
  rows, the last no more, and global row ``r`` is row ``r % rows_per_shard`` of shard ``r // rows_per_shard``;
- ``<key>.head_offsets`` / ``<key>.head_vocab_sizes`` (one per hash head): each head's first row and row count;
- ``<key>.layer_multipliers``: the integer multipliers of the n-gram hash, one per token position of an n-gram (the
  ids are computed from token ids outside this module; they are kept for that, not applied to rows);
- ``<key>.head_bias`` ``(heads, 160)``: added to every row of its head; a row's head is the last head whose offset
  is not above it.

Source: docs/exl3-format.md ("Row rings"), docs/families.md (Flash-Next PLE; exllamav3 1.6.5's
``modules/ngram_embedding.py`` and ``modules/row_table.py``, read).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from .codec.ring import NGRAM_ROW_DIM, decode_ring_rows, ring_dim
from .errors import PackError, Problem

#: the file exllamav3 writes the table to, next to the pack's other shards
NGRAM_FILE = "ngram_embedding.safetensors"
AUX = ("head_offsets", "head_vocab_sizes", "layer_multipliers", "head_bias")
RECONVERT = "re-convert the table with exllamav3"
RECOPY = f"copy {NGRAM_FILE} from the original pack"
#: safetensors dtype names of the tensors a table file may hold (others read as uint8, and are refused)
SAFETENSORS_DTYPES = {
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
}  # fmt: skip


@dataclass
class NgramTable:
    """One n-gram table (see the module).

    Attributes:
        key: the module's checkpoint name.
        shards: int16 ``(rows_i, 1 + 10 K)`` ring rows per shard.
        rows_per_shard: rows of every shard but the last.
        k_bits: K of the rings.
        head_offsets, head_vocab_sizes, layer_multipliers: int64 ``(heads,)`` (multipliers: as stored).
        head_bias: float32 ``(heads, 160)``.
        shard_names: the ring tensors' names, in row order.
    """

    key: str
    shards: list[torch.Tensor]
    rows_per_shard: int
    k_bits: int
    head_offsets: torch.Tensor
    head_vocab_sizes: torch.Tensor
    layer_multipliers: torch.Tensor
    head_bias: torch.Tensor
    shard_names: tuple[str, ...] = ()

    @property
    def num_rows(self) -> int:
        """Rows of the whole table."""
        return sum(s.shape[0] for s in self.shards)

    @classmethod
    def from_tensors(cls, key: str, tensors: Mapping[str, torch.Tensor], where: str = "pack") -> NgramTable:
        """Build and check the table of ``key`` from a name -> tensor mapping (a safetensors file's tensors).

        Raises:
            PackError: every problem found, each naming the tensor and the fix: no ring tensors, a gap in the shard
                numbers, shards of different widths or uneven row counts, a width that is no ring of 160 positions,
                a missing or misshapen head tensor, head ranges outside the table.
        """
        names, problems = ring_names(key, tensors, where)
        shards = [tensors[n] for n in names]
        width = shards[0].shape[1] if shards[0].dim() == 2 else -1
        k_bits = (width - 1) * 16 // NGRAM_ROW_DIM if width > 1 else 0
        problems += ring_problems(key, names, shards, width, k_bits)
        aux = {suffix: tensors.get(f"{key}.{suffix}") for suffix in AUX}
        problems += [Problem(key, f"{key}.{suffix}", "missing", RECOPY) for suffix in AUX if aux[suffix] is None]
        raise_problems(where, problems)
        raise_problems(where, head_problems(key, aux))
        offsets = aux["head_offsets"].reshape(-1).long()
        sizes = aux["head_vocab_sizes"].reshape(-1).long()
        raise_problems(where, tiling_problems(key, offsets, sizes, sum(s.shape[0] for s in shards)))
        return cls(
            key=key,
            shards=shards,
            rows_per_shard=shards[0].shape[0],
            k_bits=k_bits,
            head_offsets=offsets,
            head_vocab_sizes=sizes,
            layer_multipliers=aux["layer_multipliers"].reshape(-1).long(),
            head_bias=aux["head_bias"].float(),
            shard_names=tuple(names),
        )

    @classmethod
    def load(cls, pack: str | Path, key: str) -> NgramTable:
        """The table of ``key`` from the pack directory's :data:`NGRAM_FILE`.

        Raises:
            PackError: the file is missing (the pack's index does not list it, so copies of a pack often lack it)
                or its table is malformed (see :meth:`from_tensors`).
        """
        from safetensors.torch import load_file

        path = Path(pack) / NGRAM_FILE
        if not path.is_file():
            what = "missing: the n-gram table is stored outside the index"
            raise PackError(str(pack), [Problem(key, NGRAM_FILE, what, f"{RECOPY} into {pack}")])
        tensors = load_file(str(path))
        return cls.from_tensors(key, {k: v for k, v in tensors.items() if k.startswith(f"{key}.")}, str(pack))

    @classmethod
    def open_layout(cls, path: str | Path, prefix: str) -> NgramTable:
        """The table behind module ``prefix`` in the file ``path``, read from the file's header: its ring shards are
        ``meta`` tensors (shape and dtype, no data; :meth:`read_rows` reads rows), its head tensors are loaded (a
        few hundred bytes). ``prefix`` may be vLLM's spelling of the module: tables are matched on their canonical
        name (:func:`quantpack_core.names.normalize_prefix`).

        Raises:
            PackError: the file is missing or unreadable, holds no table for ``prefix``, or the table is malformed
                (see :meth:`from_tensors`).
        """
        from safetensors import safe_open

        from .names import normalize_prefix

        path = Path(path)
        if not path.is_file():
            what = "missing: the n-gram table is stored outside the index"
            raise PackError(str(path.parent), [Problem(prefix, NGRAM_FILE, what, f"{RECOPY} into {path.parent}")])
        try:
            with safe_open(str(path), framework="pt") as f:
                names = list(f.keys())
                want = normalize_prefix(prefix)
                keys = sorted({n.rsplit(".", 2 if ".shard_" in n else 1)[0] for n in names if n.endswith(".trellis")})
                key = next((k for k in keys if normalize_prefix(k) == want), None)
                if key is None:
                    what = f"holds no n-gram table for this module (tables: {', '.join(keys) or 'none'})"
                    raise PackError(str(path.parent), [Problem(prefix, path.name, what, RECOPY)])
                tensors: dict[str, torch.Tensor] = {}
                for n in names:
                    if not n.startswith(f"{key}."):
                        continue
                    if n.endswith(".trellis"):
                        sl = f.get_slice(n)
                        dtype = SAFETENSORS_DTYPES.get(sl.get_dtype(), torch.uint8)
                        tensors[n] = torch.empty(sl.get_shape(), dtype=dtype, device="meta")
                    else:
                        tensors[n] = f.get_tensor(n)
        except PackError:
            raise
        except Exception as e:  # a truncated or foreign file
            what = f"unreadable ({type(e).__name__}: {e})"
            raise PackError(str(path.parent), [Problem(prefix, path.name, what, RECOPY)]) from e
        return cls.from_tensors(key, tensors, str(path.parent))

    def read_rows(self, path: str | Path, start: int, stop: int) -> torch.Tensor:
        """Packed rows ``[start, stop)`` of the table (global row ids) from the file ``path``, reading only them.

        Returns:
            int16 ``(stop - start, 1 + 10 K)``.

        Raises:
            IndexError: a range outside the table.
        """
        from safetensors import safe_open

        if not 0 <= start <= stop <= self.num_rows:
            raise IndexError(f"{self.key}: rows [{start}, {stop}) outside the table's {self.num_rows}")
        out = torch.empty((stop - start, self.shards[0].shape[1]), dtype=torch.int16)
        with safe_open(str(path), framework="pt") as f:
            for i, name in enumerate(self.shard_names):
                a = max(start, i * self.rows_per_shard)
                b = min(stop, i * self.rows_per_shard + self.shards[i].shape[0])
                if a < b:
                    local = a - i * self.rows_per_shard
                    out[a - start : b - start] = f.get_slice(name)[local : local + b - a]
        return out

    def heads_of(self, rows: torch.Tensor) -> torch.Tensor:
        """The hash head each global row belongs to: the last head whose offset is not above it (int64)."""
        heads = torch.searchsorted(self.head_offsets, rows.long().reshape(-1), right=True) - 1
        return heads.clamp(0, self.head_offsets.numel() - 1).reshape(rows.shape)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Decoded rows of global row ids (any shape): ``(*ids.shape, 160)`` float32, with each row's head bias.

        Raises:
            IndexError: an id outside ``0 .. num_rows - 1``.
        """
        flat = ids.long().reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_rows):
            raise IndexError(f"{self.key}: row ids must lie in 0..{self.num_rows - 1}")
        packed = torch.empty((flat.numel(), self.shards[0].shape[1]), dtype=torch.int16)
        shard_of, local = flat // self.rows_per_shard, flat % self.rows_per_shard
        for s, shard in enumerate(self.shards):
            pick = shard_of == s
            if bool(pick.any()):
                packed[pick] = shard[local[pick]]
        bias = self.head_bias[self.heads_of(flat)]
        return decode_ring_rows(packed, self.k_bits, bias).reshape(*ids.shape, NGRAM_ROW_DIM)


def raise_problems(where: str, problems: list[Problem]) -> None:
    """Raise :class:`PackError` at ``where`` with ``problems``, if there are any."""
    if problems:
        raise PackError(where, problems)


def ring_names(key: str, tensors: Mapping[str, torch.Tensor], where: str) -> tuple[list[str], list[Problem]]:
    """The ring tensors of table ``key`` in row order, and a problem if a shard follows a gap in the numbers.

    Raises:
        PackError: the table has no ring tensor.
    """
    names = [f"{key}.trellis"] if f"{key}.trellis" in tensors else []
    while f"{key}.shard_{len(names)}.trellis" in tensors:
        names.append(f"{key}.shard_{len(names)}.trellis")
    stray = sorted(n for n in tensors if n.startswith(f"{key}.shard_") and n.endswith(".trellis") and n not in names)
    problems = []
    if stray:
        problems.append(
            Problem(
                key, stray[0], "a shard after a gap in the shard numbers", "restore the missing shards from the pack"
            )
        )
    if not names:
        missing = Problem(key, f"{key}.shard_0.trellis", "no ring rows for this n-gram table", RECOPY)
        raise PackError(where, [missing])
    return names, problems


def ring_problems(key: str, names: list[str], shards: list[torch.Tensor], width: int, k_bits: int) -> list[Problem]:
    """The ring shards' problems: a dtype, rank or width of its own, uneven row counts (only the last may be shorter),
    rows of ``width`` words that are no ring of 160 positions at ``k_bits``."""
    problems = []
    for name, shard in zip(names, shards, strict=True):
        if shard.dtype != torch.int16 or shard.dim() != 2 or shard.shape[1] != width:
            what = f"{shard.dtype} {list(shard.shape)}: ring rows are 2-D int16 of one width"
            problems.append(Problem(key, name, what, RECONVERT))
    rows_per_shard = shards[0].shape[0]
    if any(s.shape[0] != rows_per_shard for s in shards[:-1]) or shards[-1].shape[0] > rows_per_shard:
        problems.append(
            Problem(key, names[-1], "shards of uneven row counts (only the last may be shorter)", RECONVERT)
        )
    try:
        if ring_dim(width, k_bits) != NGRAM_ROW_DIM:
            raise ValueError
    except Exception:
        what = f"rows of {width} words are no ring of {NGRAM_ROW_DIM} positions"
        problems.append(Problem(key, names[0], what, RECONVERT))
    return problems


def head_problems(key: str, aux: Mapping[str, torch.Tensor]) -> list[Problem]:
    """The head tensors' problems (``aux``: the :data:`AUX` tensors, all present): counts that disagree, a bias of
    another shape or with NaN / Inf, float or bool counts and multipliers, no head at all."""
    problems = []

    def problem(suffix: str, what: str) -> None:
        problems.append(Problem(key, f"{key}.{suffix}", what, RECONVERT))

    heads = aux["head_offsets"].numel()
    if aux["head_vocab_sizes"].numel() != heads:
        problem("head_vocab_sizes", f"{aux['head_vocab_sizes'].numel()} entries for {heads} heads")
    bias = aux["head_bias"]
    if tuple(bias.shape) != (heads, NGRAM_ROW_DIM):
        problem("head_bias", f"shape {list(bias.shape)}, want [{heads}, 160]")
    elif bias.dtype.is_floating_point and not torch.isfinite(bias).all():
        bad = int((~torch.isfinite(bias)).sum())
        problem("head_bias", f"{bad} NaN / Inf values (every row of their head would be)")
    for suffix in ("head_offsets", "head_vocab_sizes", "layer_multipliers"):
        if aux[suffix].dtype.is_floating_point or aux[suffix].dtype == torch.bool:
            problem(suffix, f"{aux[suffix].dtype}: row counts and hash multipliers are integers")
    if heads == 0:
        problem("head_offsets", "no hash heads")
    return problems


def tiling_problems(key: str, offsets: torch.Tensor, sizes: torch.Tensor, total: int) -> list[Problem]:
    """A problem if the heads do not tile the table of ``total`` rows: the first starts at row 0, each starts where the
    one before it ends, none is empty, the last ends inside the table."""
    ends = offsets + sizes
    if int(offsets[0]) != 0 or bool((sizes <= 0).any()) or bool((offsets[1:] != ends[:-1]).any()):
        what = f"heads do not tile the table (offsets {offsets.tolist()[:8]}, sizes {sizes.tolist()[:8]})"
        return [Problem(key, f"{key}.head_offsets", what, RECONVERT)]
    if int(ends[-1]) > total:
        return [
            Problem(
                key, f"{key}.head_offsets", f"heads reach row {int(ends[-1])}, the table has {total} rows", RECONVERT
            )
        ]
    return []


def make_ngram_tensors(
    key: str,
    head_vocab_sizes: list[int],
    k_bits: int,
    rows_per_shard: int,
    ngram_size: int = 3,
    generator: torch.Generator | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """A random n-gram table in exllamav3's layout, for test packs: random ring symbols (every one is a legal
    ring), row scales of a real table's size, a random head bias.

    Args:
        key: the module's checkpoint name.
        head_vocab_sizes: rows per hash head (heads are laid out one after another).
        k_bits: K of the rings (1..8).
        rows_per_shard: rows of every shard but the last.
        ngram_size: token positions per n-gram: one hash multiplier each (the first primes above 10 000).

    Returns:
        ``(tensors, symbols, scales)``: the name -> tensor mapping to save as :data:`NGRAM_FILE`, and the encoded
        symbols ``(rows, 160)`` and float16 scales ``(rows,)`` in global row order.
    """
    from .codec.ring import pack_ring_rows

    rows = sum(head_vocab_sizes)
    g = generator or torch.Generator().manual_seed(0)
    symbols = torch.randint(0, 1 << k_bits, (rows, NGRAM_ROW_DIM), generator=g)
    scales = (torch.rand(rows, generator=g) * 0.02 + 0.002).half()
    packed = pack_ring_rows(symbols, scales, k_bits)
    heads = len(head_vocab_sizes)
    offsets = torch.tensor([0, *head_vocab_sizes[:-1]], dtype=torch.int64).cumsum(0)
    primes = (p for p in range(10_001, 20_000, 2) if all(p % d for d in range(3, int(p**0.5) + 1, 2)))
    multipliers = [next(primes) for _ in range(ngram_size)]
    starts = range(0, rows, rows_per_shard)
    tensors = {f"{key}.shard_{i}.trellis": packed[a : a + rows_per_shard].clone() for i, a in enumerate(starts)}
    tensors[f"{key}.head_offsets"] = offsets
    tensors[f"{key}.head_vocab_sizes"] = torch.tensor(head_vocab_sizes, dtype=torch.int64)
    tensors[f"{key}.layer_multipliers"] = torch.tensor(multipliers, dtype=torch.int64)
    tensors[f"{key}.head_bias"] = (torch.randn((heads, NGRAM_ROW_DIM), generator=g) * 0.01).half()
    return tensors, symbols, scales
