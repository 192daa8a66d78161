"""``Exl3MoEMethod``: EXL3 expert banks for vLLM's MoE expert layer (``RoutedExperts``, ``FusedMoE`` before 0.22).

An EXL3 pack stores every expert's gate / up / down projection as its own EXL3 tensor (``experts.{e}.gate_proj
.trellis`` etc.), with its own K under a mixed-precision recipe. vLLM's unquantized and quantized MoE methods expect
stacked ``w13_weight (E, 2I, H)`` / ``w2_weight (E, H, I)`` parameters, so none of them can hold a pack's experts.
This method:

* ``create_weights`` registers empty placeholders (``w13_trellis``, ``w2_suh`` ...) whose loader captures each
  expert's whole checkpoint tensors by ``(expert, w1 | w3 | w2)``, and replaces the layer's ``load_weights``: vLLM
  0.25-0.31 ``RoutedExperts.load_weights`` takes every 3-D tensor for a stack of all experts and would cut a
  per-expert trellis ``(H/16, I/16, 16K)`` along its tile rows (fixed in 0.32; replaced on every version, so one
  path loads all of them);
* ``process_weights_after_loading`` checks that every expert arrived whole, plans the layer's bank from the K the
  pack actually stores (:func:`quantpack_core.moe.plan_moe_layer`: K-sorted slots, one group per (K of w1/w3, K of
  w2)), copies the tensors into the bank, and hands it to the kernel backend;
* ``apply`` runs one registered custom op over the routed tokens (vLLM's router has already chosen ``topk_ids`` and
  ``topk_weights``; vLLM's runner adds any shared experts).

Follows vLLM's ``FusedMoEMethodBase`` (``vllm/model_executor/layers/fused_moe/fused_moe_method_base.py``) and
``RoutedExperts.load_weights`` / ``weight_loader`` (``fused_moe/routed_experts.py``), seed 000 (``Exl3MoEMethod``
for ``RoutedExperts`` layers, per-expert loading) and seed 001 (the bank).
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterable, Iterator

import torch
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

from quantpack_core.codec import Exl3Tensors
from quantpack_core.errors import CodecError, GeometryError
from quantpack_core.hadamard import HAD_BLOCK
from quantpack_core.moe import PROJ_DOWN, PROJ_GATE, PROJ_MODULES, PROJ_UP, PROJECTIONS, bank_from_tensors
from quantpack_core.tp import expert_split, sliced_tp_sizes

from .linear import EXL3_PARTS, PLACEHOLDERS, LayerLoadError, UnsupportedLayerError

logger = logging.getLogger("vllm.quantpack.exl3")

#: checkpoint suffix -> dtype of the placeholder (what an EXL3 pack stores per expert projection): the linear
#: method's EXL3 suffixes
EXPERT_PARTS: dict[str, torch.dtype] = {s: PLACEHOLDERS[s] for s in EXL3_PARTS}
#: vLLM's shard id -> the stacked parameter family it belongs to
STACK = {PROJ_GATE: "w13", PROJ_UP: "w13", PROJ_DOWN: "w2"}
#: (tp size, intermediate size) of expert-split fallbacks already announced
_reported: set[tuple[int, int]] = set()


class UnsupportedMoeError(UnsupportedLayerError):
    """An MoE layer configuration this version cannot serve (named with the reason and the way out)."""


def _padded(n: int) -> int:
    return (n + HAD_BLOCK - 1) // HAD_BLOCK * HAD_BLOCK


class Exl3ExpertParam(torch.nn.Parameter):
    """Empty placeholder for one checkpoint suffix of one stacked family (``w13`` or ``w2``) of an MoE layer.

    Its ``weight_loader`` (vLLM calls ``param.weight_loader(param, loaded_weight, weight_name, shard_id, expert_id,
    return_success)``, positionally or by keyword) keeps each expert's whole tensor in :attr:`captured`, keyed by
    ``(expert_id, shard_id)``; nothing is narrowed or copied.

    Attributes:
        suffix: checkpoint suffix (``trellis``, ``suh`` ...).
        family: ``"w13"`` or ``"w2"``.
        layer_name: the vLLM module, for messages.
        num_experts: experts of the layer (ids outside ``[0, num_experts)`` are refused).
        captured: ``(global expert id, "w1" | "w3" | "w2") -> tensor`` (views of the checkpoint until processed).
    """

    def __new__(cls, suffix: str, family: str, layer_name: str, num_experts: int):
        return super().__new__(cls, torch.empty(0, dtype=EXPERT_PARTS[suffix]), requires_grad=False)

    def __init__(self, suffix: str, family: str, layer_name: str, num_experts: int):
        self.suffix = suffix
        self.family = family
        self.layer_name = layer_name
        self.num_experts = num_experts
        self.captured: dict[tuple[int, str], torch.Tensor] = {}
        self.weight_loader = self._capture

    def _capture(
        self,
        param: torch.nn.Parameter | None = None,
        loaded_weight: torch.Tensor | None = None,
        weight_name: str = "",
        shard_id: str | None = None,
        expert_id: int | None = None,
        return_success: bool = False,
        **_: object,
    ) -> bool | None:
        if loaded_weight is None or shard_id not in PROJECTIONS or expert_id is None:
            raise LayerLoadError(
                f"{self.layer_name}: .{self.suffix} {weight_name!r} arrived without an expert id and a w1/w3/w2 "
                f"shard id (got expert {expert_id!r}, shard {shard_id!r}); EXL3 packs store experts one by one "
                "(experts.{e}.gate_proj.trellis ...) - this checkpoint's expert names are not in that layout"
            )
        if STACK[shard_id] != self.family:
            raise LayerLoadError(
                f"{self.layer_name}: {shard_id} ({PROJ_MODULES[shard_id]}) tensor routed to {self.family}_"
                f"{self.suffix}; the model's expert mapping does not match the checkpoint"
            )
        if not 0 <= int(expert_id) < self.num_experts:
            raise LayerLoadError(
                f"{self.layer_name}: checkpoint tensor {weight_name or PROJ_MODULES[shard_id] + '.' + self.suffix!r} "
                f"names expert {expert_id}, but the layer has {self.num_experts} experts (config.json's expert count) "
                "- use the config the pack was made with"
            )
        key = (int(expert_id), shard_id)
        if key in self.captured:
            raise LayerLoadError(
                f"{self.layer_name}: expert {expert_id} {PROJ_MODULES[shard_id]}.{self.suffix} arrived twice; the "
                "checkpoint stores it twice or two names map to it - fix the pack's tensor names"
            )
        self.captured[key] = loaded_weight
        return True if return_success else None


# vLLM checks this mark on expert weight loaders (llama4.py) before passing expert ids.
Exl3ExpertParam._capture.supports_moe_loading = True  # type: ignore[attr-defined]

_EXPERT_NAME = re.compile(r"^(?:.*\.)?(\d+)\.([A-Za-z0-9_]+)\.([A-Za-z0-9_]+)$")


def load_expert_weights(layer: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[str]:
    """``load_weights`` of an EXL3 expert layer: route each per-expert tensor to its placeholder by name.

    Args:
        layer: the expert layer (``RoutedExperts``) the placeholders were registered on.
        weights: ``(name, tensor)`` with names relative to the layer, e.g. ``"7.gate_proj.trellis"`` (vLLM's
            ``AutoWeightsLoader`` strips everything up to ``experts.``).

    Yields:
        the placeholder names that received a tensor (``w13_trellis`` ...), as vLLM's loader reports them.

    Raises:
        LayerLoadError: a name that is no per-expert EXL3 tensor of this layer (a stacked ``gate_up_proj``, an
            unknown projection or suffix, an expert id outside the layer), naming the tensor and the fix.

    Source: vLLM ``RoutedExperts.load_weights`` (0.25-0.32), without the stacked-tensor branch that mistakes a
    per-expert trellis for all experts (the 0.25-0.31 bug).
    """
    projs = {
        getattr(layer, "ckpt_gate_proj_name", None) or "gate_proj": PROJ_GATE,
        getattr(layer, "ckpt_up_proj_name", None) or "up_proj": PROJ_UP,
        getattr(layer, "ckpt_down_proj_name", None) or "down_proj": PROJ_DOWN,
    }
    name_of = getattr(layer, "layer_name", None) or getattr(layer, "exl3_prefix", "MoE layer")
    for name, tensor in weights:
        m = _EXPERT_NAME.match(name)
        proj = projs.get(m.group(2)) if m else None
        suffix = m.group(3) if m else None
        if m is None or proj is None or suffix not in EXPERT_PARTS:
            raise LayerLoadError(
                f"{name_of}: checkpoint tensor {name!r} is not a per-expert EXL3 tensor "
                f"(<expert>.{{{', '.join(projs)}}}.{{{', '.join(EXPERT_PARTS)}}}); stacked or dense experts in an "
                "EXL3 layer are not supported - quantize every expert with exllamav3, or keep the whole layer dense"
            )
        expert = int(m.group(1))  # the placeholder's loader refuses ids outside the layer
        param_name = f"{STACK[proj]}_{suffix}"
        getattr(layer, param_name).weight_loader(
            getattr(layer, param_name), tensor, weight_name=name, shard_id=proj, expert_id=expert
        )
        yield param_name


@functools.cache
def _cpu_without_router() -> bool:
    """On CPU, and vLLM has no ``CPURouter`` (0.29 and older): its runner's router would call a CUDA-only op."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    try:
        import vllm.model_executor.layers.fused_moe.router.cpu_router  # noqa: F401
    except ImportError:
        return True
    return False


