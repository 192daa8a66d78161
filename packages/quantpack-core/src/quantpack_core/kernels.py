"""The kernel contract: what a kernel is told about one shard or expert bank, how it says yes or no, what it hands
back, and how one is chosen from a priority list.

A *kernel* runs one operation kind for one quantized format: a linear shard (:class:`LinearKernel`) or an MoE expert
bank (:class:`ExpertKernel`). It answers :meth:`Kernel.can_implement` for a frozen spec (:class:`LinearSpec`,
:class:`ExpertSpec`: platform and capability, K, codebook, stored shape, dtypes, tensor-parallel cut) with
``(ok, reason)``, and :meth:`Kernel.available` for the platform alone (is its extension importable here). A format
keeps one priority list per operation and platform kind, fastest first; :func:`choose_kernel` walks it per shard,
takes the first kernel that accepts, and keeps every earlier kernel's reason, so one model can run some shards on a
new kernel and the rest on the next one. When none accepts, :class:`~quantpack_core.errors.NoKernelError` joins the
reasons. :class:`KernelLog` collects the choices of one model and renders them as one table.

Plain torch; no vLLM import (the vLLM side fills in the platform: :mod:`quantpack_core.vllm.platform`). Follows
vLLM's mixed-precision kernel selection (``vllm/model_executor/layers/quantization/kernels/mixed_precision/
__init__.py``: ``choose_mp_linear_kernel`` over a list in priority order, each ``MPLinearKernel.can_implement``
returning ``(bool, reason)``, the reasons joined in the error) and docs/kernels.md.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from .errors import NoKernelError
from .progress import report_modules

logger = logging.getLogger("vllm.quantpack")

CUDA, ROCM, CPU = "cuda", "rocm", "cpu"
#: tensor-parallel situations a spec names (see :class:`LinearSpec` / :class:`ExpertSpec`)
TP_WHOLE, TP_SLICED, TP_COLUMN_FALLBACK, TP_ROW_FALLBACK, TP_EXPERT_SPLIT = (
    "whole",
    "sliced",
    "column-fallback",
    "row-fallback",
    "expert-split",
)


@dataclass(frozen=True)
class Platform:
    """Where kernels would run.

    Attributes:
        kind: ``"cuda"``, ``"rocm"``, ``"cpu"`` (or another vLLM platform's device type, which no kernel takes).
        capability: CUDA compute capability as ``major * 10 + minor`` (90 for an H200); None elsewhere or unknown.
        arch: the ROCm architecture (``"gfx1201"``); None elsewhere or unknown.
    """

    kind: str
    capability: int | None = None
    arch: str | None = None

    def cuda_reason(self, min_capability: int) -> str | None:
        """Why a CUDA kernel that needs compute capability ``min_capability`` (``major * 10 + minor``) cannot run on
        this platform, or None (an unknown capability is let through)."""
        if self.kind != CUDA:
            return f"needs a CUDA device (this platform is {self.kind or 'unspecified'!r})"
        if self.capability is not None and self.capability < min_capability:
            return (
                f"needs compute capability {min_capability / 10:.1f} or newer (this GPU has {self.capability / 10:.1f})"
            )
        return None

    def __str__(self) -> str:
        if self.capability is not None:
            return f"{self.kind} sm_{self.capability}"
        return f"{self.kind} {self.arch}" if self.arch else self.kind


@dataclass(frozen=True)
class LinearSpec:
    """One linear shard as a kernel sees it, once its tensors are loaded and this rank's part is cut.

    Attributes:
        platform: where it runs.
        format: the shard's storage: a quantized format's name (``"exl3"``) or ``"dense"``.
        k_bits: bits per weight K (None for a dense shard).
        codebook: the codebook's name (``"3inst"``, ``"mcg"``, ``"mul1"``; None for a dense shard).
        stored_in, stored_out: the stored (padded) input and output features of what the rank keeps.
        in_features, out_features: the logical features of what the rank keeps (<= stored).
        act_dtype: the model dtype (activations in, output out).
        tp: ``"whole"`` (no tensor parallelism), ``"sliced"`` (the rank's share cut on whole blocks),
            ``"column-fallback"`` / ``"row-fallback"`` (the blocks the share touches; the method selects or pads).
        max_rows: the most rows one call takes (the serving engine's token budget), for a kernel that prepares per
            row count; None: unknown.
    """

    platform: Platform
    format: str
    k_bits: float | None
    codebook: str | None
    stored_in: int
    stored_out: int
    in_features: int
    out_features: int
    act_dtype: torch.dtype
    tp: str = TP_WHOLE
    max_rows: int | None = None

    def describe(self) -> str:
        """A short human description for logs: format, K, codebook, logical shape."""
        what = self.format if self.k_bits is None else f"{self.format} K={self.k_bits:g} {self.codebook}"
        return f"{what} {self.in_features}x{self.out_features}"


@dataclass(frozen=True)
class ExpertSpec:
    """One MoE layer's expert bank on one rank, as a kernel sees it.

    Attributes:
        platform: where it runs.
        format: the experts' format (``"exl3"``).
        codebook: the one codebook of the bank.
        k_groups: the bank's ``(K of gate/up, K of down)`` groups, in slot order.
        num_experts: experts in this rank's bank.
        layer_experts: the layer's routed experts over all ranks (``num_experts`` but under the expert split): the
            picks per expert a call brings are its picks over these.
        hidden, intermediate: stored (padded) hidden size and this rank's stored intermediate size.
        act_dtype: the model dtype.
        tp: ``"whole"``, ``"sliced"`` (the intermediate channels cut on whole blocks) or ``"expert-split"`` (whole
            experts per rank; picks of other ranks' experts arrive as id -1).
        gated: ``down(silu(x W1) * (x W3))`` experts; False: ungated ``down(relu(x W1)²)`` (no W3).
    """

    platform: Platform
    format: str
    codebook: str
    k_groups: tuple[tuple[float, float], ...]
    num_experts: int
    layer_experts: int
    hidden: int
    intermediate: int
    act_dtype: torch.dtype
    tp: str = TP_WHOLE
    gated: bool = True

    def describe(self) -> str:
        """A short human description for logs."""
        ks = ", ".join(f"{a:g}/{b:g}" for a, b in self.k_groups)
        kind = "" if self.gated else " ungated relu2"
        return f"{self.format} {self.codebook} {self.num_experts}{kind} experts, K {ks}"


@dataclass(frozen=True)
class PreparedShard:
    """One linear shard in the form its kernel runs it.

    Attributes:
        run: ``run(x, *tensors.values(), *static, out, col)``: one registered custom op call that writes
            ``out[:, col:col + out_features]`` of the layer's output.
        tensors: the shard's device tensors (the method registers them as parameters of the layer).
        out_features: output columns the shard writes.
        static: Python scalars passed after the tensors (codebook id, K, widths).
        returns: optionally, ``returns(x, *tensors.values(), bias) -> y``: the same product as a new
            ``(rows, out_features)`` tensor with ``bias`` (or None) added, through one registered op. When it is a
            layer's only run and nothing is selected or padded around it, the linear method returns it directly (no
            output buffer, no column copy): vLLM's own CPU GEMM (:mod:`quantpack_core.vllm.cpu_linear`).
    """

    run: Callable[..., None]
    tensors: dict[str, torch.Tensor]
    out_features: int
    static: tuple = field(default=())
    returns: Callable[..., torch.Tensor] | None = None


@dataclass(frozen=True)
class PreparedBank:
    """One expert bank in the form its kernel runs it.

    Attributes:
        run: ``run(x, topk_ids, topk_weights, *tensors.values(), *static, out)``: one registered custom op call that
            writes ``out (T, hidden)``.
        tensors: device tensors the op reads (registered as parameters of the layer).
        static: Python scalars / lists after the tensors.
    """

    run: Callable[..., None]
    tensors: dict[str, torch.Tensor]
    static: tuple = field(default=())


class Kernel(ABC):
    """A kernel for one operation kind of one format. Subclasses are used as classes (no instances): their state is
    what :meth:`LinearKernel.prepare` / :meth:`ExpertKernel.prepare` return.

    Attributes:
        name: short name, as users force it (``QUANTPACK_EXL3_BACKEND=<name>``) and as logs show it.
    """

    name: ClassVar[str]

    @classmethod
    def available(cls, platform: Platform) -> tuple[bool, str | None]:
        """Whether the kernel can run on ``platform`` at all in this environment (its extension imports, the device
        is new enough), independent of any shard. Checked when a config is built, so an unusable environment fails
        before any weight is read. Default: available everywhere (a plain-torch kernel); its platform rules are then
        all in :meth:`can_implement`.

        Returns:
            ``(True, None)`` or ``(False, reason)``; the reason says how to fix it where it can be fixed.
        """
        return True, None

    @classmethod
    @abstractmethod
    def can_implement(cls, spec: Any) -> tuple[bool, str | None]:
        """Whether the kernel computes this shard or bank exactly (within its stated rounding) on its platform.

        Returns:
            ``(True, None)`` or ``(False, reason)``; the reason names what does not fit (``"K=1.5"``, ``"sm_75"``).
        """


class LinearKernel(Kernel):
    """A kernel for one linear shard."""

    @classmethod
    @abstractmethod
    def prepare(cls, shard: Any, spec: LinearSpec, device: torch.device) -> PreparedShard:
        """Turn one loaded shard into the kernel's form on ``device`` (after any warm-up it needs before CUDA-graph
        capture).

        Args:
            shard: the format's parsed tensors of the rank's part (:class:`~quantpack_core.codec.Exl3Tensors` for
                EXL3), or for a dense shard the ``(out, in)`` weight.
            spec: what :meth:`can_implement` accepted.
            device: where the layer lives.
        """

    @classmethod
    def fuse(cls, shards: list[PreparedShard]) -> PreparedShard | None:
        """One run for consecutive shards of one layer that this kernel prepared (they share the layer's input:
        q / k / v, gate / up), writing their columns in order; None keeps one run per shard.

        The default fuses nothing. A kernel that can (one GEMM over concatenated weights, one launch over a table of
        shards) returns a :class:`PreparedShard` whose ``out_features`` is the shards' sum; it may decline any group
        (shards it cannot combine) by returning None.
        """
        return None

    @classmethod
    def finalize(cls, prepared: PreparedShard) -> PreparedShard:
        """The last step at load for each run of a layer (a shard, or what :meth:`fuse` made of several), e.g.
        handing a dense weight to the platform's own GEMM with its prepacking. The default keeps the run."""
        return prepared


class ExpertKernel(Kernel):
    """A kernel for one MoE layer's expert bank."""

    @classmethod
    @abstractmethod
    def prepare(cls, bank: Any, spec: ExpertSpec, hidden: int, intermediate: int, device: torch.device) -> PreparedBank:
        """Turn one loaded bank into the kernel's form.

        Args:
            bank: the format's bank (:class:`~quantpack_core.moe.Exl3MoeBank` for EXL3), on ``device``.
            spec: what :meth:`can_implement` accepted.
            hidden, intermediate: the layer's logical hidden size and this rank's logical intermediate size (the
                bank's are padded to 128).
            device: where the layer lives.
        """


@dataclass(frozen=True)
class Choice:
    """The outcome of :func:`choose_kernel` for one shard or bank.

    Attributes:
        kernel: the chosen kernel class.
        declined: ``(kernel name, reason)`` of every kernel before it in the list.
    """

    kernel: type[Kernel]
    declined: tuple[tuple[str, str], ...]


def choose_kernel(kernels: Sequence[type[Kernel]], spec: Any, where: str) -> Choice:
    """The first kernel of ``kernels`` (a priority list, fastest first) that accepts ``spec``.

    Args:
        kernels: the candidates in priority order (already narrowed to the platform, or to one forced kernel).
        spec: a :class:`LinearSpec` or :class:`ExpertSpec`.
        where: the layer (and shard) the spec is for, named in the error.

    Returns:
        the :class:`Choice`.

    Raises:
        NoKernelError: no kernel accepts; the message names ``where``, the spec and every kernel's reason.
    """
    declined: list[tuple[str, str]] = []
    for kernel in kernels:
        ok, why = kernel.available(spec.platform)
        if ok:
            ok, why = kernel.can_implement(spec)
        if ok:
            return Choice(kernel, tuple(declined))
        declined.append((kernel.name, why or "declined"))
    reasons = "; ".join(f"{name}: {why}" for name, why in declined) or "the priority list is empty"
    raise NoKernelError(
        f"{where}: no kernel on {spec.platform} runs this {spec.describe()} ({reasons}) - see docs/kernels.md for "
        "what each kernel takes, or serve the pack on a platform that has one"
    )


class KernelLog:
    """The kernel choices of one model, logged once as a table when its last layer is processed.

    A method calls :meth:`expect` when it creates a layer's weights, :meth:`record` for each shard or bank it
    chooses a kernel for, and :meth:`finish` when the layer is processed (or :meth:`forget` when the layer will
    never be processed: a head tied to the embedding). When no expected layer is left, the table is logged at INFO
    and the counts start again (a later model of the process logs its own).

    Args:
        title: what the table is for (``"quantpack-exl3"``).
    """

    def __init__(self, title: str):
        self.title = title
        self._pending: set[int] = set()
        self._done = 0
        self.counts: dict[tuple[str, str], int] = {}
        self.declined: dict[tuple[str, str, str], int] = {}

    def expect(self, layer: object) -> None:
        """A layer whose weights were created and will be processed."""
        self._pending.add(id(layer))

    def forget(self, layer: object) -> None:
        """A layer that will not be processed after all; may complete the model."""
        self._pending.discard(id(layer))
        self._maybe_log()

    def _step(self, layer: object) -> None:
        """One expected layer processed: counted for ``quantpack serve``'s progress (:mod:`.progress`)."""
        if id(layer) in self._pending:
            self._pending.discard(id(layer))
            self._done += 1
            report_modules(self._done, self._done + len(self._pending))

    def record(self, op: str, choice: Choice) -> None:
        """One shard (``op="linear"``) or bank (``op="experts"``) and the kernel chosen for it."""
        key = (op, choice.kernel.name)
        self.counts[key] = self.counts.get(key, 0) + 1
        for name, why in choice.declined:
            k = (op, name, why)
            self.declined[k] = self.declined.get(k, 0) + 1

    def finish(self, layer: object) -> None:
        """The layer is processed; logs the table when it was the last one expected."""
        self._step(layer)
        self._maybe_log()

    def table(self) -> str:
        """The choices so far: one line per (operation, kernel) with its count, then one per (kernel, reason) of
        the kernels that declined, with how many shards or banks they declined for that reason."""
        lines = [f"{self.title}: kernels chosen per shard"]
        for (op, name), n in sorted(self.counts.items()):
            unit = "shard" if op == "linear" else "bank"
            lines.append(f"  {op:<8} {name:<16} {n:>6} {unit}{'s' if n != 1 else ''}")
        for (op, name, why), n in sorted(self.declined.items()):
            lines.append(f"  {op:<8} {name:<16} declined {n}: {why}")
        return "\n".join(lines)

    def _maybe_log(self) -> None:
        if self._pending or not self.counts:
            return
        logger.info("%s", self.table())
        self._done = 0
        self.counts.clear()
        self.declined.clear()
