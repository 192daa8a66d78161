"""Tensor-parallel geometry of a trellis-format layer: what a rank keeps, and how it runs when a cut misses a block.

Format-free (the format cuts its own tensors: :func:`quantpack_core.codec.cut_tensors` for EXL3). An EXL3 weight
is ``W = diag(suh) H What H diag(svh)`` with 128-wide Hadamard blocks on both sides, so a slice of its rows (input
features) or columns (output features) is again an EXL3 tensor exactly when the slice covers whole 128-feature
blocks: the trellis is cut between 16x16 tiles and suh / svh are cut alongside. A rank's share that
starts or ends inside a block cannot be cut out exactly; then the rank keeps the whole blocks its share touches
(its *spans*: at most one partly foreign block at each end of each range) and:

* **column parallel** (the rank owns some output features of the tensor): it selects its columns of the spans'
  product;
* **row parallel** (the rank owns input features ``[i0, i1)`` and the ranks' outputs are summed): it zero-extends
  its input slice to the span's width at its place, so its product is exactly its part of the sum.

A column cut may own several ranges of one tensor: a fused shard such as Qwen3.5's ``in_proj_qkv`` (three of
``in_proj_qkvz``'s four partitions) gives the rank one range per partition. vLLM splits each partition evenly: rank
``r`` of ``tp`` owns ``[r * n / tp, (r + 1) * n / tp)`` of a partition of ``n`` logical features, except the key /
value partitions of ``QKVParallelLinear`` when there are fewer KV heads than ranks: then ``replicas`` consecutive
ranks share one head, and rank ``r`` owns head ``r // replicas``.

Plain torch; no vLLM import. Source: docs/architecture.md ("Tensor parallelism"); vLLM ``QKVParallelLinear`` /
``MergedColumnParallelLinear`` (``vllm/model_executor/layers/linear.py``: the per-partition split and
``num_kv_head_replicas``); docs/exl3-format.md (the tile and block layout).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .codec.hadamard import HAD_BLOCK
from .errors import GeometryError

COLUMN = "column"
ROW = "row"


@dataclass(frozen=True)
class TpCut:
    """One rank's part of one tensor of a layer.

    Attributes:
        kind: ``"column"`` (output features split) or ``"row"`` (input features split).
        ranges: the rank's logical features along the split side, as ``[start, stop)`` ranges in the tensor's own
            feature order (one range, except a column cut of a tensor that covers several partitions).
        features: the tensor's logical features along the split side.
        sliced: True when every range covers whole 128-feature blocks (the last may end at ``features`` inside the
            padded last block) and exactly the share is kept; False for the fallback, which keeps the share's
            blocks (:attr:`spans`) and selects or zero-extends within them.
    """

    kind: str
    ranges: tuple[tuple[int, int], ...]
    features: int
    sliced: bool

    @property
    def column(self) -> bool:
        """Whether the cut splits output features (column parallel) rather than input features (row parallel)."""
        return self.kind == COLUMN

    @property
    def start(self) -> int:
        """First feature of the first range."""
        return self.ranges[0][0]

    @property
    def stop(self) -> int:
        """End of the last range."""
        return self.ranges[-1][1]

    @property
    def width(self) -> int:
        """Features the rank owns (sum of its ranges)."""
        return sum(b - a for a, b in self.ranges)

    def columns(self) -> list[int]:
        """The owned features, in order."""
        return [i for a, b in self.ranges for i in range(a, b)]

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """The stored features the rank keeps, as ``[start, stop)`` spans of whole 128-feature blocks: each range
        widened to the blocks it touches (the last may end at the stored, padded end), overlapping or touching spans
        merged. For a sliced cut these are the ranges' own blocks."""
        out: list[tuple[int, int]] = []
        for a, b in self.ranges:
            lo, hi = a // HAD_BLOCK * HAD_BLOCK, -(-b // HAD_BLOCK) * HAD_BLOCK
            if out and lo <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], hi))
            else:
                out.append((lo, hi))
        return tuple(out)

    @property
    def kept_features(self) -> int:
        """Logical features of the kept spans: their widths, the last one's cut at ``features`` (the stored
        padding past the layer's features is not a feature). Equals :attr:`width` for a sliced cut."""
        spans = self.spans
        return sum(b - a for a, b in spans) - max(0, spans[-1][1] - self.features)

    def kept_positions(self) -> list[int]:
        """The owned features' positions among the kept spans' features, in order: the columns a column-parallel
        fallback selects from the spans' product."""
        out, offset = [], 0
        spans = iter(self.spans)
        lo, hi = next(spans)
        for a, b in self.ranges:
            while a >= hi:
                offset += hi - lo
                lo, hi = next(spans)
            out.extend(range(offset + a - lo, offset + b - lo))
        return out

    def row_pad(self) -> tuple[int, int]:
        """Row cut: the zeros ``(before, after)`` that put the rank's input slice at its place in the kept span's
        logical width (``(0, 0)`` for a sliced cut)."""
        lo = self.spans[0][0]
        return self.start - lo, self.kept_features - (self.stop - lo)


