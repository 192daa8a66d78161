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
from quantpack_core.moe import BANK_TENSORS, Exl3MoeBank, bank_layout
from quantpack_core.trellis import width_from_k

from ..ops import exl3_gemm_, exl3_moe_
from .base import MoeRun, ShardKernel, dense_kernel

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

    @staticmethod
    def prepare_moe(bank, hidden: int, inter: int, dtype: torch.dtype, device: torch.device) -> MoeRun:
        """See :func:`prepare_moe`."""
        return prepare_moe(bank, hidden, inter, dtype, device)


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


# ------------------------------------------------------------------------------------------------------ MoE

#: above this many slots, and outside CUDA-graph capture, experts run one by one over their gathered tokens (each
#: expert decoded once per call) instead of once per slot
GROUPED_MIN_SLOTS = 1024


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(torch.float16)


def _moe_slots(xh, ids, weights, tables, mcg, mul1, groups, inter, acc) -> None:
    """Per-slot path: every (token, expert) pick is one matrix of a batched exl3_mgemm (graph-safe, no host sync)."""
    ext = load_extension()
    tokens, top_k = ids.shape
    hidden = xh.shape[1]
    slots = tokens * top_k
    a = xh.repeat_interleave(top_k, dim=0).unsqueeze(1)  # (S, 1, H): slot j reads its token's row
    flat_ids = ids.reshape(1, -1)
    w = weights.reshape(1, -1)
    ah_in = torch.empty((slots, 1, hidden), dtype=torch.float16, device=xh.device)
    ah_mid = torch.empty((slots, 1, inter), dtype=torch.float16, device=xh.device)
    g = torch.empty((slots, 1, inter), dtype=torch.float16, device=xh.device)
    u = torch.empty_like(g)
    c = torch.empty((slots, 1, hidden), dtype=torch.float32, device=xh.device)
    for lo, hi, k_gu, k_d in groups:
        tab = tables[:, lo:hi]
        if len(groups) == 1:
            idx = flat_ids
        else:
            # the group's slots index its own table slice; every other slot gets -1, which the kernel skips (no
            # product, and left out of the weighted sum of its token; a token whose slots are all -1 gets a zero
            # row of c: test_exl3_gpu_moe.py's absent-expert cases check both on exllamav3 1.6.5)
            idx = torch.where((flat_ids >= lo) & (flat_ids < hi), flat_ids - lo, -1)
        ext.exl3_mgemm(a, tab[0], g, tab[1], ah_in, tab[2], idx, None, k_gu, -1, mcg, mul1, -1, -1, 0, 1)
        ext.exl3_mgemm(a, tab[3], u, tab[4], ah_in, tab[5], idx, None, k_gu, -1, mcg, mul1, -1, -1, 0, 1)
        # down: each slot scaled by its routing weight, and each token's k slots summed into row t of c
        ext.exl3_mgemm(
            _silu_mul(g, u), tab[6], c, tab[7], ah_mid, tab[8], idx, w, k_d, -1, mcg, mul1, -1, -1, 0, tokens
        )
        acc += c[:tokens, 0]


