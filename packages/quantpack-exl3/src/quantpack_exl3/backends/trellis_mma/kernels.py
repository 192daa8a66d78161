"""The trellis_mma kernels: the project's own CUDA kernels for EXL3 linear shards (sm_80 and newer, tuned on an H200).

Each lane of a warp decodes 8 weights of a 16x16 trellis tile straight into its tensor-core (``mma.m16n8k16``) B
fragment, so a tile is read and decoded once for up to 64 rows and the decoded weights never leave registers; k is
split over CTAs until the GPU is full, and the input / output Hadamard transforms run inside the same launch for up
to 16 rows (the decode case), for all shards of a layer that share its input in one launch (:meth:`fuse`).
``csrc/trellis_mma.cu`` describes the kernels; :mod:`.library` builds them with nvcc
(once per GPU architecture, cached) and loads them with ctypes. The trellis stays as the pack stores it (memory = the
pack's size). Every K (1..8, 1.5 / 2.5 / 3.5 with mul1) and codebook; float16 and bfloat16 models (the activations
are rounded to fp16 after the input transform, which keeps bf16 models' range in the kernels' own calls; float32
models go to exllamav3). Calls of more than 16 rows go to exllamav3's kernels when they import (:mod:`.ops`).

Source: docs/exl3-format.md ("The math", tile placement), docs/kernels.md (how the kernels were measured).
"""

from __future__ import annotations

import logging

import torch

from quantpack_core.codec import Codebook, Exl3Tensors
from quantpack_core.kernels import LinearKernel, LinearSpec, Platform, PreparedShard

from .library import compiler_reason
from .ops import FUSED_ROWS, MAX_SHARDS, delegated_above, reserve, trellis_mma_, trellis_mma_shards_

NAME = "trellis_mma"
#: mma.sync m16n8k16, ldmatrix and cp.async need sm_80
MIN_CAPABILITY = 80
CODEBOOK_IDS = {Codebook.INST3: 0, Codebook.MCG: 1, Codebook.MUL1: 2}
ACT_DTYPES = (torch.float16, torch.bfloat16)

_warmed: set[tuple] = set()
_warned_bf16 = False
logger = logging.getLogger("vllm.quantpack.exl3")


