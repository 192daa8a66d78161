"""The EXL3 linear method for vLLM's linear layers and ``ParallelLMHead``.

An EXL3 pack stores every projection self-contained (trellis, suh, svh, codebook marker, own K), so the shards of a
fused vLLM layer (q/k/v in ``qkv_proj``, gate/up in ``gate_up_proj``, Qwen3.5's ``in_proj_qkv`` + ``in_proj_z`` in
``in_proj_qkvz``) cannot be concatenated into one quantized matrix. And nothing about a shard's shape or K is known
before its tensors arrive. Hence:

* ``create_weights`` registers empty placeholder parameters under the checkpoint's suffixes; each carries its own
  loader that captures whole checkpoint tensors per shard id (str, int or tuple), so vLLM never narrows a trellis;
* ``process_weights_after_loading`` checks what arrived against the layer (every shard present, one kind per layer,
  sound tensors, stored sizes = logical sizes rounded up to 128), lets the backend build its form, and drops the
  captured host tensors;
* ``apply`` runs one registered custom op per shard.

Follows vLLM's ``LinearMethodBase`` / ``BasevLLMParameter`` (``vllm/model_executor/layers/linear.py``,
``vllm/model_executor/parameter.py``; the placeholder-plus-own-loader pattern is vllm-gguf-plugin's per-shard
parameters) and exllamav3's ``LinearEXL3`` (padding: inputs zero-extended to the stored width, outputs trimmed).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
from vllm.model_executor.layers.linear import LinearMethodBase
from vllm.model_executor.parameter import BasevLLMParameter

from quantpack_core.codec import Exl3Tensors
from quantpack_core.errors import CodecError, GeometryError, QuantpackError
from quantpack_core.hadamard import HAD_BLOCK
from quantpack_core.names import expand_fused, shard_partitions, shard_slot

#: checkpoint suffix -> dtype of its placeholder (and of what the pack stores)
PLACEHOLDERS: dict[str, torch.dtype | None] = {
    "trellis": torch.int16,
    "suh": torch.float16,
    "svh": torch.float16,
    "su": torch.int16,  # legacy packed signs
    "sv": torch.int16,
    "mcg": torch.int32,
    "mul1": torch.int32,
    "weight": None,  # a dense shard: the model dtype
}
EXL3_PARTS = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1")


class LayerLoadError(QuantpackError):
    """A layer's loaded tensors do not fit it; raised while loading, before any forward pass."""


class UnsupportedLayerError(QuantpackError):
    """A layer kind this version of quantpack-exl3 cannot serve; raised when vLLM builds the layer."""


class Exl3ShardParam(BasevLLMParameter):
    """Empty placeholder for one checkpoint suffix of a layer; the real tensors land in :attr:`shards`.

    vLLM wants a Parameter of known shape per weight name, but EXL3 shard shapes (and K) are only known once the file
    is read and differ between the shards of a fused layer. So this Parameter stays empty and carries its own
    ``weight_loader``, which keeps each whole checkpoint tensor keyed by shard slot; vLLM's generic loaders call
    ``param.weight_loader(param, tensor[, shard_id])``.

    Attributes:
        suffix: checkpoint suffix (``trellis``, ``suh`` ...).
        shards: slot -> captured tensor (a view of the safetensors memory map until the layer is processed).
        shard_ids: slot -> the loader's shard id (``None``, ``"q"``, ``1``, ``(0, 1, 2)``).
    """

    def __new__(cls, suffix: str, dtype: torch.dtype, layer_name: str):
        return super().__new__(cls, data=torch.empty(0, dtype=dtype))

    def __init__(self, suffix: str, dtype: torch.dtype, layer_name: str):
        super().__init__(data=torch.empty(0, dtype=dtype), weight_loader=self._capture)
        self.suffix = suffix
        self.layer_name = layer_name
        self.shards: dict[int, torch.Tensor] = {}
        self.shard_ids: dict[int, Hashable | None] = {}

    def _capture(
        self, param: torch.nn.Parameter, loaded_weight: torch.Tensor, shard_id: Hashable | None = None, **_: object
    ) -> None:
        slot = shard_slot(shard_id)
        if slot in self.shards:
            raise LayerLoadError(
                f"{self.layer_name}: .{self.suffix} of shard {shard_id!r} arrived twice; the "
                "checkpoint stores it twice or two names map to it - fix the pack's tensor names"
            )
        self.shards[slot] = loaded_weight
        self.shard_ids[slot] = shard_id

    # vLLM's weight_loader_v2 path calls these hooks; route them to the same capture.
    def load_column_parallel_weight(self, loaded_weight: torch.Tensor, **kw: object) -> None:
        self._capture(self, loaded_weight, kw.get("shard_id"))

    load_row_parallel_weight = load_column_parallel_weight
    load_merged_column_weight = load_column_parallel_weight
    load_qkv_weight = load_column_parallel_weight


