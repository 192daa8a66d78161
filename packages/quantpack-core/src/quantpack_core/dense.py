"""The dense kernel every format shares: a shard the pack stores as a plain ``.weight``, kept as an ``(in, out)``
matrix in the model dtype and run by ``quantpack::dense_gemm_`` on any device. Reference kernels that dequantize a
quantized shard at load run the same op on the dense result.

Plain torch; no vLLM import.
"""

from __future__ import annotations

import torch

from .kernels import LinearKernel, LinearSpec, PreparedShard
from .ops import define_op

DENSE = "dense"


def _dense_gemm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, col: int) -> None:
    out.narrow(1, col, weight.shape[1]).copy_(torch.mm(x, weight))


define_op(
    "dense_gemm_",
    "(Tensor x, Tensor weight, Tensor(a!) out, int col) -> ()",
    {"CompositeExplicitAutograd": _dense_gemm},
)


def dense_gemm_(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, col: int) -> None:
    """One dense shard: ``out[:, col:col + out_features] = x @ weight``.

    Args:
        x: ``(rows, in)`` activations, the model dtype.
        weight: ``(in, out_features)`` in ``x``'s dtype and device.
        out: ``(rows, total)`` layer output, written in place.
        col: first output column of this shard.
    """
    torch.ops.quantpack.dense_gemm_(x, weight, out, col)


class DenseKernel(LinearKernel):
    """Dense shards on any platform: the ``(out, in)`` checkpoint weight converted once to ``(in, out)`` in the model
    dtype."""

    name = DENSE

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str | None]:
        """Every dense shard; nothing else."""
        if spec.format != DENSE:
            return False, f"runs dense shards only, this one is {spec.format}"
        return True, None

    @classmethod
    def prepare(cls, shard: torch.Tensor, spec: LinearSpec, device: torch.device) -> PreparedShard:
        """``shard``: the rank's ``(out, in)`` weight -> an ``(in, out)`` matrix in ``spec.act_dtype``."""
        w = shard.to(device=device, dtype=spec.act_dtype).t().contiguous()
        return PreparedShard(dense_gemm_, {"weight": w}, w.shape[1])