class TrellisMmaLinearKernel(LinearKernel):
    """One EXL3 shard through the trellis_mma kernels (see the module)."""

    name = NAME

    @classmethod
    def available(cls, platform: Platform) -> tuple[bool, str | None]:
        """CUDA sm_80+, a device torch sees, and a compiler for the kernels (:func:`.library.compiler_reason`);
        neither initializes CUDA nor builds here (vLLM asks this in its front-end process): the build runs at the
        first shard's ``prepare``."""
        why = platform.cuda_reason(MIN_CAPABILITY)
        if why is not None:
            return False, why
        if not torch.cuda.is_available():  # counts devices without creating a CUDA context
            return False, "needs a CUDA device that torch can see (torch.cuda.is_available() is False here)"
        why = compiler_reason()
        if why is not None:
            return False, f"its kernels cannot be built here: {why}"
        return True, None

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str | None]:
        """Every EXL3 shard of a float16 / bfloat16 model on CUDA sm_80+."""
        if spec.format != "exl3":
            return False, f"runs EXL3 only, this is {spec.format}"
        why = spec.platform.cuda_reason(MIN_CAPABILITY)
        if why is not None:
            return False, why
        if spec.act_dtype not in ACT_DTYPES:
            return False, f"takes float16 / bfloat16 models, not {spec.act_dtype}"
        return True, None

    @classmethod
    def prepare(cls, shard: Exl3Tensors, spec: LinearSpec, device: torch.device) -> PreparedShard:
        """Move the shard's tensors to the GPU, reserve the GPU's workspace for its width and run both launch kinds
        once (:func:`warm_up`).

        Returns:
            a :class:`PreparedShard` running ``quantpack::trellis_mma_`` with static ``(codebook id, K,
            out_features)``.

        Raises:
            quantpack_exl3.backends.trellis_mma.library.LibraryError: the kernels cannot be built or loaded, or a
                warm-up launch failed (the message names the fix).
        """
        global _warned_bf16
        t = shard
        tensors = {
            "trellis": t.trellis.to(device).contiguous(),
            "suh": t.suh.to(device=device, dtype=torch.float16).contiguous(),
            "svh": t.svh.to(device=device, dtype=torch.float16).contiguous(),
        }
        reserve(device, tensors["trellis"].shape[0] * 16)
        above = delegated_above(device)
        if spec.act_dtype == torch.bfloat16 and above is not None and not _warned_bf16:
            _warned_bf16 = True
            logger.warning(
                "quantpack-exl3: calls of more than %d rows go to exllamav3's kernels, which take float16 "
                "activations: this bfloat16 model's activations are cast there, and values beyond +-65504 would "
                "overflow. Serve with --dtype float16, or set QUANTPACK_TRELLIS_MMA_DELEGATE_ROWS=0 to keep every "
                "call in trellis_mma.",
                above,
            )
        static = (CODEBOOK_IDS[t.codebook], float(t.k_bits), spec.out_features)
        prepared = PreparedShard(trellis_mma_, tensors, spec.out_features, static)
        warm_up(prepared, spec.in_features, spec.act_dtype)
        return prepared

    @classmethod
    def fuse(cls, shards: list[PreparedShard]) -> PreparedShard | None:
        """One run for a layer's shards that share its input (q / k / v, gate / up): up to 16 rows one launch runs
        them all from a table of shards (:func:`.ops.trellis_mma_shards_`; above, one launch per shard as before).
        The shards keep their own tensors (no copy).

        Returns:
            the fused run (``out_features`` the shards' sum), or None when the shards differ in codebook, K or
            stored input width (one kernel instantiation runs a launch), or are more than :data:`.ops.MAX_SHARDS`.
        """
        if not 1 < len(shards) <= MAX_SHARDS or any(s.run is not trellis_mma_ for s in shards):
            return None
        codebook, k_bits, _ = shards[0].static
        width = shards[0].tensors["trellis"].shape[0]
        if any(s.static[:2] != (codebook, k_bits) or s.tensors["trellis"].shape[0] != width for s in shards):
            return None
        tensors = {f"{name}{i}": s.tensors[name] for i, s in enumerate(shards) for name in ("trellis", "suh", "svh")}
        outs = tuple(s.out_features for s in shards)
        return PreparedShard(trellis_mma_shards_, tensors, sum(outs), (codebook, k_bits, outs))


def warm_up(prepared: PreparedShard, in_features: int, dtype: torch.dtype) -> None:
    """Run a new shard shape once at load with the fused kernel (1 row) and the unfused one (17 rows), so that their
    shared-memory limits are set before any CUDA-graph capture; and, when calls above
    :data:`.ops.delegate_rows` rows go to exllamav3, once per exllamav3 autotune bucket above that (its
    kernels time their launch shapes on a shape's first call, which must not happen during capture). Shapes
    already warmed in this process are skipped."""
    tr = prepared.tensors["trellis"]
    codebook, _, out_features = prepared.static
    key = (tuple(tr.shape), codebook, dtype, tr.device)
    if key in _warmed:
        return
    rows_list = [1, FUSED_ROWS + 1]
    above = delegated_above(tr.device)
    if above is not None:
        from ..exllamav3.kernels import WARMUP_ROWS

        rows_list += [r for r in WARMUP_ROWS if r > above]
    generator = torch.Generator(device=tr.device).manual_seed(0)
    for rows in rows_list:
        x = torch.randn((rows, in_features), generator=generator, device=tr.device).to(dtype)
        out = torch.empty((rows, out_features), dtype=dtype, device=tr.device)
        prepared.run(x, *prepared.tensors.values(), *prepared.static, out, 0)
    torch.cuda.synchronize(tr.device)
    _warmed.add(key)
