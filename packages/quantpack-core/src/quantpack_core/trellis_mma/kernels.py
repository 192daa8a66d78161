"""What a format's trellis_mma adapter kernel calls: whether the kernels can run here, and the preparation of a shard,
of a layer's fused shards and of an expert bank, from trellis tiles, codebook id, K and scales (no format's types).

Each lane of a warp decodes 8 weights of a 16x16 trellis tile straight into its tensor-core (``mma.m16n8k16``) B
fragment, so a tile is read and decoded once for up to 64 rows and the decoded weights never leave registers; k is
split over CTAs until the GPU is full, and the input / output Hadamard transforms run inside the same launch for up
to 16 rows (the decode case), for all shards of a layer that share its input in one launch (:func:`fuse_shards`).
``csrc/`` describes the kernels; :mod:`.library` builds them with nvcc (once per GPU architecture, cached) and loads
them with ctypes. The trellis stays as stored (memory = the pack's size). Every K (1..8, 1.5 / 2.5 / 3.5 with mul1)
and codebook; float16 and bfloat16 models (the activations are rounded to fp16 after the input transform, which
keeps bf16 models' range in the kernels' own calls).

Source: docs/kernels.md (how the kernels were measured).
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from quantpack_core.kernels import Platform, PreparedBank, PreparedShard

from .library import compiler_reason
from .moe import reserve_moe, trellis_moe_
from .ops import MAX_SHARDS, reserve, trellis_mma_, trellis_mma_shards_
from .selection import Delegate, dense_may_serve, measure_bucket_kernels

NAME = "trellis_mma"
#: mma.sync m16n8k16, ldmatrix and cp.async need sm_80
MIN_CAPABILITY = 80
ACT_DTYPES = (torch.float16, torch.bfloat16)

#: a prepared shard's trellis tensor -> its model's activation dtype, for fuse_shards(), which sees only prepared
#: shards (keyed by identity: a tensor's == is elementwise)
_act_dtypes = WeakIdKeyDictionary()


def available(platform: Platform) -> tuple[bool, str | None]:
    """CUDA sm_80+, a device torch sees, and a compiler for the kernels (:func:`.library.compiler_reason`); neither
    initializes CUDA nor builds here (vLLM asks this in its front-end process): the build runs at the first
    shard's preparation."""
    why = platform.cuda_reason(MIN_CAPABILITY)
    if why is not None:
        return False, why
    if not torch.cuda.is_available():  # counts devices without creating a CUDA context
        return False, "needs a CUDA device that torch can see (torch.cuda.is_available() is False here)"
    why = compiler_reason()
    if why is not None:
        return False, f"its kernels cannot be built here: {why}"
    return True, None


def unsupported(platform: Platform, act_dtype: torch.dtype) -> str | None:
    """Why the kernels take no shard or bank of a model of ``act_dtype`` on ``platform`` (not CUDA sm_80+, not a
    float16 / bfloat16 model), or None."""
    why = platform.cuda_reason(MIN_CAPABILITY)
    if why is not None:
        return why
    if act_dtype not in ACT_DTYPES:
        return f"takes float16 / bfloat16 models, not {act_dtype}"
    return None


def prepare_shard(
    trellis: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    codebook: int,
    k_bits: float,
    out_features: int,
    act_dtype: torch.dtype,
    device: torch.device,
    delegate: Delegate | None = None,
    max_rows: int | None = None,
) -> PreparedShard:
    """Move one shard's tensors to the GPU, reserve the GPU's workspace for its width, warm every launch kind and
    choose the kernel of each of the shard's row buckets (:func:`.selection.measure_bucket_kernels`).

    Args:
        trellis: int16 ``(k/16, n/16, 16*K)`` trellis tiles.
        suh, svh: the input and output scales, ``(k,)`` and ``(n,)`` (kept in float16).
        codebook: 0 = 3INST, 1 = mcg, 2 = mul1.
        k_bits: bits per weight K.
        out_features: logical output width (<= n).
        act_dtype: the model's activation dtype (float16 or bfloat16).
        delegate: another implementation of the call, which the row buckets where it is faster go to, or None.
        max_rows: the most rows one call takes (a serving engine's token budget; None: unknown): row buckets above
            it are not measured, and the dense route's buffer is held only where a call reaches a bucket it may serve
            (:func:`.selection.dense_may_serve`).

    Returns:
        a :class:`PreparedShard` running ``quantpack::trellis_mma_`` with static ``(codebook id, K, out_features,
        bucket_kernels)``.

    Raises:
        quantpack_core.trellis_mma.library.LibraryError: the kernels cannot be built or loaded, or a warm-up launch
            failed (the message names the fix).
    """
    tensors = {
        "trellis": trellis.to(device).contiguous(),
        "suh": suh.to(device=device, dtype=torch.float16).contiguous(),
        "svh": svh.to(device=device, dtype=torch.float16).contiguous(),
    }
    ws = reserve(device, tensors["trellis"].shape[0] * 16, None if delegate is None else delegate.gemm)
    ws.allow_rows(max_rows)
    if dense_may_serve(delegate, ws.max_rows):  # the route's memory only where it may serve a call
        ws.hold_dense()
    static = (codebook, float(k_bits), out_features)
    _act_dtypes[tensors["trellis"]] = act_dtype
    unmeasured = PreparedShard(trellis_mma_, tensors, out_features, (*static, 0))
    bucket_kernels = measure_bucket_kernels(unmeasured, act_dtype, delegate)
    return PreparedShard(trellis_mma_, tensors, out_features, (*static, bucket_kernels))


