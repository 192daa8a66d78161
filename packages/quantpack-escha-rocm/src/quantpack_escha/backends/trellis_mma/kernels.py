"""escha shards through the project's ``trellis_mma`` kernels (``quantpack_core.trellis_mma``), on CUDA sm_80+.

An escha code is an EXL3 trellis in the mcg codebook (docs/escha-format.md), and the two formats differ only in their
scales and Hadamard gains: escha computes ``H(H((x * s_in) * rin) @ What) * rout * s_out`` with the unnormalized
128-point Hadamard ``H``, EXL3 ``Hn(Hn(x * suh) @ What) * svh`` with ``Hn = H / sqrt(128)``. So an escha shard is the
EXL3 shard of the same trellis with ``suh = a / alpha`` and ``svh = 128 * b * alpha`` (``a = s_in * rin``,
``b = rout * s_out``, ``alpha`` a power of two, which scales exactly: :func:`exl3_shard`), and the trellis_mma kernels
run it from that trellis, the mcg codebook, K and those scales (their fused launches included; every row count in
trellis_mma's own launches: escha gives no other implementation to hand row buckets to).
trellis_mma keeps ``suh`` / ``svh`` in float16, as EXL3 stores them: the one rounding this path adds over the Triton
kernel, which keeps ``a`` and ``b`` in float32, is that of the two products to float16 (relative 2^-11 at most).

The kernels are quantpack-core's (built by nvcc at first use): where they cannot run (no nvcc, no CUDA device)
this backend is unavailable and the Triton kernel serves CUDA (the reason is logged with the kernel table). Float32
models go to the Triton kernel too (:meth:`can_implement` declines them); a shard whose scales float16 cannot hold is
refused at load, naming the layer, the shard and ``QUANTPACK_ESCHA_BACKEND=triton``.
"""

from __future__ import annotations

import math

import torch

from quantpack_core import trellis_mma
from quantpack_core.codec import Codebook, Exl3Tensors
from quantpack_core.errors import LayerLoadError
from quantpack_core.kernels import LinearKernel, LinearSpec, Platform, PreparedShard
from quantpack_core.trellis_mma.library import add_fallback

from ...codec import HAD_GAIN, EschaTensors

NAME = trellis_mma.NAME
#: float16's smallest normal and largest finite magnitudes: ``suh`` / ``svh`` entries outside them would lose bits
FP16_TINY, FP16_MAX = 2.0**-14, 65504.0
#: ``suh`` peaks at 1 as EXL3's do; up to this peak where ``svh`` would otherwise leave float16's normal range (the
#: kernels' float16 transformed input grows with it)
SUH_PEAK = 16.0

add_fallback("QUANTPACK_ESCHA_BACKEND=triton")


def exl3_shard(shard: EschaTensors, where: str = "escha shard") -> Exl3Tensors:
    """The EXL3 shard (mcg, float16 ``suh`` / ``svh``) that computes what the escha shard does (see the module).

    ``alpha`` is the power of two that makes ``suh`` peak at 1 in magnitude (EXL3's convention), or the nearest to
    it, up to a peak of :data:`SUH_PEAK`, that keeps every nonzero entry of both vectors in float16's normal range.
    Where either side is all zero, so is the shard's output: both vectors are zero then.

    Args:
        shard: the escha tensors of one shard (any device).
        where: the layer and shard, for the error.

    Returns:
        :class:`~quantpack_core.codec.Exl3Tensors` sharing ``shard.code`` as its trellis.

    Raises:
        LayerLoadError: ``a = s_in * rin`` or ``128 * b`` does not fit float16 that way (their entries span too
            many magnitudes, or ``b`` is too large or small for ``a``); the message names the shard and the fix
            (``QUANTPACK_ESCHA_BACKEND=triton`` keeps both in float32).
    """
    a = shard.input_scale(torch.float64)
    b = shard.output_scale(torch.float64) * (HAD_GAIN * HAD_GAIN)
    a_nz, b_nz = a.abs()[a != 0], b.abs()[b != 0]
    if not a_nz.numel() or not b_nz.numel():  # an all-zero side: the shard computes zero
        zero = torch.zeros_like
        return Exl3Tensors(shard.code, zero(a, dtype=torch.float16), zero(b, dtype=torch.float16), Codebook.MCG)
    a_min, a_max, b_min, b_max = (float(v) for v in (a_nz.min(), a_nz.max(), b_nz.min(), b_nz.max()))
    # alpha = 2^e: a / alpha within [FP16_TINY, SUH_PEAK] and b * alpha within [FP16_TINY, FP16_MAX] for e in [lo, hi]
    lo = math.ceil(max(math.log2(a_max / SUH_PEAK), math.log2(FP16_TINY / b_min)))
    hi = math.floor(min(math.log2(a_min / FP16_TINY), math.log2(FP16_MAX / b_max)))
    if lo > hi:
        raise LayerLoadError(
            f"{where}: its input scales s_in * rin span {a_min:.3g} to {a_max:.3g} and its output scales "
            f"128 * rout * s_out {b_min:.3g} to {b_max:.3g}: no power of two moves both into float16's "
            f"{FP16_TINY:.3g} to {FP16_MAX:g} (the input side at most {SUH_PEAK:g}), which the trellis_mma kernels "
            "keep these scales in - set QUANTPACK_ESCHA_BACKEND=triton to serve the pack with the Triton kernel, "
            "which keeps them in float32"
        )
    alpha = 2.0 ** min(max(math.ceil(math.log2(a_max)), lo), hi)  # suh peaking at 1 where that fits
    return Exl3Tensors(shard.code, (a / alpha).to(torch.float16), (b * alpha).to(torch.float16), Codebook.MCG)


class EschaTrellisMmaLinearKernel(LinearKernel):
    """One escha shard through the trellis_mma kernels (see the module)."""

    name = NAME

    @classmethod
    def available(cls, platform: Platform) -> tuple[bool, str | None]:
        """The trellis_mma kernels can run on ``platform``: CUDA sm_80+, a device torch sees, nvcc
        (:func:`quantpack_core.trellis_mma.available`)."""
        return trellis_mma.available(platform)

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str | None]:
        """Every escha shard of a float16 / bfloat16 model on CUDA sm_80+."""
        if spec.format != "escha":
            return False, f"runs escha only, this is {spec.format}"
        why = trellis_mma.unsupported(spec.platform, spec.act_dtype)
        return why is None, why

    @classmethod
    def prepare(cls, shard: EschaTensors, spec: LinearSpec, device: torch.device) -> PreparedShard:
        """The shard's trellis, mcg, K and the scales of :func:`exl3_shard`, prepared by trellis_mma (its workspace
        and warm-up).

        Raises:
            LayerLoadError: scales float16 cannot hold (:func:`exl3_shard`).
            quantpack_core.trellis_mma.library.LibraryError: the kernels cannot be built or loaded.
        """
        t = exl3_shard(shard, spec.describe())
        return trellis_mma.prepare_shard(
            t.trellis, t.suh, t.svh, Codebook.MCG.kernel_id, float(t.k_bits), spec.out_features, spec.act_dtype,
            device, max_rows=spec.max_rows,
        )  # fmt: skip

    @classmethod
    def fuse(cls, shards: list[PreparedShard]) -> PreparedShard | None:
        """trellis_mma's one launch for a layer's shards that share the input (q / k / v, gate / up)."""
        return trellis_mma.fuse_shards(shards)
