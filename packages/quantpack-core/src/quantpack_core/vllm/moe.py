"""The expert-bank method for vLLM's MoE expert layer (``RoutedExperts``, ``FusedMoE`` before 0.22), for any quantized
format whose packs store every expert's gate / up / down projection as its own tensor set.

vLLM's unquantized and quantized MoE methods expect stacked ``w13_weight (E, 2I, H)`` / ``w2_weight (E, H, I)``
parameters, so none of them can hold a pack's per-expert quantized tensors (each with its own K under a
mixed-precision recipe). This method:

* ``create_weights`` registers empty placeholders (``w13_trellis``, ``w2_suh`` ...) whose loader captures each
  expert's whole checkpoint tensors by ``(expert, w1 | w3 | w2)``, and replaces the layer's ``load_weights``: vLLM
  0.25-0.31 ``RoutedExperts.load_weights`` takes every 3-D tensor for a stack of all experts and would cut a
  per-expert trellis ``(H/16, I/16, 16K)`` along its tile rows (fixed in 0.32; replaced on every version, so one
  path loads all of them);
* ``process_weights_after_loading`` checks that every expert arrived whole, has the format build this rank's bank
  (its intermediate channels, or its whole experts under an expert split), chooses a kernel for the bank from the
  platform's priority list and lets it build its form;
* ``apply`` runs one registered custom op over the routed tokens (vLLM's router has already chosen ``topk_ids`` and
  ``topk_weights``; vLLM's runner adds any shared experts).

Experts are gated SiLU (``down(silu(gate(x)) * up(x))``, vLLM's default) or ungated relu² (``down(relu(up(x))²)``,
vLLM's ``relu2_no_mul``: Nemotron-H's latent MoE), whose one input projection vLLM loads as ``w1``.

The layer's state is one :class:`ExpertState` (``layer.quant_state``); its tensors are the parameters
``bank_{name}`` and, under an expert split, the buffer ``local_ids``.

Follows vLLM's ``FusedMoEMethodBase`` (``vllm/model_executor/layers/fused_moe/fused_moe_method_base.py``) and
``RoutedExperts.load_weights`` / ``weight_loader`` (``fused_moe/routed_experts.py``); docs/moe-bank.md.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

from quantpack_core.errors import CodecError, GeometryError, LayerLoadError, UnsupportedMoeError
from quantpack_core.format import ExpertFormat
from quantpack_core.kernels import TP_EXPERT_SPLIT, TP_SLICED, TP_WHOLE, choose_kernel
from quantpack_core.moe import PROJ_DOWN, PROJ_GATE, PROJ_UP, expert_projections, proj_module
from quantpack_core.tp import expert_split, padded, sliced_tp_sizes

from .compile_key import op_name
from .params import STACK, ExpertParam

logger = logging.getLogger("vllm.quantpack")

FAMILIES = ("w13", "w2")
#: (tp size, intermediate size) of expert-split fallbacks already announced
_reported: set[tuple[int, int]] = set()

_EXPERT_NAME = re.compile(r"^(?:.*\.)?(\d+)\.([A-Za-z0-9_]+)\.([A-Za-z0-9_]+)$")


def load_expert_weights(layer: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[str]:
    """``load_weights`` of a quantized expert layer: route each per-expert tensor to its placeholder by name.

    Args:
        layer: the expert layer (``RoutedExperts``) the placeholders were registered on.
        weights: ``(name, tensor)`` with names relative to the layer, e.g. ``"7.gate_proj.trellis"`` (vLLM's
            ``AutoWeightsLoader`` strips everything up to ``experts.``).

    Yields:
        the placeholder names that received a tensor (``w13_trellis`` ...), as vLLM's loader reports them.

    Raises:
        LayerLoadError: a name that is no per-expert quantized tensor of this layer (a stacked ``gate_up_proj``, an
            unknown projection or suffix, an expert id outside the layer), naming the tensor and the fix.

    Source: vLLM ``RoutedExperts.load_weights`` (0.25-0.32), without the stacked-tensor branch that mistakes a
    per-expert trellis for all experts (the 0.25-0.31 bug).
    """
    state: ExpertState = layer.quant_state
    down = {getattr(layer, "ckpt_down_proj_name", None) or "down_proj": PROJ_DOWN}
    if state.gated:
        projs = {
            getattr(layer, "ckpt_gate_proj_name", None) or "gate_proj": PROJ_GATE,
            getattr(layer, "ckpt_up_proj_name", None) or "up_proj": PROJ_UP,
            **down,
        }
    else:  # an ungated expert's one input projection (the checkpoint's up_proj) is vLLM's w1
        projs = {getattr(layer, "ckpt_gate_proj_name", None) or "up_proj": PROJ_GATE, **down}
    name_of = getattr(layer, "layer_name", None) or state.prefix or "MoE layer"
    for name, tensor in weights:
        m = _EXPERT_NAME.match(name)
        proj = projs.get(m.group(2)) if m else None
        suffix = m.group(3) if m else None
        if m is None or proj is None or suffix not in state.suffixes:
            raise LayerLoadError(
                f"{name_of}: checkpoint tensor {name!r} is not a per-expert {state.label} tensor "
                f"(<expert>.{{{', '.join(projs)}}}.{{{', '.join(state.suffixes)}}}); stacked or dense experts in a "
                f"{state.label} layer are not supported - quantize every expert, or keep the whole layer dense"
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


@dataclass
class ExpertState:
    """Everything the method knows about one expert layer (``layer.quant_state``).

    Attributes:
        prefix: the vLLM module name.
        label: the experts' format as messages name it (``EXL3``).
        suffixes: the checkpoint suffixes of one expert projection.
        num_experts: the layer's experts (all of them: expert parallelism is refused).
        hidden: the model's hidden size; intermediate: the experts' full logical intermediate size.
        params_dtype: the model dtype.
        tp_size, tp_rank: the tensor-parallel rank; sliced: the intermediate channels are cut on whole blocks (else,
            under tensor parallelism, the experts are split whole).
        kernel: the chosen kernel's name; fn / params / static: how ``apply`` runs the bank (None before processing).
        idle: an expert split with more ranks than experts left this rank none (it adds zero).
        local_ids: the buffer ``local_ids`` maps vLLM's expert ids to this rank's bank (-1 for other ranks' experts).
        gated: gated SiLU experts (gate, up, down) or, when False, ungated relu² experts (w1 = the checkpoint's
            up_proj, and down).
    """

    prefix: str
    label: str
    suffixes: tuple[str, ...]
    num_experts: int
    hidden: int
    intermediate: int
    params_dtype: torch.dtype
    tp_size: int
    tp_rank: int
    sliced: bool
    kernel: str | None = None
    fn: Callable[..., None] | None = None
    params: tuple[str, ...] = ()
    static: tuple = ()
    idle: bool = False
    local_ids: bool = False
    gated: bool = True

    @property
    def projections(self) -> tuple[str, ...]:
        """The projections every expert of the layer stores (vLLM's shard ids)."""
        return expert_projections(self.gated)


class QuantMoEMethod(FusedMoEMethodBase):
    """MoE method for a quantized format's expert banks (per-expert K, one codebook per layer), see the module
    docstring. A format binds it in a subclass: ``class Exl3MoEMethod(QuantMoEMethod): format = EXL3``.

    Args:
        moe: vLLM's ``FusedMoEConfig`` of the layer.
        config: the model's quant config (a :class:`~.config.QuantpackConfig`: platform, kernel lists, kernel log).
        prefix: the vLLM module name, e.g. ``model.layers.3.mlp.experts``.

    Raises (from :meth:`create_weights`):
        UnsupportedMoeError: expert parallelism, an activation other than gated SiLU or ungated relu², expert biases,
            routing weights applied on the input, or SwiGLU limits (each named, with the way out).

    Tensor parallelism: each rank keeps its share of every expert's intermediate channels (``w1`` / ``w3`` column
    parallel, ``w2`` row parallel; vLLM all-reduces the ranks' partial sums) when the share is whole 128-channel
    blocks. Otherwise (e.g. 128 channels over 2 ranks) the experts are split whole instead: rank ``r`` of ``tp`` keeps
    and runs experts ``e % tp == r`` (:func:`quantpack_core.tp.expert_split`, vLLM's round-robin placement), each
    routed pick runs on the one rank that holds its expert, and vLLM's all-reduce adds the ranks' sums (exact up to
    the rounding of each rank's partial sum to the model dtype, as for any row-parallel layer); announced with a
    warning when the layer is built.
    """

    format: ClassVar[ExpertFormat]

    def __init__(self, moe, config, prefix: str = ""):
        super().__init__(moe)
        self.config = config
        self.prefix = prefix
        # decided here, not in the property: torch.compile traces the property on CPU and cannot import there
        self._cpu_select_experts = None
        if _cpu_without_router():
            try:
                from vllm.model_executor.layers.fused_moe.experts.cpu_moe import select_experts
            except ImportError:  # vLLM 0.22's module for it
                from vllm.model_executor.layers.fused_moe.cpu_fused_moe import select_experts

            self._cpu_select_experts = select_experts

    # ------------------------------------------------------------------------------------------------ create

    def _check_supported(self, layer: torch.nn.Module) -> bool:
        """Refuse what the banks cannot serve; returns whether the experts are gated."""
        moe = self.moe
        where = self.prefix or "MoE layer"
        name = self.format.label
        act = str(getattr(getattr(moe, "activation", None), "value", getattr(moe, "activation", "silu")))
        gated = bool(getattr(moe, "is_act_and_mul", True))
        if (act, gated) not in (("silu", True), ("relu2_no_mul", False), ("relu2", False)):
            raise UnsupportedMoeError(
                f"{where}: activation {act!r} ({'gated' if gated else 'not gated'}); {name} expert banks serve gated "
                "SiLU experts (silu(gate) * up) and ungated relu2 experts (relu(up)^2) only - this model's experts "
                "cannot be served by this version"
            )
        if getattr(moe, "has_bias", False):
            raise UnsupportedMoeError(f"{where}: expert biases are not supported for {name} expert banks")
        if getattr(layer, "apply_router_weight_on_input", False):
            raise UnsupportedMoeError(
                f"{where}: the model applies routing weights to the expert input; {name} expert banks weight the "
                "expert outputs only"
            )
        if any(getattr(moe, n, None) is not None for n in ("swiglu_limit", "swiglu_alpha", "swiglu_beta")):
            raise UnsupportedMoeError(f"{where}: clamped SwiGLU experts are not supported for {name} expert banks")
        parallel = getattr(moe, "moe_parallel_config", None)
        if getattr(parallel, "use_ep", False):
            raise UnsupportedMoeError(
                f"{where}: expert parallelism is not supported for {name} expert banks - run without "
                "--enable-expert-parallel"
            )
        return gated

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: object,
    ) -> None:
        """Register the placeholders (see :class:`~.params.ExpertParam`), the layer's :class:`ExpertState`, and
        replace the layer's ``load_weights``.

        Args:
            layer: the expert layer.
            num_experts: experts on this rank (all of them: expert parallelism is refused).
            hidden_size: the model's hidden size (vLLM may round it up for some all-to-all kernels).
            intermediate_size_per_partition: this rank's intermediate size.
            params_dtype: model dtype.
            extra_weight_attrs: vLLM's ``weight_loader`` (deliberately not used: it narrows stacked tensors).

        Raises:
            UnsupportedMoeError: see the class.
        """
        gated = self._check_supported(layer)
        tp_size = int(getattr(self.moe, "tp_size", 1) or 1)
        tp_rank = int(getattr(self.moe, "tp_rank", 0) or 0)
        inter_full = int(intermediate_size_per_partition) * tp_size
        suffixes = tuple(self.format.suffixes)
        for family in FAMILIES:
            for suffix in suffixes:
                param = ExpertParam(suffix, self.format.suffixes[suffix], family, self.prefix, int(num_experts))
                layer.register_parameter(f"{family}_{suffix}", param)
        layer.quant_state = ExpertState(
            self.prefix,
            self.format.label,
            suffixes,
            int(num_experts),
            int(hidden_size),
            inter_full,
            params_dtype,
            tp_size,
            tp_rank,
            self._tp_sliced(inter_full, tp_size),
            gated=gated,
        )
        # An instance attribute shadows RoutedExperts.load_weights (MoERunner.load_weights delegates to it).
        layer.load_weights = functools.partial(load_expert_weights, layer)
        self.config.kernel_log.expect(layer)

    def _tp_sliced(self, inter: int, tp_size: int) -> bool:
        """Whether this layer's experts are cut along their intermediate channels (each rank a whole number of
        blocks); if not, the expert split that replaces the cut is announced here, before any weight is loaded."""
        if tp_size == 1:
            return True
        block = self.format.block
        blocks = padded(inter, block) // block
        if blocks % tp_size == 0:
            return True
        key = (tp_size, inter)
        if key not in _reported and int(getattr(self.moe, "tp_rank", 0) or 0) == 0:
            _reported.add(key)
            sizes = [d for d in sliced_tp_sizes([padded(inter, block)], limit=64) if d > 1]
            ok = ", ".join(map(str, sizes)) if sizes else "none above 1"
            logger.warning(
                "quantpack: %s (and MoE layers like it) at tensor-parallel size %d: the experts' intermediate "
                "size %d (stored %d, %d Hadamard block%s of %d) cannot be cut into whole blocks per rank, so the "
                "experts are split whole instead: rank r keeps and runs experts e with e %% %d == r, and vLLM's "
                "all-reduce adds the ranks' sums (exact up to the rounding of each rank's partial sum to the model "
                "dtype, as for any row-parallel layer; a rank's share of the routed work follows the router). "
                "Tensor-parallel sizes that cut these experts on whole blocks instead: %s",
                self.prefix,
                tp_size,
                inter,
                padded(inter, block),
                blocks,
                "" if blocks == 1 else "s",
                block,
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

    def _expert_tensors(self, layer: torch.nn.Module, state: ExpertState) -> dict[tuple[int, str], Any]:
        by_key: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for family in FAMILIES:
            for suffix in state.suffixes:
                for key, t in getattr(layer, f"{family}_{suffix}").captured.items():
                    by_key.setdefault(key, {})[suffix] = t
        main = self.format.main_suffix
        if not state.gated and any(proj == PROJ_UP for _, proj in by_key):
            e = min(e for e, proj in by_key if proj == PROJ_UP)
            raise LayerLoadError(
                f"{self.prefix}: expert {e} has a w3 (a second input projection), but the model builds this layer with "
                "ungated experts (one input projection, relu2): the pack was made for another architecture or config "
                "- use the config the pack was made with"
            )
        missing = [
            (e, proj)
            for e in range(state.num_experts)
            for proj in state.projections
            if main not in by_key.get((e, proj), {})
        ]
        if missing:
            listing = ", ".join(f"{e}.{proj_module(p, state.gated)}" for e, p in missing[:6])
            more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
            kinds = "gate/up/down" if state.gated else "up/down (ungated)"
            raise LayerLoadError(
                f"{self.prefix}: no {self.format.label} {main} for experts {listing}{more} (of {state.num_experts} "
                f"experts x {kinds}); the pack is incomplete or does not match config.json - re-download it"
            )
        out = {}
        for (e, proj), tensors in sorted(by_key.items()):
            try:
                out[(e, proj)] = self.format.parse(tensors)
            except CodecError as err:
                module = proj_module(proj, state.gated)
                raise LayerLoadError(
                    f"{self.prefix}: expert {e} {module}: {err}; the pack's tensor is incomplete or corrupt - "
                    "re-download or re-quantize it"
                ) from None
        return out

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Check the captured experts, build this rank's bank, choose its kernel, release the captured tensors.

        Raises:
            LayerLoadError: an expert projection missing or corrupt.
            GeometryError: stored sizes that are not the layer's sizes padded to whole blocks, or w1 / w3 of one
                expert at different K (from the bank's plan).
            CodecError: experts of one layer in different codebooks.
            NoKernelError: no kernel of the platform's list runs the bank.
        """
        state: ExpertState = layer.quant_state
        if state.fn is not None or state.idle:
            return
        tensors = self._expert_tensors(layer, state)
        block = self.format.block
        hidden, inter = state.hidden, state.intermediate
        gu = (padded(hidden, block), padded(inter, block))
        want = {PROJ_GATE: gu, PROJ_UP: gu, PROJ_DOWN: (gu[1], gu[0])}
        for (e, proj), t in tensors.items():
            if self.format.stored_shape(t) != want[proj]:
                k, n = self.format.stored_shape(t)
                module = proj_module(proj, state.gated)
                raise GeometryError(
                    f"{self.prefix}: expert {e} {module} stores a {k}x{n} (in x out) {self.format.label} matrix, "
                    f"the layer needs {want[proj][0]}x{want[proj][1]} (hidden {hidden}, intermediate {inter}, "
                    f"padded to {block}): the pack does not match config.json - use the config the pack was made with"
                )
        device = getattr(layer, f"w13_{self.format.main_suffix}").device
        # a sliced rank keeps its intermediate channels of every expert; otherwise it keeps its experts whole
        local = None if state.sliced else expert_split(state.num_experts, state.tp_size, state.tp_rank)
        bank = None
        if local is None:
            bank = self.format.build_bank(self.prefix, tensors, device, state.tp_size, state.tp_rank)
        elif local:
            tensors = {(i, proj): tensors[(e, proj)] for i, e in enumerate(local) for proj in state.projections}
            bank = self.format.build_bank(self.prefix, tensors, device, 1, 0)
        for family in FAMILIES:
            for suffix in state.suffixes:
                getattr(layer, f"{family}_{suffix}").release()
                delattr(layer, f"{family}_{suffix}")
        if bank is None:  # expert split with more ranks than experts: this one holds none
            state.idle = True
            self.config.kernel_log.finish(layer)
            return
        if local:
            # logical expert -> this rank's bank id, -1 for the experts other ranks hold (the ops skip those picks)
            local_ids = torch.full((state.num_experts,), -1, dtype=torch.int64)
            local_ids[local] = torch.arange(len(local))
            layer.register_buffer("local_ids", local_ids.to(device), False)
            state.local_ids = True
        if state.tp_size > 1 and state.sliced:  # the rank's logical channels (the stored ones past it are padding)
            inter = self.format.bank_intermediate(bank, inter)
        tp = TP_WHOLE if state.tp_size == 1 else TP_SLICED if state.sliced else TP_EXPERT_SPLIT
        spec = self.format.expert_spec(bank, self.config.platform, state.params_dtype, tp, state.num_experts)
        choice = choose_kernel(self.config.expert_kernels, spec, self.prefix)
        self.config.kernel_log.record("experts", choice)
        prepared = choice.kernel.prepare(bank, spec, hidden, inter, device)
        names = []
        for name, tensor in prepared.tensors.items():
            layer.register_parameter(f"bank_{name}", torch.nn.Parameter(tensor, requires_grad=False))
            names.append(f"bank_{name}")
        state.kernel, state.fn, state.params, state.static = (
            choice.kernel.name,
            prepared.run,
            tuple(names),
            prepared.static,
        )
        logger.debug("quantpack: %s: %s on %s", self.prefix, spec.describe(), choice.kernel.name)
        self.config.compile_key.add(self.prefix, state.kernel, op_name(state.fn), state.params, state.static)
        self.config.kernel_log.finish(layer)

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
        state: ExpertState = layer.quant_state
        if state.idle:  # expert split with more ranks than experts: this rank holds none, adds zero
            return torch.zeros_like(x)
        if state.fn is None:
            raise LayerLoadError(f"{self.prefix}: forward before process_weights_after_loading built the bank")
        if state.local_ids:  # expert split: picks of other ranks' experts become -1
            topk_ids = layer.local_ids[topk_ids.long()]
        out = torch.empty_like(x)
        state.fn(x, topk_ids, topk_weights, *[getattr(layer, n) for n in state.params], *state.static, out)
        return out
