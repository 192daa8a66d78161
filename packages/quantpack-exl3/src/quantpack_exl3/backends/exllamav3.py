"""The exllamav3 backend: exllamav3's own CUDA kernels (``exllamav3_ext``, sm_80 and newer).

Each shard keeps its trellis, suh and svh on the GPU exactly as the pack stores them. A forward runs
``quantpack::exl3_gemm_``, which follows exllamav3's ``LinearEXL3.forward`` policy: up to 144 rows the fused EXL3
GEMM (input Hadamard, trellis decode and matmul, output Hadamard in one kernel), above that the trellis is
reconstructed to a dense fp16 matrix and multiplied with cuBLAS between the two Hadamard transforms.

Choices, and why:

* Activations enter the kernels as fp16 (the kernels take nothing else). Outputs are accumulated into fp32 for
  bf16/fp32 models (fp16 for fp16 models) and written into the layer's output columns in the model dtype. A bf16
  model's activations beyond +-65504 would overflow in the cast; a warning says so once per process.
* ``EXL3_INT8_GEMV`` is pinned to ``0``: exllamav3's int8-activation GEMV (on by default for mul1 tensors on
  CUDA) changes the numerics (about 0.9% output RMS deviation in its default mode) and allocates on first use,
  which CUDA-graph capture forbids.
* ``EXL3_EXPANDABLE_SEGMENTS`` defaults to ``0`` before exllamav3 is imported, so importing it leaves the PyTorch
  allocator as vLLM configured it.
* The GEMM kernels pick their launch shape by timing candidates the first time a (rows bucket, k, n, K, codebook)
  combination runs; that must never happen during CUDA-graph capture. :func:`warm_up` runs every rows bucket of
  each new shape once at load, so capture only replays cached choices.

Source: exllamav3 1.6.5, ``exllamav3/modules/quant/exl3.py`` and ``exllamav3_ext/quant/exl3_gemm.cu``.
"""

from __future__ import annotations

import logging
import os

import torch

from quantpack_core.codebook import Codebook
from quantpack_core.codec import Exl3Tensors

from ..ops import exl3_gemm_
from .base import ShardKernel, dense_kernel

logger = logging.getLogger("vllm.quantpack.exl3")

#: rows up to which the fused EXL3 GEMM runs; above, reconstruct + cuBLAS (exllamav3's AUTO_RECONSTRUCT_THRESHOLD)
AUTO_RECONSTRUCT_THRESHOLD = 144
#: one row count per autotune bucket of exl3_gemm (rows <= 16 round up to a power of two, then 32, 48, 64),
#: plus one reconstruct-path call
WARMUP_ROWS = (1, 3, 5, 9, 17, 33, 49, AUTO_RECONSTRUCT_THRESHOLD + 1)
CODEBOOK_IDS = {Codebook.INST3: 0, Codebook.MCG: 1, Codebook.MUL1: 2}
FP16_MAX = 65504.0

INSTALL_HINT = (
    "install exllamav3 into this environment: `pip install exllamav3==1.6.5` (its CUDA extension is built on first "
    "import, which needs nvcc matching torch.version.cuda and takes ~5 minutes on 16 cores; set "
    "TORCH_CUDA_ARCH_LIST to your GPU, e.g. 9.0, to build only that), or a prebuilt wheel from exllamav3's "
    'releases matching `python -c "import torch; print(torch.__version__, torch.version.cuda)"`'
)

_ext = None
_warmed: set[tuple] = set()
_warned_bf16 = False


def load_extension():
    """Import ``exllamav3_ext`` once per process (after pinning the environment knobs above).

    Returns:
        the extension module.

    Raises:
        ImportError (or whatever the import raised): exllamav3 is missing or its extension cannot be built/loaded.
    """
    global _ext
    if _ext is None:
        previous = os.environ.get("EXL3_INT8_GEMV")
        if previous not in (None, "0"):
            logger.warning(
                "quantpack-exl3: EXL3_INT8_GEMV=%s overridden to 0 (see quantpack_exl3.backends.exllamav3)", previous
            )
        os.environ["EXL3_INT8_GEMV"] = "0"
        os.environ.setdefault("EXL3_EXPANDABLE_SEGMENTS", "0")
        from exllamav3.ext import exllamav3_ext

        _ext = exllamav3_ext
    return _ext


