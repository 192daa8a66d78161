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

A second fix, for float16 serving of the latent-MoE layers (Nemotron-3.5-Super's): vLLM builds ``NemotronHMoE``'s
experts with ``apply_routed_scale_to_output=True``, and its MoE runner
(``MoERunner._maybe_apply_routed_scale_to_output``) then, in float16 only and where a shared expert exists, divides
the shared expert's output by ``routed_scaling_factor`` instead of multiplying the routed one by it, "the decoder
layer compensating" - which ``NemotronHMoEDecoderLayer`` does not do (DeepSeek-V2's decoder layer does). A float16
Nemotron-H MoE layer so gives ``(routed + shared) / s`` for ``s * routed + shared``: the tiny MoE pack serves at KL
0.48, top-1 66% against its reference, for any quant method (the float64 reference with that combination gives the
same KL). The family wraps ``NemotronHMoE``: at build it asks the runner's own function what it does with a float16
unit pair (:func:`float16_output_scale`) and, where the result is that division, multiplies the layer's float16 output
by ``s``. Other dtypes, layers without a shared expert and a runner that scales correctly are left alone.

A warning, not a fix: on CUDA, vLLM 0.25.1 served the tiny Nemotron-H bf16 twin in float16 at KL 4.6 (top-1 7%)
wherever its torch.compile'd code ran outside CUDA graphs - ``cudagraph_mode: NONE``, or a step of more tokens than
the largest capture size - while eager, and the same compiled code replayed in graphs, were right (H200;
docs/families.md, Nemotron-H). The step at fault was not found, so the family names the risk when such
a model is built (:func:`compiled_float16_risk`) and leaves the serving to vLLM.

Not a fix here (docs/families.md): the routed experts of the MoE layers are ungated (relu^2); quantpack's expert
banks serve them (``quantpack_core.vllm.moe``), while vLLM's CPU builds refuse that layer kind for any method, so an
EXL3 pack with Nemotron's MoE layers is served on CUDA only.

Source: vLLM 0.29 - 0.32 ``vllm/model_executor/layers/mamba/mamba_mixer2.py`` (``MambaMixer2.__init__``,
``mamba_v2_sharded_weight_loader``) and 0.22 - 0.32 ``vllm/model_executor/models/nemotron_h.py`` (``NemotronHMoE``),
``vllm/model_executor/layers/fused_moe/runner/moe_runner.py`` (``MoERunner.forward``), read; docs/families.md
(Nemotron-H).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..registry import Family, class_patch, wrap_attribute

logger = logging.getLogger("vllm.quantpack.families")

_MARK = "_quantpack_nemotron_h"

MODULE = "vllm.model_executor.layers.mamba.mamba_mixer2"
MODEL_MODULE = "vllm.model_executor.models.nemotron_h"


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


def float16_output_scale(moe, prefix: str = "") -> float | None:
    """The factor that makes a built ``NemotronHMoE`` ``moe``'s float16 output right, or None where it is right.

    vLLM's runner combines the routed experts' output ``r`` (routing weights without ``routed_scaling_factor``
    ``s`` when it scales the output itself) and the shared expert's ``h`` through
    ``_maybe_apply_routed_scale_to_output(h, r)``; the model wants ``s * r + h``. This calls that function on a
    float16 unit pair (host tensors, so a model built on the meta device probes too): ``(1, s)`` back is right (None);
    ``(1 / s, 1)`` is the division the decoder layer never undoes, fixed by multiplying the layer's output by ``s``.
    Call it for a float16 model only (:func:`wrap_moe` does).

    Raises:
        RuntimeError: the runner returns another combination (a vLLM this fix does not know), or the layer's latent
            output projection has a bias (the multiplication would scale it too), naming the layer.
    """
    import torch

    experts = getattr(moe, "experts", None)
    runner = getattr(experts, "runner", experts)  # vLLM 0.22: the FusedMoE module holds it; 0.25+: it is the runner
    combine = getattr(runner, "_maybe_apply_routed_scale_to_output", None)
    s = float(getattr(runner, "routed_scaling_factor", 1.0) or 1.0)
    if combine is None or s == 1.0 or getattr(moe, "shared_experts", None) is None:
        return None
    one = {"dtype": torch.float16, "device": "cpu"}
    shared, routed = combine(torch.ones(1, **one), torch.ones(1, **one))
    a, b = float(shared), float(routed)
    if abs(a - 1) < 1e-3 and abs(b - s) < 1e-3 * s:
        return None
    if abs(a * s - 1) < 1e-3 and abs(b - 1) < 1e-3:
        if getattr(getattr(moe, "fc2_latent_proj", None), "bias", None) is not None:
            raise RuntimeError(
                f"{prefix or 'NemotronHMoE'}: in float16 vLLM's MoE runner divides the shared expert by "
                f"routed_scaling_factor {s:g} and the Nemotron-H layer never undoes it; quantpack's fix multiplies "
                "the layer's output back, which would also scale fc2_latent_proj's bias (mlp_bias). Serve this model "
                "in bfloat16 (--dtype bfloat16)"
            )
        return s
    raise RuntimeError(
        f"{prefix or 'NemotronHMoE'}: vLLM's MoE runner combines a float16 shared expert and routed output as "
        f"{a:g} * shared + {b:g} * routed for routed_scaling_factor {s:g}; quantpack's Nemotron-H fix knows 1 / {s:g} "
        "and 1 (it rescales) or 1 and the factor (it leaves it). Serve in bfloat16 (--dtype bfloat16) or update "
        "quantpack-families"
    )


def wrap_moe(cls) -> bool:
    """Make ``cls`` (vLLM's ``NemotronHMoE``) record :func:`float16_output_scale` when built as part of a float16
    model (torch's default dtype while vLLM builds it) and apply it to its float16 output in ``forward``. Idempotent.

    Returns:
        True when this call wrapped anything.
    """

    def make_init(init):
        def __init__(self, *args, **kwargs):
            import torch

            init(self, *args, **kwargs)
            # vLLM builds a model under its dtype as torch's default: the runner's branch is float16's only
            fp16 = torch.get_default_dtype() == torch.float16
            self._quantpack_float16_scale = float16_output_scale(self, kwargs.get("prefix", "")) if fp16 else None

        return __init__

    def make_forward(forward):
        import torch  # vLLM imported it already: the module being patched is vLLM's

        def forward_fixed(self, hidden_states, *args, **kwargs):
            out = forward(self, hidden_states, *args, **kwargs)
            scale = getattr(self, "_quantpack_float16_scale", None)
            return out * scale if scale is not None and out.dtype == torch.float16 else out

        return forward_fixed

    wrapped = wrap_attribute(cls, "__init__", _MARK, make_init)
    return wrap_attribute(cls, "forward", _MARK, make_forward) or wrapped


def _name(value) -> str:
    """An enum member's name (vLLM's ``CompilationMode`` / ``CUDAGraphMode``), or the value as text."""
    return str(getattr(value, "name", value))


def compiled_float16_risk(vllm_config, on_cuda: bool) -> str | None:
    """The warning for a Nemotron-H model that vLLM is about to serve in float16 with torch.compile on CUDA, or None.

    ``vllm_config`` is vLLM's ``VllmConfig``; read: ``model_config.dtype``, ``compilation_config.mode`` /
    ``cudagraph_mode`` / ``max_cudagraph_capture_size`` and ``scheduler_config.max_num_batched_tokens``. ``on_cuda``:
    whether the platform is CUDA (ROCm and CPU were not measured: None). The message names the steps that run
    compiled code outside CUDA graphs as configured when the model is built: every step without graphs
    (``cudagraph_mode: NONE``), every step but pure decodes where mixed batches have none (``FULL_DECODE_ONLY``),
    else the steps of more tokens than the largest capture size (none, and no warning, where that size covers
    ``max_num_batched_tokens``). vLLM may still lower the graph mode after the build (when it resolves what the
    attention backend supports), so more steps may run outside graphs than named. Also the measurement
    (docs/families.md, Nemotron-H) and the way out, ``--enforce-eager``. None as well where a field is missing or
    of a kind this does not know (an older vLLM's config), so it never stands in the way of a build.

    Source: vLLM 0.22 - 0.32 ``vllm/config/compilation.py`` (``CompilationMode``, ``CUDAGraphMode.mixed_mode``).
    """
    import torch

    model = getattr(vllm_config, "model_config", None)
    compilation = getattr(vllm_config, "compilation_config", None)
    if not on_cuda or model is None or compilation is None or getattr(model, "dtype", None) != torch.float16:
        return None
    mode = getattr(compilation, "mode", None)
    if mode is None or _name(mode) in ("NONE", "0"):  # CompilationMode.NONE: eager, as --enforce-eager sets it
        return None
    graphs = getattr(compilation, "cudagraph_mode", None)
    mixed = graphs.mixed_mode() if hasattr(graphs, "mixed_mode") else graphs
    largest = getattr(compilation, "max_cudagraph_capture_size", None)
    budget = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens", None)
    if graphs is None or _name(graphs) == "NONE" or not isinstance(largest, int) or largest <= 0:
        where = "every step (compiled without CUDA graphs)"
    elif _name(mixed) == "NONE":
        where = f"every step but pure decodes (cudagraph_mode {_name(graphs)} captures no prefill)"
    elif isinstance(budget, int) and largest >= budget:
        return None  # every step fits a captured size
    else:
        where = f"every step of more than {largest} tokens (beyond the largest CUDA graph capture size)"
    return (
        "Nemotron-H in float16 with torch.compile on CUDA: vLLM 0.25.1 served a test model of this architecture "
        f"wrongly (KL 4.6 against its reference) where compiled code ran outside CUDA graphs, here at least {where}; "
        "eager and graph replays were right, other vLLM releases are not checked. Serve with --enforce-eager to rule "
        "it out (quantpack docs/troubleshooting.md)"
    )


_warned: list[str] = []


def wrap_model(cls) -> bool:
    """Make ``cls.__init__`` (vLLM's ``NemotronHForCausalLM``, also the language model of Nemotron VL) log
    :func:`compiled_float16_risk`'s warning once per process when it applies. The check never fails the build: an
    error in it is logged at debug level. Idempotent; the signature vLLM inspects stays the original's
    (``functools.wraps``).

    Returns:
        True when this call wrapped it.
    """

    def make(init):
        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            if _warned:
                return
            try:
                from vllm.platforms import current_platform

                message = compiled_float16_risk(kwargs.get("vllm_config"), current_platform.is_cuda())
            except Exception:  # a warning must not stop the model's build
                logger.debug("quantpack-families: Nemotron-H compile check skipped", exc_info=True)
                return
            if message:
                _warned.append(message)
                logger.warning("quantpack-families: %s", message)

        return __init__

    return wrap_attribute(cls, "__init__", _MARK, make)


#: :func:`wrap_moe` and :func:`wrap_model` applied to the classes vLLM's Nemotron-H model module defines
patch_model = class_patch({"NemotronHMoE": wrap_moe, "NemotronHForCausalLM": wrap_model})


FAMILY = Family(
    name="nemotron_h",
    why=(
        "vLLM's Mamba2 in_proj duplicates its one group of B / C on every tensor-parallel rank through a loader of "
        "in_proj.weight, which a quantized in_proj never reaches; in float16 its MoE runner divides the shared "
        "expert by routed_scaling_factor for a compensation the Nemotron-H decoder layer never makes"
    ),
    patches={MODULE: patch, MODEL_MODULE: patch_model},
)
