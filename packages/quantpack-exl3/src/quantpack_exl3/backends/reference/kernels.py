"""The reference kernels: plain torch on any device (the CPU serving path, and the oracle of the GPU tests).

At load each EXL3 shard is dequantized once by the core codec (``W = diag(suh) H What H diag(svh)``, in float32),
trimmed to the layer's logical input and output features (exact: a padded layer's extra input rows only ever meet
zero-padded activations, and its extra output columns are discarded), and kept as a dense ``(in, out)`` weight in the
model dtype. So its memory is that of the dense model, and its forward is one dense GEMM per layer (a fused layer's
shards, q / k / v or gate / up, are concatenated into one weight). An expert bank is decoded to dense per-expert
weights the same way and run by one op that loops over the routed experts.

They are listed for CPU only: on a GPU they would serve at dense memory and speed, so there they run only when
forced (``QUANTPACK_EXL3_BACKEND=reference``). Source: docs/exl3-format.md ("The math"); exllamav3's
``LinearEXL3.get_weight_tensor`` does the same reconstruction.
"""

from __future__ import annotations

import torch

from quantpack_core.codec import Exl3Tensors, dequantize
from quantpack_core.dense import dense_gemm_, finalize_dense, fuse_dense
from quantpack_core.kernels import (
    TP_EXPERT_SPLIT,
    ExpertKernel,
    ExpertSpec,
    LinearKernel,
    LinearSpec,
    PreparedBank,
    PreparedShard,
)
from quantpack_core.moe import Exl3MoeBank, dequantize_expert

from .ops import exl3_moe_reference_

NAME = "reference"


def _vllm_cpu_moe() -> bool:
    """Whether vLLM's CPU MoE kernel is there (a vLLM process on a CPU build)."""
    try:
        from quantpack_core.vllm.cpu_moe import available
    except ImportError:
        return False
    return available()


def _exl3_only(spec) -> tuple[bool, str | None]:
    if spec.format != "exl3":
        return False, f"decodes EXL3 only, this is {spec.format}"
    return True, None


class ReferenceLinearKernel(LinearKernel):
    """Dequantize at load, dense GEMM at forward (memory = dense model); every EXL3 shard on any device."""

    name = NAME

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str | None]:
        """Every EXL3 shard (any K, codebook, shape, dtype, tensor-parallel cut)."""
        return _exl3_only(spec)

    @classmethod
    def prepare(cls, shard: Exl3Tensors, spec: LinearSpec, device: torch.device) -> PreparedShard:
        """The ``(in_features, out_features)`` dense weight of the rank's shard, in ``spec.act_dtype`` on
        ``device``: the transpose of a contiguous ``(out_features, in_features)`` matrix, the layout of an
        ``nn.Linear`` weight, which vLLM's CPU GEMM then packs without a transposing copy.

        The codec decodes in float32 blocks straight into that matrix (:func:`quantpack_core.codec.dequantize` with
        ``out``), so the shard's only full-size allocation is its result."""
        t = shard
        on_device = Exl3Tensors(t.trellis.to(device), t.suh.to(device), t.svh.to(device), t.codebook)
        w = torch.empty((spec.out_features, spec.in_features), dtype=spec.act_dtype, device=device)
        dequantize(on_device, torch.float32, out=w.t())
        return PreparedShard(dense_gemm_, {"weight": w.t()}, spec.out_features)

    @classmethod
    def fuse(cls, shards: list[PreparedShard]) -> PreparedShard | None:
        """A layer's consecutive shards (q / k / v, gate / up) as one GEMM over their concatenated dense weights
        (:func:`quantpack_core.dense.fuse_dense`)."""
        return fuse_dense(shards)

    @classmethod
    def finalize(cls, prepared: PreparedShard) -> PreparedShard:
        """On vLLM's CPU platform the dense weight goes to vLLM's own CPU GEMM (its dispatch and prepacking,
        :func:`quantpack_core.dense.finalize_dense`)."""
        return finalize_dense(prepared)


class ReferenceExpertKernel(ExpertKernel):
    """Dense per-expert weights decoded at load, one op looping over the routed experts."""

    name = NAME

    @classmethod
    def can_implement(cls, spec: ExpertSpec) -> tuple[bool, str | None]:
        """Every EXL3 bank."""
        return _exl3_only(spec)

    @classmethod
    def prepare(
        cls, bank: Exl3MoeBank, spec: ExpertSpec, hidden: int, intermediate: int, device: torch.device
    ) -> PreparedBank:
        """Dense ``w13 (E, hidden, 2 * intermediate)`` (``[W1 | W3]``; an ungated bank's ``(E, hidden,
        intermediate)``: ``W1``) and ``w2 (E, intermediate, hidden)`` in the model dtype, decoded by the core codec in
        float32 and trimmed to the layer's logical sizes; the bank is freed by the caller afterwards. The op tells
        gated from ungated by ``w13``'s width against ``w2``'s.

        Source: :func:`quantpack_core.moe.dequantize_expert`.
        """
        e_num, inter, dtype = bank.num_experts, intermediate, spec.act_dtype
        w13 = torch.empty((e_num, hidden, (2 if spec.gated else 1) * inter), dtype=dtype, device=device)
        w2 = torch.empty((e_num, inter, hidden), dtype=dtype, device=device)
        for e in range(e_num):
            w1, w3, wd = dequantize_expert(bank, e, torch.float32)
            w13[e, :, :inter] = w1[:hidden, :inter]
            if w3 is not None:
                w13[e, :, inter:] = w3[:hidden, :inter]
            w2[e] = wd[:inter, :hidden]
        cpu_moe = spec.gated and spec.tp != TP_EXPERT_SPLIT and hidden % 32 == 0  # vLLM's CPU kernel: gated SiLU
        if device.type == "cpu" and cpu_moe and _vllm_cpu_moe():
            # vLLM's own CPU MoE kernel (every pick is an expert of this bank, hidden a multiple of 32)
            from quantpack_core.vllm.cpu_moe import pack_bank

            return pack_bank(w13, w2)
        return PreparedBank(exl3_moe_reference_, {"w13": w13, "w2": w2})
