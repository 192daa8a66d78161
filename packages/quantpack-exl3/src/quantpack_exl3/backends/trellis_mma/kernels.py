"""EXL3 shards and expert banks through the project's own CUDA kernels, ``quantpack_core.trellis_mma`` (sm_80 and
newer, tuned on an H200): this adapter says which EXL3 shards and banks they take, hands them their trellis, codebook
id, K and scales, and gives exllamav3's shard GEMM as the implementation that each run's row buckets go to where its
load-time timing finds it faster (:class:`quantpack_core.trellis_mma.selection.Delegate`), when exllamav3's
extension imports. Float32 models go to exllamav3.

Source: docs/exl3-format.md ("The math", tile placement), docs/kernels.md (how the kernels were measured).
"""

from __future__ import annotations

import functools
import logging

import torch

from quantpack_core import trellis_mma
from quantpack_core.codec import Exl3Tensors
from quantpack_core.kernels import (
    ExpertKernel,
    ExpertSpec,
    LinearKernel,
    LinearSpec,
    Platform,
    PreparedBank,
    PreparedShard,
)
from quantpack_core.moe import Exl3MoeBank, grouped_inputs
from quantpack_core.trellis_mma import settings
from quantpack_core.trellis_mma.library import add_fallback
from quantpack_core.trellis_mma.moe import MAX_EXPERTS as MOE_MAX_EXPERTS
from quantpack_core.trellis_mma.moe import MAX_GROUPS as MOE_MAX_GROUPS
from quantpack_core.trellis_mma.selection import Delegate

NAME = trellis_mma.NAME

add_fallback("QUANTPACK_EXL3_BACKEND=exllamav3")
_warned_bf16 = False
logger = logging.getLogger("vllm.quantpack.exl3")


@functools.cache
def exllamav3_delegate() -> Delegate | None:
    """exllamav3's shard GEMM as the delegate of trellis_mma's runs, or None when its extension does not import
    (tried once per process)."""
    try:
        from ..exllamav3.extension import load_extension
        from ..exllamav3.gemm import run_exl3_gemm
        from ..exllamav3.kernels import WARMUP_ROWS

        load_extension()
    except Exception:
        return None
    return Delegate("exllamav3", run_exl3_gemm, WARMUP_ROWS)


def _common_reason(spec: LinearSpec | ExpertSpec) -> str | None:
    """Why neither trellis_mma kernel takes ``spec`` (not EXL3, not CUDA sm_80+, not a float16 / bfloat16 model), or
    None."""
    if spec.format != "exl3":
        return f"runs EXL3 only, this is {spec.format}"
    return trellis_mma.unsupported(spec.platform, spec.act_dtype)


def _warn_bf16_once(spec: LinearSpec, delegate: Delegate | None) -> None:
    """exllamav3 takes float16 activations: a bfloat16 model's delegated calls are cast (said once per process)."""
    global _warned_bf16
    if spec.act_dtype != torch.bfloat16 or delegate is None or settings.current().delegate_rows == 0 or _warned_bf16:
        return
    _warned_bf16 = True
    logger.warning(
        "quantpack-exl3: the row counts of each layer where exllamav3's kernels are faster go to them, and "
        "they take float16 activations: this bfloat16 model's activations are cast there, and values beyond "
        "+-65504 would overflow. Serve with --dtype float16, or set QUANTPACK_TRELLIS_MMA_DELEGATE_ROWS=0 to "
        "keep every call in trellis_mma."
    )