def _slot_tensors(bank: dict[str, torch.Tensor], groups, hidden: int, inter: int):
    """Per physical slot: ``(gate, up, down, k_gu, k_d)`` with each projection as ``(trellis, suh, svh)`` views of
    the bank, at the offsets :func:`quantpack_core.moe.bank_layout` gives the plan."""
    slot_bits = [(k_gu, k_d) for lo, hi, k_gu, k_d in groups for _ in range(lo, hi)]
    words13, words2, off1, off3, off2 = bank_layout(slot_bits, hidden, inter)
    t13, t2 = bank["w13_trellis"], bank["w2_trellis"]
    out = []
    for slot, (k_gu, k_d) in enumerate(slot_bits):
        gu_shape = (hidden // 16, inter // 16, width_from_k(k_gu))
        w1 = t13[off1[slot] : off1[slot] + words13[slot]].view(gu_shape)
        w3 = t13[off3[slot] : off3[slot] + words13[slot]].view(gu_shape)
        gate = (w1, bank["w13_suh"][slot, 0], bank["w13_svh"][slot, 0])
        up = (w3, bank["w13_suh"][slot, 1], bank["w13_svh"][slot, 1])
        down_trellis = t2[off2[slot] : off2[slot] + words2[slot]].view(inter // 16, hidden // 16, width_from_k(k_d))
        down = (down_trellis, bank["w2_suh"][slot], bank["w2_svh"][slot])
        out.append((gate, up, down, k_gu, k_d))
    return out


def _moe_grouped(xh, ids, weights, slot_tensors, codebook: int, inter: int, acc) -> None:
    """Per-expert path for large batches outside graph capture: gather each expert's tokens, three GEMMs each."""
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # picks of -1 (experts of other ranks) sort first and are skipped
    counts = torch.bincount(flat + 1, minlength=len(slot_tensors) + 1).tolist()  # the one host sync of this path
    tok_sorted = order // top_k
    w_sorted = weights.reshape(-1)[order].float()
    hidden = acc.shape[1]
    start = counts[0]
    for slot, count in enumerate(counts[1:]):
        if count == 0:
            continue
        tok = tok_sorted[start : start + count]
        rows = xh.index_select(0, tok)
        gate, up, down, k_gu, k_d = slot_tensors[slot]
        g = torch.empty((count, inter), dtype=torch.float16, device=xh.device)
        u = torch.empty_like(g)
        run_exl3_gemm(rows, *gate, codebook, k_gu, inter, g, 0)
        run_exl3_gemm(rows, *up, codebook, k_gu, inter, u, 0)
        y = torch.empty((count, hidden), dtype=torch.float32, device=xh.device)
        run_exl3_gemm(_silu_mul(g, u), *down, codebook, k_d, hidden, y, 0)
        acc.index_add_(0, tok, y * w_sorted[start : start + count, None])
        start += count


def run_exl3_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    perm: torch.Tensor,
    tables: torch.Tensor,
    bank: dict[str, torch.Tensor],
    codebook: int,
    group_lo: list[int],
    group_hi: list[int],
    k_gu: list[float],
    k_d: list[float],
    out: torch.Tensor,
) -> None:
    """The CUDA implementation of ``quantpack::exl3_moe_`` (see :func:`quantpack_exl3.ops.exl3_moe_`).

    Up to :data:`GROUPED_MIN_SLOTS` slots (``T * top_k``), and always during CUDA-graph capture, each slot is one
    matrix of ``exl3_mgemm``: per K group, a gate launch and an up launch (fp16 outputs), SiLU(gate) * up, and a down
    launch whose kernel weights each slot by its routing weight and sums each token's slots (fp32). A bank of several
    K groups runs each group over all slots, with the expert index of every slot outside the group set to -1 (the
    kernel skips such slots; the kernel's own index-range filter is not used). Shapes depend only on ``T``: nothing
    is synchronized with the host. Larger eager batches run expert by expert over the expert's gathered tokens (one
    host sync for the counts), so each expert is decoded once per call. A pick of id -1 (an expert another
    tensor-parallel rank holds) maps through ``perm``'s last entry to slot -1 and is skipped on both paths.
    """
    tokens = x.shape[0]
    if tokens == 0:
        return
    groups = list(zip(group_lo, group_hi, k_gu, k_d, strict=True))
    hidden = out.shape[1]
    hidden_stored = bank["w13_suh"].shape[2]
    inter = bank["w2_suh"].shape[1]
    # ids are >= 0 or -1 (the method's expert-split map emits no other negative): -1 indexes perm's trailing -1
    ids = perm[topk_ids.long()]
    weights = topk_weights.to(torch.float16)
    xh = x.to(torch.float16)
    if hidden_stored != hidden:  # a padded layer: zero-extend the input to the stored width
        xh = torch.nn.functional.pad(xh, (0, hidden_stored - hidden))
    acc = torch.zeros((tokens, hidden_stored), dtype=torch.float32, device=x.device)
    if ids.numel() > GROUPED_MIN_SLOTS and not torch.cuda.is_current_stream_capturing():
        _moe_grouped(xh, ids, weights, _slot_tensors(bank, groups, hidden_stored, inter), codebook, inter, acc)
    else:
        _moe_slots(xh, ids, weights, tables, int(codebook == 1), int(codebook == 2), groups, inter, acc)
    out.copy_(acc[:, :hidden])


def prepare_moe(bank: Exl3MoeBank, hidden: int, inter: int, dtype: torch.dtype, device: torch.device) -> MoeRun:
    """Keep a loaded bank on the GPU as it is and build its pointer tables for ``quantpack::exl3_moe_``.

    Args:
        bank: the layer's loaded :class:`~quantpack_core.moe.Exl3MoeBank` on ``device``.
        hidden, inter: the layer's logical sizes (the bank's are padded to 128; the op pads the input and trims
            the output).
        dtype: the model dtype; device: the GPU.

    Returns:
        a :class:`MoeRun`: the op reads the permutation (``(E + 1,)``, last -1), the ``(9, E)`` pointer table and
        the bank tensors.

    Source: seed 001 (``Exl3Bank.tables``); exllamav3 ``MultiLinear`` (``ptrs_trellis`` / ``ptrs_suh`` / ``ptrs_svh``).
    """
    plan = bank.plan
    t = bank.pointer_tables()
    tables = torch.stack([getattr(p, f) for p in (t.gate, t.up, t.down) for f in ("trellis", "suh", "svh")]).to(device)
    # a trailing -1: the op's id -1 (an expert of another tensor-parallel rank) indexes it and stays -1
    perm = torch.tensor([*plan.perm, -1], dtype=torch.int64, device=device)
    static = (
        CODEBOOK_IDS[plan.codebook],
        [g.lo for g in plan.groups],
        [g.hi for g in plan.groups],
        [float(g.k_gu) for g in plan.groups],
        [float(g.k_d) for g in plan.groups],
    )
    tensors = {"perm": perm, "tables": tables, **{n: bank.tensors[n] for n in BANK_TENSORS}}
    return MoeRun(exl3_moe_, tensors, static)
