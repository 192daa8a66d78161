"""The exllamav3 kernels: exllamav3's own CUDA kernels (``exllamav3_ext``, sm_80 and newer) for EXL3 linear shards
and expert banks. The trellis stays compressed on the GPU (memory = the pack's size).

* Linear shards keep their trellis, suh and svh as the pack stores them and run ``quantpack::exl3_gemm_``
  (:mod:`.gemm`). A bf16 model's activations beyond +-65504 would overflow in the kernels' fp16 input; a warning
  says so once per process.
* Expert banks keep the bank as stored, with its permutation and ``(9, E)`` device pointer table, and run
  ``quantpack::exl3_moe_`` (:mod:`.moe`).
* The GEMM kernels pick their launch shape by timing candidates the first time a (rows bucket, k, n, K, codebook)
  combination runs; that must never happen during CUDA-graph capture. :func:`warm_up` runs every rows bucket of
  each new shape once at load, so capture only replays cached choices.

CUDA only: ROCm is not offered (exllamav3 1.6.5's extension is built and tested for CUDA; vLLM's ROCm platform is
kept apart in :class:`~quantpack_core.kernels.Platform`, so a ROCm machine never picks it). Source: exllamav3 1.6.5,
``exllamav3/modules/quant/exl3.py``, ``exllamav3/modules/multilinear.py``, ``exllamav3_ext/quant/exl3_gemm.cu``.
"""

from __future__ import annotations

import logging

import torch

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

from .extension import INSTALL_HINT, load_extension
from .gemm import AUTO_RECONSTRUCT_THRESHOLD
from .ops import exl3_gemm_, exl3_moe_

logger = logging.getLogger("vllm.quantpack.exl3")

NAME = "exllamav3"
#: the oldest GPU exllamav3's kernels run on (compute capability as major * 10 + minor)
MIN_CAPABILITY = 80
#: one row count per autotune bucket of exl3_gemm (rows <= 16 round up to a power of two, then 32, 48, 64),
#: plus one reconstruct-path call
WARMUP_ROWS = (1, 3, 5, 9, 17, 33, 49, AUTO_RECONSTRUCT_THRESHOLD + 1)
#: model dtypes the kernels take (activations are cast to fp16 inside the op)
ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP16_MAX = 65504.0

_warmed: set[tuple] = set()
_warned_bf16 = False


def _available(platform: Platform) -> tuple[bool, str | None]:
    why = platform.cuda_reason(MIN_CAPABILITY)
    if why is not None:
        return False, why
    try:
        load_extension()
    except Exception as e:
        return False, f"exllamav3's extension did not import ({type(e).__name__}: {e}); {INSTALL_HINT}"
    return True, None


def _supported(spec) -> tuple[bool, str | None]:
    """The static rules both kernels share: EXL3, CUDA sm_80+, a model dtype the op casts from."""
    if spec.format != "exl3":
        return False, f"runs EXL3 only, this is {spec.format}"
    why = spec.platform.cuda_reason(MIN_CAPABILITY)
    if why is not None:
        return False, why
    if spec.act_dtype not in ACT_DTYPES:
        return False, f"takes float16 / bfloat16 / float32 models, not {spec.act_dtype}"
    return True, None