def padded(features: int, block: int = HAD_BLOCK) -> int:
    """``features`` rounded up to whole blocks (EXL3 stores every layer padded to 128-feature Hadamard blocks)."""
    return (features + block - 1) // block * block


def padding_error(
    stored: tuple[int, int], in_features: int, out_features: int, is_lm_head: bool, stores: str
) -> str | None:
    """The geometry rule of the trellis formats (EXL3, escha): stored sizes are the logical ones rounded up to
    whole 128-feature blocks, and a head's stored rows may exceed its vocabulary by less than one block (the pack pads
    the vocabulary, vLLM pads it to a multiple of 64).

    Args:
        stored: ``(k, n)`` stored input and output features.
        in_features, out_features: the model layer's logical sizes.
        is_lm_head: the layer is the head.
        stores: how the message describes the stored matrix, with ``{k}`` / ``{n}`` (e.g. ``"stores a {k}x{n} (in x
            out) EXL3 matrix"``).

    Returns:
        None when the stored sizes fit the layer, else why not (the stored and the wanted sizes).
    """
    k, n = stored
    want_k, want_n = padded(in_features), padded(out_features)
    ok_n = n == want_n or (is_lm_head and n >= out_features and n - out_features < HAD_BLOCK)
    if k == want_k and ok_n:
        return None
    return (
        f"{stores.format(k=k, n=n)}, the model's layer needs {in_features}x{out_features} (stored as "
        f"{want_k}x{want_n} after padding to {HAD_BLOCK})"
    )


