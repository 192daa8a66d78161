"""Nemotron-H text tower (vLLM's ``NemotronHForCausalLM``: Mamba2, NoPE attention, relu^2 MLP and latent-MoE layers;
Nemotron-3.5-Super's language tower): the tensor-parallel split of a Mamba2 ``in_proj`` whose ``n_groups`` does not
divide the tensor-parallel size.

vLLM's ``MambaMixer2`` builds ``in_proj`` as one ``ColumnParallelLinear`` in that case (``n_groups`` must then be 1)
and gives ``in_proj.weight`` its own loader, ``mamba_v2_sharded_weight_loader``, which hands each rank its share of
``z``, ``x`` and ``dt`` but the *whole* ``B`` and ``C`` (the one group is duplicated on every rank): rank ``r`` holds
``[z_r | x_r | B | C | dt_r]`` of the checkpoint's ``[z | x | B | C | dt]``. A quantized pack's ``in_proj`` is not a
``.weight`` (EXL3 stores ``trellis`` / ``suh`` / ``svh``), so that loader never sees it: quantpack's linear method
cuts the EXL3 tensor as an even column split of a layer ``(tp - 1) * 2 * ssm_state_size`` features wider than the
checkpoint's, which fits the same padded blocks, loads, and serves wrong logits (KL 4.4, top-1 3% for the tiny
model at TP 2). vLLM 0.29 - 0.32 all set the loader on ``in_proj.weight`` only (where a quant method has no
``weight`` at all, 0.29 / 0.31 fail with an AttributeError there; quantpack's method keeps a ``weight``
placeholder). vLLM's loader also replaces that placeholder's capture, so a pack storing ``in_proj`` dense lost it.

The family wraps ``MambaMixer2.__init__``: for a quantpack method on such an ``in_proj`` it restores the
placeholder's capture and gives the layer's split (:class:`quantpack_core.vllm.linear.LinearTp`) the ranges vLLM's
loader takes, so every rank keeps exactly those output features of the stored tensor (EXL3: the Hadamard blocks
they touch, then its columns - the project's column fallback, exact). Other quant methods and the divisible case
are left alone.

Not a fix here (docs/families.md): the routed experts of the MoE layers are ungated (relu^2); quantpack's expert
banks serve them (``quantpack_core.vllm.moe``), while vLLM's CPU builds refuse that layer kind for any method, so an
EXL3 pack with Nemotron's MoE layers is served on CUDA only.

Source: vLLM 0.29 - 0.32 ``vllm/model_executor/layers/mamba/mamba_mixer2.py`` (``MambaMixer2.__init__``,
``mamba_v2_sharded_weight_loader``), read; docs/families.md (Nemotron-H).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..registry import Family, class_patch, wrap_attribute

_MARK = "_quantpack_nemotron_h"

MODULE = "vllm.model_executor.layers.mamba.mamba_mixer2"


def in_proj_ranges(inner: int, state: int, heads: int, tp_size: int, tp_rank: int) -> list[tuple[int, int]]:
    """The output features of a one-group Mamba2 ``in_proj`` that rank ``tp_rank`` of ``tp_size`` holds, in the
    checkpoint's order ``[z | x | B | C | dt]``: its share of ``z`` and ``x`` (``inner`` each) and of ``dt``
    (``heads``), and all of ``B`` and ``C`` (``state`` each), as vLLM's ``mamba_v2_sharded_weight_loader`` takes them.

    Raises:
        ValueError: ``tp_size`` does not divide ``inner`` or ``heads``, or a bad rank.
    """
    if not 0 <= tp_rank < tp_size or inner % tp_size or heads % tp_size:
        raise ValueError(
            f"Mamba2 in_proj: tensor-parallel rank {tp_rank} of {tp_size} cannot split {inner} channels and {heads} "
            "heads evenly"
        )
    i, h = inner // tp_size, heads // tp_size
    dt = 2 * inner + 2 * state
    return [
        (tp_rank * i, (tp_rank + 1) * i),
        (inner + tp_rank * i, inner + (tp_rank + 1) * i),
        (2 * inner, 2 * inner + state),
        (2 * inner + state, dt),
        (dt + tp_rank * h, dt + (tp_rank + 1) * h),
    ]


@dataclass(frozen=True)
class MambaInProjSplit:
    """A one-group Mamba2 ``in_proj``'s tensor-parallel split, in place of the even column split
    (:class:`quantpack_core.vllm.linear.LinearTp`, whose fields it carries) quantpack's linear method reads at load:
    every shard is cut to :attr:`ranges` of the checkpoint's :attr:`features` output features.

    Attributes:
        kind, size, rank, in_features, local_sizes, replicas: as :class:`~quantpack_core.vllm.linear.LinearTp`.
        ranges: :func:`in_proj_ranges` of this rank.
        features: the checkpoint tensor's output features, ``2 * inner + 2 * state + heads``.
    """

    kind: str
    size: int
    rank: int
    in_features: int
    local_sizes: tuple[int, ...]
    replicas: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]
    features: int

    def cut(self, partitions: tuple[int, ...]):
        """The rank's :class:`~quantpack_core.tp.TpCut` of the stored ``in_proj`` (its one partition)."""
        from quantpack_core.tp import COLUMN, make_cut

        return make_cut(COLUMN, self.ranges, self.features)