def run_exl3_gemm(
    x: torch.Tensor,
    trellis: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    codebook: int,
    k_bits: float,
    out_features: int,
    out: torch.Tensor,
    col: int,
) -> None:
    """The CUDA implementation of ``quantpack::exl3_gemm_`` (see :func:`quantpack_exl3.ops.exl3_gemm_`)."""
    ext = load_extension()
    rows, width = x.shape
    if rows == 0:
        return
    k, n = trellis.shape[0] * 16, trellis.shape[1] * 16
    mcg, mul1 = codebook == 1, codebook == 2
    if width == k:
        a = x.to(torch.float16).contiguous()
    else:  # a padded layer: zero-extend the input to the stored width
        a = torch.zeros((rows, k), dtype=torch.float16, device=x.device)
        a[:, :width].copy_(x)
    c_dtype = torch.float16 if out.dtype == torch.float16 else torch.float32
    if rows <= AUTO_RECONSTRUCT_THRESHOLD:
        target = out.narrow(1, col, out_features)
        direct = c_dtype == out.dtype and n == out_features and target.is_contiguous()
        c = target if direct else torch.empty((rows, n), dtype=c_dtype, device=x.device)
        ext.exl3_gemm(a, trellis, c, suh, torch.empty_like(a), svh, -1, mcg, mul1, 0)
        if direct:
            return
    else:
        ah = torch.empty_like(a)
        ext.had_r_128(a, ah, suh, None, 1.0)
        w = torch.empty((k, n), dtype=torch.float16, device=x.device)
        ext.reconstruct(w, trellis, float(k_bits), mcg, mul1)
        c = torch.empty((rows, n), dtype=c_dtype, device=x.device)
        ext.hgemm_recon(ah, w, c)
        ext.had_r_128(c, c, None, svh, 1.0)
    out.narrow(1, col, out_features).copy_(c.narrow(1, 0, out_features))


class Exllamav3Backend:
    """exllamav3's CUDA kernels; the trellis stays compressed on the GPU (memory = the pack's size)."""

    name = "exllamav3"

    @staticmethod
    def unavailable(device_type: str, capability: int | None = None) -> str | None:
        """Why this backend cannot run here, or None.

        Args:
            device_type: vLLM's ``current_platform.device_type``.
            capability: compute capability as ``major * 10 + minor`` (vLLM's ``to_int()``), if known.
        """
        if device_type != "cuda":
            return f"needs a CUDA device (this platform is {device_type or 'unspecified'!r})"
        if capability is not None and capability < 80:
            return f"needs compute capability 8.0 or newer (this GPU has {capability / 10:.1f})"
        try:
            load_extension()
        except Exception as e:
            return f"exllamav3's extension did not import ({type(e).__name__}: {e}); {INSTALL_HINT}"
        return None

    @staticmethod
    def prepare_shard(
        t: Exl3Tensors, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device
    ) -> ShardKernel:
        """Move one shard's tensors to the GPU and warm its kernels.

        Args:
            t: the shard's EXL3 tensors (validated; legacy sign vectors already unpacked).
            in_features, out_features: the layer's logical sizes for this shard (<= the stored, padded ones).
            dtype: the model dtype (output dtype of the layer).
            device: the GPU.

        Returns:
            a :class:`ShardKernel` running ``quantpack::exl3_gemm_``.
        """
        global _warned_bf16
        if dtype == torch.bfloat16 and not _warned_bf16:
            _warned_bf16 = True
            logger.warning(
                "quantpack-exl3: exllamav3's kernels take float16 activations; this bfloat16 model's "
                "activations are cast at every EXL3 layer, and values beyond +-%g would overflow. Serve "
                "with --dtype float16 to skip the cast.",
                FP16_MAX,
            )
        tensors = {
            "trellis": t.trellis.to(device).contiguous(),
            "suh": t.suh.to(device=device, dtype=torch.float16).contiguous(),
            "svh": t.svh.to(device=device, dtype=torch.float16).contiguous(),
        }
        static = (CODEBOOK_IDS[t.codebook], float(t.k_bits), out_features)
        kernel = ShardKernel(exl3_gemm_, tensors, out_features, static)
        warm_up(kernel, in_features, dtype)
        return kernel

    prepare_dense = staticmethod(dense_kernel)


def warm_up(kernel: ShardKernel, in_features: int, dtype: torch.dtype) -> None:
    """Run a new shard shape once per autotune bucket (and once through the reconstruct path), so that kernel
    selection, exllamav3's lazily allocated device buffers and cuBLAS setup all happen before any CUDA-graph
    capture. Shapes already warmed in this process are skipped."""
    tr = kernel.tensors["trellis"]
    codebook, _, out_features = kernel.static
    c_dtype = torch.float16 if dtype == torch.float16 else torch.float32
    key = (tuple(tr.shape), codebook, c_dtype, tr.device)
    if key in _warmed:
        return
    generator = torch.Generator(device=tr.device).manual_seed(0)
    for rows in WARMUP_ROWS:
        x = torch.randn((rows, in_features), generator=generator, device=tr.device).to(dtype)
        out = torch.empty((rows, out_features), dtype=dtype, device=tr.device)
        kernel.run(x, *kernel.tensors.values(), *kernel.static, out, 0)
    torch.cuda.synchronize(tr.device)
    _warmed.add(key)
