"""The escha reference kernel: plain torch on any device (the CPU serving path, and the oracle of the GPU kernels).

At load each shard is decoded once (:func:`quantpack_escha.codec.dequantize`: ``diag(s_in * rin) H What H
diag(rout * s_out)`` in float32), trimmed to the layer's logical features and kept as a dense ``(in, out)`` weight in
the model dtype; the forward is one dense GEMM per layer (a merged layer's shards concatenated), through the
project's ``quantpack::dense_gemm_`` op. Memory is that of the dense model, so it is listed for CPU only.
"""

from __future__ import annotations

import torch

from quantpack_core.dense import dense_gemm_, finalize_dense, fuse_dense
from quantpack_core.kernels import LinearKernel, LinearSpec, PreparedShard

from ...codec import EschaTensors, dequantize

NAME = "reference"


class EschaReferenceKernel(LinearKernel):
    """Decode at load, dense GEMM at forward; every escha shard on any device."""

    name = NAME

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str | None]:
        """Every escha shard (any K, shape, dtype, tensor-parallel cut)."""
        if spec.format != "escha":
            return False, f"decodes escha only, this is {spec.format}"
        return True, None

    @classmethod
    def prepare(cls, shard: EschaTensors, spec: LinearSpec, device: torch.device) -> PreparedShard:
        """The ``(in_features, out_features)`` dense weight of the rank's shard, in ``spec.act_dtype`` on
        ``device``."""
        t = shard
        on_device = EschaTensors(*(v.to(device) for v in (t.code, t.rin, t.s_in, t.rout, t.s_out)))
        w = dequantize(on_device, torch.float32)[: spec.in_features, : spec.out_features]
        return PreparedShard(dense_gemm_, {"weight": w.to(spec.act_dtype).contiguous()}, spec.out_features)

    @classmethod
    def fuse(cls, shards: list[PreparedShard]) -> PreparedShard | None:
        """A merged layer's shards as one GEMM over their concatenated dense weights."""
        return fuse_dense(shards)

    @classmethod
    def finalize(cls, prepared: PreparedShard) -> PreparedShard:
        """On vLLM's CPU platform the dense weight goes to vLLM's own CPU GEMM (its dispatch and prepacking,
        :func:`quantpack_core.dense.finalize_dense`)."""
        return finalize_dense(prepared)
