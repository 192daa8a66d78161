"""What serving a pack at tensor-parallel size N means before anything loads: how each quantized module is cut per
rank (exact, the block fallback, or refused), the weights each rank holds, and the KV cache of one sequence.

It applies the rules the vLLM methods apply at load (docs/architecture.md, "Tensor parallelism"; :mod:`.tp`):
column-parallel modules (q / k / v, gate / up, GDN input projections, the head) split their outputs, row-parallel
ones (o, down, GDN output) their inputs, expert banks their intermediate channels; a rank's share is exact when it
covers whole 128-feature Hadamard blocks, else EXL3 keeps the blocks the share touches (the fallback: more memory
and work on that rank) and escha refuses. An uneven split is refused by vLLM itself. k / v with fewer heads than
ranks are replicated, one head per rank, as vLLM's ``QKVParallelLinear`` does. Qwen3-Next's ``in_proj_qkvz`` is
one interleaved partition (its head groups stay whole under an even split: vLLM's ``create_qkvz_proj`` gives it one
output size), Qwen3.5's ``in_proj_qkv`` three (q, k, v: each split on its own).

Sizes are the stored ones (EXL3 pads to 128), so a module whose logical size is not a multiple of 128 is judged on
its padded size; the KV cache counts every layer that stores a k projection, at full length (a sliding window would
hold less), in elements of the KV-cache dtype (:func:`kv_element_bytes`: vLLM's ``auto`` is the model's dtype).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import GeometryError
from .format import pack_formats
from .inventory import ModuleInfo
from .pack import Pack
from .tp import COLUMN, ROW, make_cut, partition_ranges, plan_cut

#: last name component -> how tensor parallelism splits the module
COLUMN_NAMES = frozenset(
    {"q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj", "in_proj_qkv", "in_proj_z",
     "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba", "lm_head", "w1", "w3"}
)  # fmt: skip
ROW_NAMES = frozenset({"o_proj", "down_proj", "out_proj", "w2"})
EXPERT = re.compile(r"\.experts\.\d+\.")
#: outcomes
EXACT, FALLBACK, REFUSED, REPLICATED = "exact", "fallback", "refused", "replicated"


@dataclass(frozen=True)
class ModuleCut:
    """One module at a tensor-parallel size.

    Attributes:
        key: the module.
        kind: ``"column"``, ``"row"`` or ``"expert"`` (intermediate channels of an expert), or ``"-"``.
        features: stored features along the split side.
        share: features rank 0 owns.
        kept: stored features rank 0 holds (its share, or the blocks the share touches under the fallback).
        outcome: ``"exact"``, ``"fallback"``, ``"refused"`` or ``"replicated"`` (not split).
        why: for a fallback or refusal, what does not divide.
        rank_bytes: bytes rank 0 holds of the module.
    """

    key: str
    kind: str
    features: int
    share: int
    kept: int
    outcome: str
    why: str
    rank_bytes: int


def _text_config(pack: Pack) -> dict:
    text = pack.config.get("text_config")
    return text if isinstance(text, dict) and text else pack.config


def module_cut(
    m: ModuleInfo,
    tp: int,
    kv_heads: int | None,
    head_dim: int | None,
    fallback: bool = True,
    parts: dict[str, list[int]] | None = None,
) -> ModuleCut:
    """How rank 0 of ``tp`` holds module ``m`` (see the module docstring).

    Args:
        m: a quantized (EXL3) module of the pack.
        tp: the tensor-parallel size.
        kv_heads, head_dim: the model's key-value heads and head width (for k / v replication), when known.
        fallback: whether the format keeps whole blocks around an inexact share (EXL3) or refuses it (escha).
        parts: module name -> the sizes of the partitions it holds, each split over the ranks on its own.
    """
    name = m.key.rsplit(".", 1)[-1]
    if m.padded_shape is None:
        return ModuleCut(m.key, "-", 0, 0, 0, REPLICATED, "", m.nbytes)
    if tp == 1:
        return ModuleCut(m.key, "-", 0, 0, 0, EXACT, "", m.nbytes)
    n_in, n_out = m.padded_shape
    if EXPERT.search(m.key + "."):
        kind, features = "expert", (n_out if name in ("gate_proj", "up_proj", "w1", "w3") else n_in)
    elif name in COLUMN_NAMES:
        kind, features = COLUMN, n_out
    elif name in ROW_NAMES:
        kind, features = ROW, n_in
    else:
        return ModuleCut(m.key, "-", 0, 0, 0, REPLICATED, "", m.nbytes)
    if parts and name in parts and kind == COLUMN:
        # a tensor holding several partitions (Qwen3.5's GDN in_proj_qkv: q, k, v): each is split on its own
        sizes = parts[name]
        if sum(sizes) == features and all(n % tp == 0 for n in sizes):
            ranges, width = partition_ranges([n // tp for n in sizes], tuple(range(len(sizes))), tp, 0)
            cut = make_cut(COLUMN, ranges, width)
            share = sum(b - a for a, b in ranges)
            if cut.sliced:
                return ModuleCut(m.key, kind, features, share, share, EXACT, "", m.nbytes // tp)
            why = f"its parts {sizes} give rank shares off the 128-feature blocks"
            if not fallback:
                return ModuleCut(m.key, kind, features, share, 0, REFUSED, why, 0)
            kept = cut.kept_features
            return ModuleCut(m.key, kind, features, share, kept, FALLBACK, why, m.nbytes * kept // features)
    if name in ("k_proj", "v_proj") and kv_heads and head_dim and kv_heads < tp:
        # vLLM replicates the kv heads: each rank holds one whole head
        share = head_dim
        exact = head_dim % 128 == 0
        kept = share if exact else -(-head_dim // 128) * 128
        why = "" if exact else f"a head of {head_dim} is not whole 128-feature blocks"
        outcome = EXACT if exact else (FALLBACK if fallback else REFUSED)
        return ModuleCut(m.key, kind, features, share, kept, outcome, why, m.nbytes * kept // max(features, 1))
    try:
        cut = plan_cut(ROW if kind == ROW else COLUMN, features, tp, 0, m.key)
    except GeometryError:
        why = f"{features} features do not split evenly over {tp} ranks"
        return ModuleCut(m.key, kind, features, 0, 0, REFUSED, why, 0)
    if cut.sliced:
        return ModuleCut(m.key, kind, features, cut.width, cut.width, EXACT, "", m.nbytes // tp)
    why = f"a share of {cut.width} is not whole 128-feature blocks"
    if kind == "expert":  # the bank keeps whole experts per rank instead (quantpack_core.tp.expert_split)
        return ModuleCut(m.key, kind, features, cut.width, features, FALLBACK, why + "; whole experts per rank", 0)
    if not fallback:
        return ModuleCut(m.key, kind, features, cut.width, 0, REFUSED, why, 0)
    kept = cut.kept_features
    return ModuleCut(m.key, kind, features, cut.width, kept, FALLBACK, why, m.nbytes * kept // features)


@dataclass(frozen=True)
class TpReport:
    """A pack at one tensor-parallel size (rank 0; the other ranks hold the same amounts, up to a block).

    Attributes:
        tp: the size.
        cuts: every quantized module's :class:`ModuleCut`.
        weights_bytes: bytes of weights rank 0 holds (quantized modules as cut, vocabulary tables split, experts of a
            whole-expert fallback as an even share, everything else whole).
        kv_bytes_per_token: bytes of KV cache per token per rank, or None when the config lacks the sizes.
        attention_layers: layers counted in the KV cache.
        model_refusals: what vLLM itself refuses at this size (attention heads that do not divide over the ranks).
        kv_element_bytes: bytes per KV-cache element the KV figure assumes.
    """

    tp: int
    cuts: tuple[ModuleCut, ...]
    weights_bytes: int
    kv_bytes_per_token: int | None
    attention_layers: int
    model_refusals: tuple[str, ...] = ()
    kv_element_bytes: int = 2

    @property
    def refused(self) -> list[ModuleCut]:
        """Modules vLLM or the method would refuse at this size."""
        return [c for c in self.cuts if c.outcome == REFUSED]

    @property
    def fallbacks(self) -> list[ModuleCut]:
        """Modules that load through the block fallback (more memory and work on a rank)."""
        return [c for c in self.cuts if c.outcome == FALLBACK]


#: bytes per element of the KV-cache dtypes vLLM's ``--kv-cache-dtype`` names (``fp8*``: one byte)
KV_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}


def kv_element_bytes(config: dict, kv_cache_dtype: str = "auto") -> int:
    """Bytes per KV-cache element for vLLM's ``--kv-cache-dtype`` value.

    Args:
        config: the model's (text) config.json; ``auto`` takes its ``torch_dtype`` / ``dtype`` (bfloat16 when it
            names none, as vLLM's default for such checkpoints).
        kv_cache_dtype: ``auto``, ``bfloat16``, ``float16``, ``float32`` or any ``fp8*`` name.

    Raises:
        ValueError: a name vLLM would not take (the message lists the accepted ones).
    """
    name = str(kv_cache_dtype).lower()
    if name.startswith("fp8"):
        return 1
    if name == "auto":
        model = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
        return KV_DTYPE_BYTES.get(str(model).lower().removeprefix("torch."), 2)
    if name not in KV_DTYPE_BYTES:
        raise ValueError(f"unknown KV-cache dtype {kv_cache_dtype!r}: use auto, {', '.join(KV_DTYPE_BYTES)} or fp8*")
    return KV_DTYPE_BYTES[name]


def tp_report(pack: Pack, tp: int, fallback: bool = True, kv_cache_dtype: str = "auto") -> TpReport:
    """Plan ``pack`` at tensor-parallel size ``tp`` (see the module).

    Args:
        pack: an opened pack.
        tp: the tensor-parallel size (>= 1).
        fallback: whether the pack's format keeps whole blocks around an inexact share (EXL3) or refuses (escha).
        kv_cache_dtype: vLLM's ``--kv-cache-dtype`` (:func:`kv_element_bytes`).

    Raises:
        ValueError: ``tp`` < 1, or an unknown ``kv_cache_dtype``.
    """
    if tp < 1:
        raise ValueError(f"a tensor-parallel size is at least 1, not {tp}")
    cfg = _text_config(pack)
    element = kv_element_bytes({**pack.config, **cfg}, kv_cache_dtype)
    heads, kv_heads = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    kv_heads = kv_heads if isinstance(kv_heads, int) and kv_heads > 0 else heads
    hidden = cfg.get("hidden_size")
    head_dim = cfg.get("head_dim")
    if not isinstance(head_dim, int) and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        head_dim = hidden // heads
    parts: dict[str, list[int]] = {}
    lk, lkd, lv, lvd = (cfg.get(k) for k in ("linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads",
                                             "linear_value_head_dim"))  # fmt: skip
    if all(isinstance(v, int) and v > 0 for v in (lk, lkd, lv, lvd)):
        parts["in_proj_qkv"] = [lk * lkd, lk * lkd, lv * lvd]
    cuts, weights = [], 0
    for m in pack.modules.values():
        if m.format in pack_formats():
            c = module_cut(m, tp, kv_heads if isinstance(kv_heads, int) else None, head_dim, fallback, parts)
            cuts.append(c)
            weights += c.rank_bytes if not (c.kind == "expert" and c.outcome == FALLBACK) else m.nbytes // tp
        elif m.key.endswith(("embed_tokens", "lm_head")) and m.format in ("dense", "int8-rows"):
            weights += -(-m.nbytes // tp)  # vocabulary-parallel
        elif EXPERT.search(m.key + ".") or m.key.rsplit(".", 1)[-1] in COLUMN_NAMES | ROW_NAMES:
            weights += -(-m.nbytes // tp)  # dense shards of split layers
        else:
            weights += m.nbytes
    refusals = []
    if isinstance(heads, int) and heads > 0 and heads % tp:
        refusals.append(f"{heads} attention heads do not divide over {tp} ranks (vLLM requires it)")
    if isinstance(kv_heads, int) and kv_heads > 0 and kv_heads % tp and tp % kv_heads:
        refusals.append(f"{kv_heads} key-value heads neither divide {tp} ranks nor are divided by them")
    refusals += _head_vocabulary_refusal(pack, cfg.get("vocab_size"), tp)
    layers = {
        k.rsplit(".self_attn", 1)[0]
        for k in pack.modules
        if re.search(r"\.self_attn\.(k_proj|qkv_proj)$", k) and not re.search(r"(^|\.)(mtp|visual|vision\w*)\.", k)
    }
    kv = None
    if isinstance(kv_heads, int) and isinstance(head_dim, int) and head_dim > 0:
        per_rank_heads = max(1, kv_heads // tp)
        kv = 2 * len(layers) * per_rank_heads * head_dim * element
    return TpReport(tp, tuple(cuts), weights, kv, len(layers), tuple(refusals), element)


def _head_vocabulary_refusal(pack: Pack, vocab: object, tp: int) -> list[str]:
    """Where a coded head's vocabulary does not fill the ``tp`` partitions vLLM pads it to (a multiple of 64, split
    evenly): the plugins cut a quantized head to whole vocabulary rows per rank and refuse a padded partition
    (``QuantLinearMethod``'s check, at load); at size 1 such a vocabulary is served."""
    head = pack.modules.get("lm_head")
    if tp == 1 or head is None or head.format not in pack_formats() or not isinstance(vocab, int) or vocab < 1:
        return []
    padded = -(-vocab // 64) * 64
    if padded % tp == 0 and vocab == padded:
        return []
    return [
        f"the head's {vocab}-token vocabulary does not fill the {tp} partitions vLLM pads it to ({padded} rows): a "
        f"quantized head is cut to whole vocabulary rows (serve at tensor-parallel size 1, or re-quantize with a "
        f"vocabulary padded to a multiple of {64 * tp})"
    ]