@dataclass(frozen=True)
class ShardRun:
    """How ``apply`` runs one prepared shard.

    Attributes:
        fn: the op wrapper, ``fn(x, *params, *static, out, col)``.
        params: names of the layer parameters holding the shard's tensors.
        static: Python scalars of the op (codebook, K, widths).
        col: the shard's first output column.
    """

    fn: Callable[..., None]
    params: tuple[str, ...]
    static: tuple
    col: int


@dataclass(frozen=True)
class ShardPlan:
    """Where one loaded shard goes in the layer's output.

    Attributes:
        slot: sort key (vLLM's concatenation order).
        shard_id: the loader's id.
        partitions: the layer's output partitions it covers.
        in_features: logical input features.
        out_features: logical output features (sum of its partitions).
        label: human name for messages (checkpoint module when known).
    """

    slot: int
    shard_id: Hashable | None
    partitions: tuple[int, ...]
    in_features: int
    out_features: int
    label: str


def _padded(n: int) -> int:
    return (n + HAD_BLOCK - 1) // HAD_BLOCK * HAD_BLOCK


class Exl3LinearMethod(LinearMethodBase):
    """Linear method for EXL3 layers (and dense layers a pack stores as ``.weight``), per shard.

    Args:
        backend: kernel backend class (see :mod:`quantpack_exl3.backends`).
        prefix: the vLLM module name, for messages.
        is_lm_head: the layer is ``ParallelLMHead`` (its vocabulary rows are padded by vLLM to a multiple of 64).
    """

    def __init__(self, backend, prefix: str = "", is_lm_head: bool = False):
        self.backend = backend
        self.prefix = prefix
        self.is_lm_head = is_lm_head

    # ------------------------------------------------------------------------------------------------ create

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: object,
    ) -> None:
        """Register the placeholders; see :class:`Exl3ShardParam`. ``extra_weight_attrs`` (vLLM's own narrowing
        weight_loader) is deliberately not applied.

        Raises:
            GeometryError: for a tensor-parallel split (not supported by this version).
        """
        if input_size_per_partition != input_size or (
            sum(output_partition_sizes) != output_size and not self.is_lm_head
        ):
            raise GeometryError(
                f"{self.prefix}: tensor parallelism splits this layer ({input_size}x{output_size} -> "
                f"{input_size_per_partition}x{sum(output_partition_sizes)} per rank), which quantpack-exl3 "
                "0.1 cannot serve yet; run with --tensor-parallel-size 1"
            )
        for suffix, dtype in PLACEHOLDERS.items():
            layer.register_parameter(suffix, Exl3ShardParam(suffix, dtype or params_dtype, self.prefix))
        layer.exl3_in_features = input_size_per_partition
        layer.exl3_partitions = list(output_partition_sizes)
        layer.exl3_params_dtype = params_dtype
        layer.exl3_runs: list[ShardRun] = []
        layer.exl3_out_total = sum(output_partition_sizes)

    # -------------------------------------------------------------------------------------------------- load

    def _plans(self, layer: torch.nn.Module, captured: dict[str, Exl3ShardParam], kind: str) -> list[ShardPlan]:
        main = captured["trellis" if kind == "exl3" else "weight"]
        parts = layer.exl3_partitions
        slots = sorted(main.shards)
        if kind == "exl3":
            for s in EXL3_PARTS:
                for slot, sid in captured[s].shard_ids.items():
                    if slot not in main.shards:
                        raise LayerLoadError(
                            f"{self.prefix}: shard {sid!r} has .{s} but no .trellis; the pack is incomplete - "
                            "re-download the file that should hold that trellis"
                        )
        labels = self._labels(len(slots))
        plans, covered = [], []
        for i, slot in enumerate(slots):
            sid = main.shard_ids[slot]
            try:
                p = shard_partitions(sid, len(parts))
            except ValueError as e:
                raise LayerLoadError(f"{self.prefix}: {e}") from None
            covered.extend(p)
            plans.append(ShardPlan(slot, sid, p, layer.exl3_in_features, sum(parts[j] for j in p), labels[i]))
        if sorted(covered) != list(range(len(parts))):
            missing = sorted(set(range(len(parts))) - set(covered))
            dup = sorted({c for c in covered if covered.count(c) > 1})
            what = (
                f"output partitions {missing} received no tensor"
                if missing
                else f"output partitions {dup} received two tensors"
            )
            raise LayerLoadError(
                f"{self.prefix}: {what} (got {kind} shards {[pl.shard_id for pl in plans]}); the pack lacks a "
                f"module behind this fused layer (expected one of {expand_fused(self.prefix)}) - re-download it"
            )
        return plans

    def _labels(self, count: int) -> list[str]:
        """Checkpoint module names of ``count`` shards, in shard order, when the fused layout is known."""
        for alt in expand_fused(self.prefix):
            if len(alt) == count:
                return alt
        return [self.prefix] * count

    @staticmethod
    def _shard_name(plan: ShardPlan) -> str:
        return plan.label if plan.shard_id is None else f"shard {plan.shard_id!r} ({plan.label})"

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Validate the captured tensors, build the backend's per-shard weights, release the host copies.

        Raises:
            LayerLoadError: no tensor at all, trellis and dense shards mixed, a shard missing or doubled, a tensor
                of a shard missing (e.g. ``svh`` without ``trellis``), or an unsound EXL3 tensor.
            GeometryError: stored sizes that are not the layer's logical sizes rounded up to 128.
        """
        captured: dict[str, Exl3ShardParam] = {s: getattr(layer, s) for s in PLACEHOLDERS}
        has_exl3 = any(captured[s].shards for s in EXL3_PARTS)
        has_dense = bool(captured["weight"].shards)
        if has_exl3 and has_dense:
            raise LayerLoadError(
                f"{self.prefix}: the pack stores some shards of this layer as EXL3 trellis "
                f"({sorted(captured['trellis'].shard_ids.values(), key=str)}) and others as dense weights "
                f"({sorted(captured['weight'].shard_ids.values(), key=str)}); a fused layer must be all one kind - "
                "re-quantize the pack with the same setting for all of "
                f"{', '.join(n.rsplit('.', 1)[-1] for n in self._labels(len(layer.exl3_partitions)))}"
            )
        if not has_exl3 and not has_dense:
            if self.is_lm_head:
                # A speculative-decoding draft's head: vLLM replaces it with the target's after loading. Left
                # empty; apply() says so if it is ever used.
                for suffix in PLACEHOLDERS:
                    delattr(layer, suffix)
                layer.exl3_empty_head = True
                return
            raise LayerLoadError(
                f"{self.prefix}: no tensor of this layer was loaded (neither .trellis nor .weight); "
                "the pack lacks it - check that the pack matches config.json's architecture"
            )
        device = self._device(layer, captured)
        dtype = layer.exl3_params_dtype
        kernels = []
        if has_exl3:
            for plan in self._plans(layer, captured, "exl3"):
                t = self._shard_tensors(captured, plan)
                self._check_geometry(t, plan)
                kernels.append(self.backend.prepare_shard(t, plan.in_features, plan.out_features, dtype, device))
        else:
            for plan in self._plans(layer, captured, "dense"):
                w = self._fit_dense(captured["weight"].shards[plan.slot], plan)
                kernels.append(self.backend.prepare_dense(w, dtype, device))
        for suffix, param in captured.items():
            param.shards.clear()
            param.shard_ids.clear()
            delattr(layer, suffix)
        col = 0
        for i, kernel in enumerate(kernels):
            names = []
            for name, tensor in kernel.tensors.items():
                layer.register_parameter(f"exl3_{i}_{name}", torch.nn.Parameter(tensor, requires_grad=False))
                names.append(f"exl3_{i}_{name}")
            layer.exl3_runs.append(ShardRun(kernel.run, tuple(names), kernel.static, col))
            col += kernel.out_features
        layer.exl3_out_total = col

    @staticmethod
    def _device(layer: torch.nn.Module, captured: dict[str, Exl3ShardParam]) -> torch.device:
        # The placeholders were created on the layer's target device; captured tensors may still be on the host.
        return captured["trellis"].device

    def _shard_tensors(self, captured: dict[str, Exl3ShardParam], plan: ShardPlan) -> Exl3Tensors:
        got = {s: captured[s].shards[plan.slot] for s in EXL3_PARTS if plan.slot in captured[s].shards}
        try:
            return Exl3Tensors.from_tensors(got)
        except CodecError as e:
            raise LayerLoadError(
                f"{self.prefix}: {self._shard_name(plan)}: {e}; the pack's "
                f"{plan.label} is incomplete or corrupt - re-download or re-quantize it"
            ) from None

    def _check_geometry(self, t: Exl3Tensors, plan: ShardPlan) -> None:
        k, n = t.padded_shape
        want_k = _padded(plan.in_features)
        want_n = _padded(plan.out_features)
        ok_n = n == want_n or (self.is_lm_head and n >= plan.out_features and n - plan.out_features < HAD_BLOCK)
        if k != want_k or not ok_n:
            raise GeometryError(
                f"{self.prefix}: {self._shard_name(plan)} stores a {k}x{n} (in x out) EXL3 matrix, "
                f"the model's layer needs {plan.in_features}x{plan.out_features} (stored as {want_k}x{want_n} after "
                "padding to 128): the pack does not match config.json - use the config the pack was made with"
            )

    def _fit_dense(self, w: torch.Tensor, plan: ShardPlan) -> torch.Tensor:
        if (
            w.dim() != 2
            or w.shape[1] != plan.in_features
            or w.shape[0] > plan.out_features
            or (w.shape[0] < plan.out_features and not self.is_lm_head)
        ):
            raise GeometryError(
                f"{self.prefix}: dense {self._shard_name(plan)} has shape "
                f"{list(w.shape)}, the layer needs [{plan.out_features}, {plan.in_features}] "
                "(out x in) - the pack does not match config.json"
            )
        if w.shape[0] < plan.out_features:  # a dense lm_head over the unpadded vocabulary
            w = torch.nn.functional.pad(w, (0, 0, 0, plan.out_features - w.shape[0]))
        return w

    def tie_weights(self, layer: torch.nn.Module, embed_tokens: torch.nn.Module) -> torch.nn.Module:
        """A head tied to the embedding is the embedding module itself: its method's ``apply`` computes the logits
        (vLLM >= 0.24 calls this from ``ParallelLMHead.tie_weights``)."""
        return embed_tokens

    # ------------------------------------------------------------------------------------------------- apply

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x (..., in)`` -> ``(..., sum of output partitions)`` in ``x``'s dtype: one registered custom op per
        shard, each writing its columns of one preallocated output, then ``bias``."""
        runs = layer.exl3_runs
        if not runs:
            if getattr(layer, "exl3_empty_head", False):
                raise LayerLoadError(
                    f"{self.prefix}: this head received no weights (a draft model's, meant to be "
                    "shared with its target) and was used before vLLM shared it"
                )
            raise LayerLoadError(f"{self.prefix}: forward before process_weights_after_loading built its weights")
        x2 = x.reshape(-1, x.shape[-1])
        out = torch.empty((x2.shape[0], layer.exl3_out_total), dtype=x.dtype, device=x.device)
        for run in runs:
            run.fn(x2, *[getattr(layer, name) for name in run.params], *run.static, out, run.col)
        if bias is not None:
            out += bias
        return out.reshape(*x.shape[:-1], layer.exl3_out_total)