def check_rank(tp_size: int, tp_rank: int) -> None:
    """Raise ``ValueError`` unless ``0 <= tp_rank < tp_size`` and ``tp_size >= 1``."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor-parallel rank {tp_rank} of {tp_size}: need tp_size >= 1 and 0 <= tp_rank < tp_size")


def tp_range(features: int, tp_size: int, tp_rank: int, layer: str = "") -> tuple[int, int]:
    """vLLM's even split: the features ``[start, stop)`` rank ``tp_rank`` of ``tp_size`` owns.

    Raises:
        ValueError: a bad rank.
        GeometryError: ``features`` not divisible by ``tp_size`` (vLLM refuses such a split too; named here first).
    """
    check_rank(tp_size, tp_rank)
    if features % tp_size:
        raise GeometryError(
            f"{layer or 'layer'}: {features} features cannot be split evenly over {tp_size} tensor-parallel ranks "
            "-> choose a tensor-parallel size that divides it"
        )
    share = features // tp_size
    return tp_rank * share, (tp_rank + 1) * share


def on_blocks(ranges: Sequence[tuple[int, int]], features: int) -> bool:
    """Whether every range starts on a 128-feature block and ends on one (or at ``features``, in the padded block)."""
    return all(a % HAD_BLOCK == 0 and (b % HAD_BLOCK == 0 or b == features) for a, b in ranges)


def make_cut(kind: str, ranges: Sequence[tuple[int, int]], features: int) -> TpCut:
    """A :class:`TpCut` for explicit ranges: sliced when :func:`on_blocks`, else the fallback on the ranges' blocks.

    Raises:
        ValueError: unknown ``kind``, no range, ranges out of order or outside ``[0, features)``, or several ranges
            for a row cut.
    """
    if kind not in (COLUMN, ROW):
        raise ValueError(f"unknown split {kind!r}: expected {COLUMN!r} or {ROW!r}")
    ranges = tuple((int(a), int(b)) for a, b in ranges)
    if not ranges or (kind == ROW and len(ranges) > 1):
        raise ValueError(f"a {kind} cut needs {'one range' if kind == ROW else 'at least one range'}, got {ranges}")
    prev = 0
    for a, b in ranges:
        if not prev <= a < b <= features:
            raise ValueError(f"cut ranges {ranges} are not ordered, disjoint ranges inside [0, {features})")
        prev = b
    return TpCut(kind, ranges, features, on_blocks(ranges, features))


def plan_cut(kind: str, features: int, tp_size: int, tp_rank: int, layer: str = "") -> TpCut:
    """How rank ``tp_rank`` holds its part of a one-partition layer split evenly along ``kind``.

    Args:
        kind: ``"column"`` or ``"row"``.
        features: logical features along the split side.
        tp_size, tp_rank: the rank.
        layer: module name for messages.

    Returns:
        a :class:`TpCut` with one range; ``sliced`` when both ends fall on 128-feature block boundaries (a rank whose
        end is the layer's last logical feature may end inside the last, padded block).

    Raises:
        ValueError: unknown ``kind`` or a bad rank. GeometryError: an uneven split (:func:`tp_range`).
    """
    start, stop = tp_range(features, tp_size, tp_rank, layer)
    return make_cut(kind, [(start, stop)], features)


def partition_ranges(
    local_sizes: Sequence[int],
    parts: Sequence[int],
    tp_size: int,
    tp_rank: int,
    replicas: Sequence[int] | None = None,
) -> tuple[list[tuple[int, int]], int]:
    """The ranges a column-parallel rank owns of one tensor that covers partitions ``parts`` of a fused layer.

    Args:
        local_sizes: per partition of the layer, the features each rank holds (vLLM's ``output_partition_sizes``).
        parts: the partitions the tensor covers, in its own order (e.g. ``(0, 1, 2)`` for Qwen3.5's
            ``in_proj_qkv``; ``(1,)`` for ``k_proj``).
        tp_size, tp_rank: the rank.
        replicas: per partition, how many consecutive ranks hold the same features (``QKVParallelLinear``'s
            ``num_kv_head_replicas`` for k and v; 1 elsewhere). None: 1 everywhere.

    Returns:
        ``(ranges, features)``: the rank's ranges in the tensor's logical feature order, and the tensor's logical
        width (sum of its partitions' full sizes ``local * tp_size / replicas``).

    Raises:
        ValueError: a bad rank, a partition index out of range, or a replica count not dividing ``tp_size``.
    """
    check_rank(tp_size, tp_rank)
    reps = list(replicas) if replicas is not None else [1] * len(local_sizes)
    ranges, offset = [], 0
    for j in parts:
        if not 0 <= j < len(local_sizes):
            raise ValueError(f"partition {j} outside the layer's {len(local_sizes)} partitions")
        rep = reps[j]
        if rep < 1 or tp_size % rep:
            raise ValueError(f"partition {j}: {rep} replicas do not divide {tp_size} ranks")
        local = local_sizes[j]
        start = (tp_rank // rep) * local
        ranges.append((offset + start, offset + start + local))
        offset += local * tp_size // rep
    return ranges, offset


def cut_dense(w: torch.Tensor, cut: TpCut) -> torch.Tensor:
    """The rank's part of a dense ``(out, in)`` weight (dense weights have no blocks: always sliced exactly).

    Returns:
        column cut: the rows of every range, concatenated; row cut: columns ``[start, stop)``.
    """
    if cut.kind == COLUMN:
        return torch.cat([w[a:b] for a, b in cut.ranges]).contiguous()
    return w[:, cut.start : cut.stop].contiguous()


def sliced_tp_sizes(features: Sequence[int], limit: int = 16) -> list[int]:
    """Tensor-parallel sizes up to ``limit`` that split every one of ``features`` evenly into whole 128-feature
    blocks per rank (the sizes at which no fallback is needed), for messages."""
    return [d for d in range(1, limit + 1) if all(n % d == 0 and (n // d) % HAD_BLOCK == 0 for n in features)]


def expert_split(num_experts: int, tp_size: int, tp_rank: int) -> list[int]:
    """The whole experts rank ``tp_rank`` keeps and runs when a MoE layer's intermediate share is inside a
    128-channel block (the experts' fallback): experts ``e`` with ``e % tp_size == tp_rank``, so every rank holds at
    most ``ceil(E / tp)`` experts whole and the ranks' outputs, each the sum over its own routed experts, add up to
    the layer's output in vLLM's all-reduce. Ranks past ``num_experts - 1`` keep none.

    Args:
        num_experts: the layer's experts ``E`` (logical ids ``0..E-1``).
        tp_size, tp_rank: the tensor-parallel size and this rank.

    Returns:
        the rank's logical expert ids, ascending (``[]`` for a rank without experts).

    Raises:
        ValueError: a bad rank, or ``num_experts < 1``.

    Source: vLLM's round-robin expert placement (``fused_moe/expert_map_manager.py``, ``expert_placement_strategy=
    "round_robin"``: the same experts per rank, the others mapped to -1); the bank (docs/moe-bank.md) cuts the
    intermediate channels instead, and this split takes over where that cut would leave a block.
    """
    check_rank(tp_size, tp_rank)
    if num_experts < 1:
        raise ValueError(f"a MoE layer needs at least one expert, got {num_experts}")
    return list(range(tp_rank, num_experts, tp_size))