def mamba_in_proj_split(tp, inner: int, state: int, heads: int, prefix: str) -> MambaInProjSplit:
    """The split of a one-group Mamba2 ``in_proj`` ``prefix`` (``inner`` channels, B / C of ``state``, ``heads``)
    that replaces ``tp``, the even split quantpack's method read from the layer (one column partition).

    Raises:
        GeometryError: the ranges do not add up to the rank's output features vLLM built the layer with.
    """
    from quantpack_core.errors import GeometryError

    ranges = in_proj_ranges(inner, state, heads, tp.size, tp.rank)
    width = sum(b - a for a, b in ranges)
    if tp.kind != "column" or tuple(tp.local_sizes) != (width,):
        raise GeometryError(
            f"{prefix}: vLLM built this Mamba2 in_proj with {list(tp.local_sizes)} output features per rank "
            f"({tp.kind} parallel), the one-group split needs [{width}] (z and x shares, whole B and C, dt share); "
            "this vLLM's MambaMixer2 differs from 0.29 - 0.32's - report it with the vLLM version"
        )
    features = 2 * inner + 2 * state + heads
    return MambaInProjSplit(
        tp.kind, tp.size, tp.rank, tp.in_features, tuple(tp.local_sizes), tuple(tp.replicas), tuple(ranges), features
    )


def fix_in_proj(mixer) -> bool:
    """Give a built ``MambaMixer2`` whose ``in_proj`` is split with duplicated groups (``n_groups`` not dividing the
    tensor-parallel size; vLLM allows it for one group only) and served by a quantpack linear method the split
    vLLM's own loader applies to a dense ``in_proj.weight``, and the ``weight`` placeholder its capture back.

    Returns:
        True when the layer was changed (False: no tensor parallelism, groups that divide it, or another method).
    """
    from quantpack_core.vllm.linear import LinearState, QuantLinearMethod

    in_proj = getattr(mixer, "in_proj", None)
    state = getattr(in_proj, "quant_state", None)
    if not isinstance(getattr(in_proj, "quant_method", None), QuantLinearMethod) or not isinstance(state, LinearState):
        return False
    if state.tp is None or len(state.partitions) != 1:  # TP 1, or the merged (divisible) layout vLLM splits itself
        return False
    inner, n, heads = mixer.intermediate_size, mixer.ssm_state_size, mixer.num_heads
    state.tp = mamba_in_proj_split(state.tp, inner, n, heads, state.prefix)
    placeholder = getattr(in_proj, "weight", None)
    if placeholder is not None and hasattr(placeholder, "_capture"):
        placeholder.weight_loader = placeholder._capture  # vLLM's loader narrows into a tensor the placeholder lacks
    return True


def wrap_mixer(cls) -> bool:
    """Make ``cls.__init__`` (vLLM's ``MambaMixer2``) run :func:`fix_in_proj` on the built layer. Idempotent.

    Returns:
        True when this call wrapped it.
    """

    def make(init):
        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            fix_in_proj(self)

        return __init__

    return wrap_attribute(cls, "__init__", _MARK, make)


#: :func:`wrap_mixer` applied to the ``MambaMixer2`` vLLM's module defines
patch = class_patch({"MambaMixer2": wrap_mixer})


FAMILY = Family(
    name="nemotron_h",
    why=(
        "vLLM's Mamba2 in_proj duplicates its one group of B / C on every tensor-parallel rank through a loader of "
        "in_proj.weight, which a quantized in_proj never reaches"
    ),
    patches={MODULE: patch},
)