def fuse_shards(shards: list[PreparedShard], delegate: Delegate | None = None) -> PreparedShard | None:
    """One run for a layer's shards that share its input (q / k / v, gate / up): one launch runs them all from a table
    of shards (:func:`.ops.trellis_mma_shards_`; above 16 rows one launch per whole 64-row chunks that the shards'
    inputs fit in the workspace, ``QUANTPACK_TRELLIS_MMA_WIDE_FUSED``). The shards keep their own tensors (no copy); the
    fused run's kernels per row bucket are measured on its own
    (:func:`.selection.measure_bucket_kernels`; on a GPU whose
    workspace :func:`prepare_shard` reserved).

    Returns:
        the fused run (``out_features`` the shards' sum), or None when the shards differ in codebook, K or stored
        input width (one kernel instantiation runs a launch), are more than :data:`.ops.MAX_SHARDS`, or are not all
        :func:`prepare_shard`'s.
    """
    if not 1 < len(shards) <= MAX_SHARDS or any(s.run is not trellis_mma_ for s in shards):
        return None
    codebook, k_bits = shards[0].static[:2]
    width = shards[0].tensors["trellis"].shape[0]
    if any(s.static[:2] != (codebook, k_bits) or s.tensors["trellis"].shape[0] != width for s in shards):
        return None
    tensors = {f"{name}{i}": s.tensors[name] for i, s in enumerate(shards) for name in ("trellis", "suh", "svh")}
    outs = tuple(s.out_features for s in shards)
    dtype = _act_dtypes.get(shards[0].tensors["trellis"], torch.float16)
    run = PreparedShard(trellis_mma_shards_, tensors, sum(outs), (codebook, k_bits, outs, 0))
    bucket_kernels = measure_bucket_kernels(run, dtype, delegate)
    return PreparedShard(trellis_mma_shards_, tensors, sum(outs), (codebook, k_bits, outs, bucket_kernels))


def prepare_bank(
    tensors: dict[str, torch.Tensor],
    static: tuple,
    experts: int,
    hidden_stored: int,
    intermediate_stored: int,
    group_first_ids: list[int],
    hidden: int,
    act_dtype: torch.dtype,
    device: torch.device,
) -> PreparedBank:
    """An expert bank's run through ``quantpack::trellis_moe_`` (:mod:`.moe`): reserve the GPU's buffers for it and
    run the op once (which sets each kernel instantiation's shared-memory limit before any CUDA-graph capture).

    Args:
        tensors, static: the op's bank tensors and scalars (:func:`quantpack_core.moe.grouped_inputs`).
        experts: the bank's slots; hidden_stored, intermediate_stored: its stored sizes.
        group_first_ids: an expert id whose slot is in each K group (the warm-up picks them, so that every group's
            gate/up and down instantiation runs once).
        hidden: the model's hidden size (the input's width).
        act_dtype: the model's activation dtype.

    Raises:
        quantpack_core.trellis_mma.library.LibraryError: the kernels cannot be built or loaded, or the warm-up
            launch failed.
    """
    reserve_moe(device, experts, hidden_stored, intermediate_stored)
    x = torch.zeros((1, hidden), dtype=act_dtype, device=device)
    ids = torch.tensor([group_first_ids], dtype=torch.int32, device=device)
    w = torch.ones((1, len(group_first_ids)), dtype=torch.float32, device=device)
    trellis_moe_(x, ids, w, *tensors.values(), *static, torch.empty_like(x))
    torch.cuda.synchronize(device)
    return PreparedBank(trellis_moe_, tensors, static)