class Exllamav3LinearKernel(LinearKernel):
    """One EXL3 shard through exllamav3's GEMM: every K (1..8, 1.5 / 2.5 / 3.5 with mul1), every codebook, every
    stored shape (multiples of 128) on CUDA sm_80+."""

    name = NAME

    @classmethod
    def available(cls, platform: Platform) -> tuple[bool, str | None]:
        """CUDA sm_80+ with exllamav3's extension importable (imported here, once per process)."""
        return _available(platform)

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str | None]:
        """Every EXL3 shard on CUDA sm_80+ (see the class)."""
        return _supported(spec)

    @classmethod
    def prepare(cls, shard: Exl3Tensors, spec: LinearSpec, device: torch.device) -> PreparedShard:
        """Move the shard's tensors to the GPU and warm its kernels (:func:`warm_up`).

        Returns:
            a :class:`PreparedShard` running ``quantpack::exl3_gemm_`` with static ``(codebook id, K,
            out_features)``.
        """
        global _warned_bf16
        if spec.act_dtype == torch.bfloat16 and not _warned_bf16:
            _warned_bf16 = True
            logger.warning(
                "quantpack-exl3: exllamav3's kernels take float16 activations; this bfloat16 model's "
                "activations are cast at every EXL3 layer, and values beyond +-%g would overflow. Serve "
                "with --dtype float16 to skip the cast.",
                FP16_MAX,
            )
        t = shard
        tensors = {
            "trellis": t.trellis.to(device).contiguous(),
            "suh": t.suh.to(device=device, dtype=torch.float16).contiguous(),
            "svh": t.svh.to(device=device, dtype=torch.float16).contiguous(),
        }
        static = (t.codebook.kernel_id, float(t.k_bits), spec.out_features)
        prepared = PreparedShard(exl3_gemm_, tensors, spec.out_features, static)
        warm_up(prepared, spec.in_features, spec.act_dtype)
        return prepared


def warm_up(prepared: PreparedShard, in_features: int, dtype: torch.dtype) -> None:
    """Run a new shard shape once per autotune bucket (and once through the reconstruct path), so that kernel
    selection, exllamav3's lazily allocated device buffers and cuBLAS setup all happen before any CUDA-graph
    capture. Shapes already warmed in this process are skipped."""
    tr = prepared.tensors["trellis"]
    codebook, _, out_features = prepared.static
    c_dtype = torch.float16 if dtype == torch.float16 else torch.float32
    key = (tuple(tr.shape), codebook, c_dtype, tr.device)
    if key in _warmed:
        return
    generator = torch.Generator(device=tr.device).manual_seed(0)
    for rows in WARMUP_ROWS:
        x = torch.randn((rows, in_features), generator=generator, device=tr.device).to(dtype)
        out = torch.empty((rows, out_features), dtype=dtype, device=tr.device)
        prepared.run(x, *prepared.tensors.values(), *prepared.static, out, 0)
    torch.cuda.synchronize(tr.device)
    _warmed.add(key)


class Exllamav3ExpertKernel(ExpertKernel):
    """An EXL3 expert bank through exllamav3's ``exl3_mgemm``: any K groups, one codebook, on CUDA sm_80+."""

    name = NAME

    @classmethod
    def available(cls, platform: Platform) -> tuple[bool, str | None]:
        """CUDA sm_80+ with exllamav3's extension importable."""
        return _available(platform)

    @classmethod
    def can_implement(cls, spec: ExpertSpec) -> tuple[bool, str | None]:
        """Every EXL3 bank on CUDA sm_80+."""
        return _supported(spec)

    @classmethod
    def prepare(
        cls, bank: Exl3MoeBank, spec: ExpertSpec, hidden: int, intermediate: int, device: torch.device
    ) -> PreparedBank:
        """Keep a loaded bank on the GPU as it is and build its pointer tables for ``quantpack::exl3_moe_``.

        Args:
            bank: the layer's loaded bank on ``device``.
            spec: its spec; hidden, intermediate: the layer's logical sizes (the bank's are padded to 128; the op
                pads the input and trims the output).
            device: the GPU.

        Returns:
            a :class:`PreparedBank`: the op reads the permutation (``(E + 1,)``, last -1), the ``(9, E)`` pointer
            table and the bank tensors.

        Source: docs/moe-bank.md ("Pointer tables"); exllamav3 ``MultiLinear`` (``ptrs_trellis`` / ``ptrs_suh`` /
        ``ptrs_svh``).
        """
        tensors, static = grouped_inputs(bank, bank.plan.codebook.kernel_id, spec.layer_experts, device)
        return PreparedBank(exl3_moe_, tensors, static)