class Exl3MoEMethod(FusedMoEMethodBase):
    """MoE method for EXL3 expert banks (per-expert K, one codebook per layer), see the module docstring.

    Args:
        moe: vLLM's ``FusedMoEConfig`` of the layer.
        backend: kernel backend class (see :mod:`quantpack_exl3.backends`); must provide ``prepare_moe``.
        prefix: the vLLM module name, e.g. ``model.layers.3.mlp.experts``.

    Raises (from :meth:`create_weights`):
        UnsupportedMoeError: expert parallelism, a non-gated or non-SiLU activation, expert biases, routing weights
            applied on the input, or SwiGLU limits (each named, with the way out).

    Tensor parallelism: each rank keeps its share of every expert's intermediate channels (``w1`` / ``w3`` column
    parallel, ``w2`` row parallel; vLLM all-reduces the ranks' partial sums) when the share is whole 128-channel
    blocks (seed 001). Otherwise (e.g. 128 channels over 2 ranks) the experts are split whole instead: rank ``r`` of
    ``tp`` keeps and runs experts ``e % tp == r`` (:func:`quantpack_core.tp.expert_split`, vLLM's round-robin
    placement), each routed pick runs on the one rank that holds its expert, and vLLM's all-reduce adds the ranks'
    sums (exact up to the rounding of each rank's partial sum to the model dtype, as for any row-parallel layer);
    announced with a warning when the layer is built.
    """

    def __init__(self, moe, backend, prefix: str = ""):
        super().__init__(moe)
        self.backend = backend
        self.prefix = prefix
        # decided here, not in the property: torch.compile traces the property on CPU and cannot import there
        self._cpu_select_experts = None
        if _cpu_without_router():
            from vllm.model_executor.layers.fused_moe.experts.cpu_moe import select_experts

            self._cpu_select_experts = select_experts

    # ------------------------------------------------------------------------------------------------ create

    def _check_supported(self, layer: torch.nn.Module) -> None:
        moe = self.moe
        where = self.prefix or "MoE layer"
        act = getattr(getattr(moe, "activation", None), "value", getattr(moe, "activation", "silu"))
        gated = getattr(moe, "is_act_and_mul", True)
        if str(act) != "silu" or not gated:
            raise UnsupportedMoeError(
                f"{where}: activation {act!r} ({'gated' if gated else 'not gated'}); EXL3 expert banks serve gated "
                "SiLU experts (act(gate) * up) only - this model's experts cannot be served by this version"
            )
        if getattr(moe, "has_bias", False):
            raise UnsupportedMoeError(f"{where}: expert biases are not supported for EXL3 expert banks")
        if getattr(layer, "apply_router_weight_on_input", False):
            raise UnsupportedMoeError(
                f"{where}: the model applies routing weights to the expert input; EXL3 expert banks weight the "
                "expert outputs only"
            )
        if any(getattr(moe, n, None) is not None for n in ("swiglu_limit", "swiglu_alpha", "swiglu_beta")):
            raise UnsupportedMoeError(f"{where}: clamped SwiGLU experts are not supported for EXL3 expert banks")
        parallel = getattr(moe, "moe_parallel_config", None)
        if getattr(parallel, "use_ep", False):
            raise UnsupportedMoeError(
                f"{where}: expert parallelism is not supported for EXL3 expert banks - run without "
                "--enable-expert-parallel"
            )

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: object,
    ) -> None:
        """Register the placeholders (see :class:`Exl3ExpertParam`) and replace the layer's ``load_weights``.

        Args:
            layer: the expert layer.
            num_experts: experts on this rank (all of them: expert parallelism is refused).
            hidden_size: the model's hidden size (vLLM may round it up for some all-to-all kernels).
            intermediate_size_per_partition: this rank's intermediate size.
            params_dtype: model dtype.
            extra_weight_attrs: vLLM's ``weight_loader`` (deliberately not used: it narrows stacked tensors).

        Raises:
            UnsupportedMoeError, GeometryError: see the class.
        """
        self._check_supported(layer)
        tp_size = int(getattr(self.moe, "tp_size", 1) or 1)
        tp_rank = int(getattr(self.moe, "tp_rank", 0) or 0)
        inter_full = int(intermediate_size_per_partition) * tp_size
        layer.exl3_tp = (tp_size, tp_rank, self._tp_sliced(inter_full, tp_size))
        for family in ("w13", "w2"):
            for suffix in EXPERT_PARTS:
                param = Exl3ExpertParam(suffix, family, self.prefix, int(num_experts))
                layer.register_parameter(f"{family}_{suffix}", param)
        layer.exl3_prefix = self.prefix
        layer.exl3_num_experts = int(num_experts)
        layer.exl3_hidden = int(hidden_size)
        layer.exl3_intermediate = inter_full
        layer.exl3_params_dtype = params_dtype
        layer.exl3_moe_run = None
        layer.exl3_moe_idle = False
        layer.exl3_moe_local_ids = None
        # An instance attribute shadows RoutedExperts.load_weights (MoERunner.load_weights delegates to it).
        layer.load_weights = functools.partial(load_expert_weights, layer)

    def _tp_sliced(self, inter: int, tp_size: int) -> bool:
        """Whether this layer's experts are cut along their intermediate channels (each rank a whole number of
        128-channel blocks); if not, the expert split that replaces the cut is announced here, before any weight is
        loaded."""
        if tp_size == 1:
            return True
        blocks = _padded(inter) // HAD_BLOCK
        if blocks % tp_size == 0:
            return True
        key = (tp_size, inter)
        if key not in _reported and int(getattr(self.moe, "tp_rank", 0) or 0) == 0:
            _reported.add(key)
            sizes = [d for d in sliced_tp_sizes([_padded(inter)], limit=64) if d > 1]
            ok = ", ".join(map(str, sizes)) if sizes else "none above 1"
            logger.warning(
                "quantpack-exl3: %s (and MoE layers like it) at tensor-parallel size %d: the experts' intermediate "
                "size %d (stored %d, %d Hadamard block%s of %d) cannot be cut into whole blocks per rank, so the "
                "experts are split whole instead: rank r keeps and runs experts e with e %% %d == r, and vLLM's "
                "all-reduce adds the ranks' sums (exact up to the rounding of each rank's partial sum to the model "
                "dtype, as for any row-parallel layer; a rank's share of the routed work follows the router). "
                "Tensor-parallel sizes that cut these experts on whole blocks instead: %s",
                self.prefix,
                tp_size,
                inter,
                _padded(inter),
                blocks,
                "" if blocks == 1 else "s",
                HAD_BLOCK,
                tp_size,
                ok,
            )
        return False

    def get_fused_moe_quant_config(self, layer: torch.nn.Module):
        """No vLLM modular kernel runs this layer, so there is no quant config for one (vLLM accepts None)."""
        return None

    @property
    def is_monolithic(self) -> bool:
        """True where vLLM's runner cannot route for this method: on CPU before vLLM 0.31, whose router calls
        ``_moe_C.topk_softmax``, a CUDA-only op (0.31 added ``CPURouter``). Then :meth:`apply_monolithic` routes with
        vLLM's own CPU routing function. Everywhere else vLLM's router picks the experts and calls :meth:`apply`."""
        return self._cpu_select_experts is not None

    # -------------------------------------------------------------------------------------------------- load

    def _expert_tensors(self, layer: torch.nn.Module) -> dict[tuple[int, str], Exl3Tensors]:
        params = {(f, s): getattr(layer, f"{f}_{s}") for f in ("w13", "w2") for s in EXPERT_PARTS}
        by_key: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for (_, suffix), p in params.items():
            for key, t in p.captured.items():
                by_key.setdefault(key, {})[suffix] = t
        missing = [
            (e, proj)
            for e in range(layer.exl3_num_experts)
            for proj in PROJECTIONS
            if "trellis" not in by_key.get((e, proj), {})
        ]
        if missing:
            listing = ", ".join(f"{e}.{PROJ_MODULES[p]}" for e, p in missing[:6])
            more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
            raise LayerLoadError(
                f"{self.prefix}: no EXL3 trellis for experts {listing}{more} (of {layer.exl3_num_experts} experts x "
                "gate/up/down); the pack is incomplete or does not match config.json - re-download it"
            )
        out = {}
        for (e, proj), tensors in sorted(by_key.items()):
            try:
                out[(e, proj)] = Exl3Tensors.from_tensors(tensors)
            except CodecError as err:
                raise LayerLoadError(
                    f"{self.prefix}: expert {e} {PROJ_MODULES[proj]}: {err}; the pack's tensor is incomplete or "
                    "corrupt - re-download or re-quantize it"
                ) from None
        return out

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Check the captured experts, build the bank, hand it to the backend, release the captured tensors.

        Raises:
            LayerLoadError: an expert projection missing or corrupt.
            GeometryError: stored sizes that are not the layer's sizes padded to 128, or w1 / w3 of one expert at
                different K (from the plan).
            CodecError: experts of one layer in different codebooks.
        """
        if getattr(layer, "exl3_moe_run", None) is not None or getattr(layer, "exl3_moe_idle", False):
            return
        tensors = self._expert_tensors(layer)
        num = layer.exl3_num_experts
        hidden, inter = layer.exl3_hidden, layer.exl3_intermediate
        want = {PROJ_GATE: (_padded(hidden), _padded(inter)), PROJ_UP: (_padded(hidden), _padded(inter))}
        want[PROJ_DOWN] = (_padded(inter), _padded(hidden))
        for (e, proj), t in tensors.items():
            if t.padded_shape != want[proj]:
                k, n = t.padded_shape
                raise GeometryError(
                    f"{self.prefix}: expert {e} {PROJ_MODULES[proj]} stores a {k}x{n} (in x out) EXL3 matrix, the "
                    f"layer needs {want[proj][0]}x{want[proj][1]} (hidden {hidden}, intermediate {inter}, padded to "
                    "128): the pack does not match config.json - use the config the pack was made with"
                )
        device = layer.w13_trellis.device
        tp_size, tp_rank, sliced = layer.exl3_tp
        # a sliced rank keeps its intermediate channels of every expert; otherwise it keeps its experts whole
        local = None if sliced else expert_split(num, tp_size, tp_rank)
        bank = None
        if local is None:
            bank = bank_from_tensors(self.prefix, tensors, device, tp_size, tp_rank)
        elif local:
            tensors = {(i, proj): tensors[(e, proj)] for i, e in enumerate(local) for proj in PROJECTIONS}
            bank = bank_from_tensors(self.prefix, tensors, device)
        for f in ("w13", "w2"):
            for s in EXPERT_PARTS:
                getattr(layer, f"{f}_{s}").captured.clear()
                delattr(layer, f"{f}_{s}")
        if bank is None:  # expert split with more ranks than experts: this one holds none
            layer.exl3_moe_idle = True
            return
        if local:
            # logical expert -> this rank's bank id, -1 for the experts other ranks hold (the ops skip those picks)
            local_ids = torch.full((num,), -1, dtype=torch.int64)
            local_ids[local] = torch.arange(len(local))
            layer.exl3_moe_local_ids = torch.nn.Parameter(local_ids.to(device), requires_grad=False)
        if sliced and tp_size > 1:  # the rank's logical channels (the stored ones past the layer's are padding)
            inter = min(bank.plan.inter_local, max(0, inter - bank.plan.inter_start))
        run = self.backend.prepare_moe(bank, hidden, inter, layer.exl3_params_dtype, device)
        names = []
        for name, tensor in run.tensors.items():
            layer.register_parameter(f"exl3_moe_{name}", torch.nn.Parameter(tensor, requires_grad=False))
            names.append(f"exl3_moe_{name}")
        layer.exl3_moe_params = tuple(names)
        layer.exl3_moe_run = run
        hist: dict[str, int] = {}
        for g in bank.plan.groups:
            key = f"{g.k_gu:g}/{g.k_d:g}"
            hist[key] = hist.get(key, 0) + g.size
        logger.debug("quantpack-exl3: %s: %d experts, K (gate+up/down) groups %s", self.prefix, num, hist)

    # ------------------------------------------------------------------------------------------------- apply

    def route(self, layer: torch.nn.Module, x: torch.Tensor, router_logits: torch.Tensor):
        """Expert choice on CPU where vLLM's runner has no CPU router (see :attr:`is_monolithic`): vLLM's own CPU
        routing (``fused_moe/experts/cpu_moe.py::select_experts``) with the layer's routing settings.

        Returns:
            ``(topk_weights float32 (T, k), topk_ids int32 (T, k))``.
        """
        return self._cpu_select_experts(
            hidden_states=x,
            router_logits=router_logits,
            top_k=layer.top_k,
            use_grouped_topk=layer.use_grouped_topk,
            renormalize=layer.renormalize,
            topk_group=layer.topk_group,
            num_expert_group=layer.num_expert_group,
            custom_routing_function=layer.custom_routing_function,
            scoring_func=layer.scoring_func,
            routed_scaling_factor=layer.routed_scaling_factor,
            e_score_correction_bias=layer.e_score_correction_bias,
        )

    def apply_monolithic(
        self, layer: torch.nn.Module, x: torch.Tensor, router_logits: torch.Tensor, input_ids=None, **_: object
    ) -> torch.Tensor:
        """Route with :meth:`route`, then :meth:`apply` (the CPU path of vLLM 0.29 and older; see
        :attr:`is_monolithic`)."""
        topk_weights, topk_ids = self.route(layer, x, router_logits)
        return self.apply(layer, x, topk_weights, topk_ids)

    def apply(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: torch.nn.Module | None = None,
        shared_experts_input: torch.Tensor | None = None,
        **_: object,
    ) -> torch.Tensor:
        """Routed experts of ``x (T, hidden)``: ``(T, hidden)`` in ``x``'s dtype, through one registered custom op.

        Args:
            layer: the expert layer.
            x: activations, the model dtype.
            topk_weights: ``(T, top_k)`` routing weights (already normalized as the model wants).
            topk_ids: ``(T, top_k)`` expert ids (int32 or int64).
            shared_experts, shared_experts_input: ignored; vLLM's runner runs the shared experts itself when the
                method brings no modular kernel.

        Raises:
            LayerLoadError: used before ``process_weights_after_loading``.
        """
        if layer.exl3_moe_idle:  # expert split with more ranks than experts: this rank holds none, adds zero
            return torch.zeros_like(x)
        run = layer.exl3_moe_run
        if run is None:
            raise LayerLoadError(f"{self.prefix}: forward before process_weights_after_loading built the bank")
        if layer.exl3_moe_local_ids is not None:  # expert split: picks of other ranks' experts become -1
            topk_ids = layer.exl3_moe_local_ids[topk_ids.long()]
        out = torch.empty_like(x)
        run.fn(x, topk_ids, topk_weights, *[getattr(layer, n) for n in layer.exl3_moe_params], *run.static, out)
        return out