class TrellisMmaLinearKernel(LinearKernel):
    """One EXL3 shard through the trellis_mma kernels (see the module)."""

    name = NAME

    @classmethod
    def available(cls, platform: Platform) -> tuple[bool, str | None]:
        """CUDA sm_80+, a device torch sees, and a compiler for the kernels (:func:`quantpack_core.trellis_mma.
        kernels.available`; no CUDA initialization, no build here)."""
        return trellis_mma.available(platform)

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str | None]:
        """Every EXL3 shard of a float16 / bfloat16 model on CUDA sm_80+."""
        why = _common_reason(spec)
        return why is None, why

    @classmethod
    def prepare(cls, shard: Exl3Tensors, spec: LinearSpec, device: torch.device) -> PreparedShard:
        """The shard through :func:`quantpack_core.trellis_mma.prepare_shard` (workspace, warm-up, its delegated row
        buckets), with exllamav3's GEMM as the delegate where it imports.

        Raises:
            quantpack_core.trellis_mma.library.LibraryError: the kernels cannot be built or loaded, or a warm-up
                launch failed (the message names the fix).
        """
        delegate = exllamav3_delegate()
        _warn_bf16_once(spec, delegate)
        t = shard
        return trellis_mma.prepare_shard(
            t.trellis, t.suh, t.svh, t.codebook.kernel_id, float(t.k_bits), spec.out_features, spec.act_dtype,
            device, delegate, spec.max_rows,
        )  # fmt: skip

    @classmethod
    def fuse(cls, shards: list[PreparedShard]) -> PreparedShard | None:
        """One run for a layer's shards that share its input (q / k / v, gate / up):
        :func:`quantpack_core.trellis_mma.fuse_shards`, its delegated row buckets measured against exllamav3's GEMM."""
        return trellis_mma.fuse_shards(shards, exllamav3_delegate())


class TrellisMmaExpertKernel(ExpertKernel):
    """An EXL3 expert bank through the trellis_mma grouped kernels (``quantpack::trellis_moe_``,
    :mod:`quantpack_core.trellis_mma.moe`): the routed picks bucketed per expert on the GPU, each expert's trellis
    decoded once per 16 of its tokens, gate and up in one launch for every K group (each work item at its group's
    K), silu(gate) * up inside the down launch, the routing weight applied and the token's picks summed in a fixed
    order. First in the CUDA list for float16 / bfloat16 banks of up to 16 K groups (docs/kernels.md)."""

    name = NAME

    @classmethod
    def available(cls, platform: Platform) -> tuple[bool, str | None]:
        """As the linear kernel: CUDA sm_80+, a device torch sees, a compiler."""
        return trellis_mma.available(platform)

    @classmethod
    def can_implement(cls, spec: ExpertSpec) -> tuple[bool, str | None]:
        """EXL3 banks of float16 / bfloat16 models on CUDA sm_80+, up to :data:`quantpack_core.trellis_mma.moe.
        MAX_EXPERTS` slots and :data:`quantpack_core.trellis_mma.moe.MAX_GROUPS` K groups."""
        why = _common_reason(spec)
        if why is not None:
            return False, why
        if spec.num_experts > MOE_MAX_EXPERTS:
            return False, f"takes up to {MOE_MAX_EXPERTS} experts per bank, this one has {spec.num_experts}"
        if len(spec.k_groups) > MOE_MAX_GROUPS:
            return False, f"takes up to {MOE_MAX_GROUPS} K groups per bank, this one has {len(spec.k_groups)}"
        return True, None

    @classmethod
    def prepare(
        cls, bank: Exl3MoeBank, spec: ExpertSpec, hidden: int, intermediate: int, device: torch.device
    ) -> PreparedBank:
        """Keep the bank as stored, build its pointer tables and hand them to
        :func:`quantpack_core.trellis_mma.prepare_bank` (buffers, one warm-up call).

        Returns:
            a :class:`PreparedBank` running ``quantpack::trellis_moe_`` (the inputs of
            :func:`quantpack_core.moe.grouped_inputs`).

        Raises:
            quantpack_core.trellis_mma.library.LibraryError: the kernels cannot be built or loaded, or the warm-up
                launch failed.
        """
        plan = bank.plan
        tensors, static = grouped_inputs(bank, plan.codebook.kernel_id, spec.layer_experts, device)
        # one pick per group's first slot: every group's gate/up and down instantiation is configured
        firsts = [plan.inv_perm[g.lo] for g in plan.groups]
        return trellis_mma.prepare_bank(
            tensors, static, bank.num_experts, plan.hidden, plan.intermediate, firsts, hidden, spec.act_dtype, device
        )
