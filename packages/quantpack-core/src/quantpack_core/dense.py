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
    if col == 0 and weight.shape[1] == out.shape[1] and out.is_contiguous():  # the whole output: no copy
        torch.mm(x, weight, out=out)
    else:
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


def finalize_dense(prepared: PreparedShard) -> PreparedShard:
    """A ``dense_gemm_`` run on vLLM's CPU platform handed to vLLM's own CPU GEMM (its dispatch and weight prepacking,
    :mod:`quantpack_core.vllm.cpu_linear`); any other run unchanged. Kernels that end in a dense weight use it as
    their :meth:`~quantpack_core.kernels.LinearKernel.finalize`."""
    w = prepared.tensors.get("weight")
    if prepared.run is not dense_gemm_ or w is None or w.device.type != "cpu":
        return prepared
    from .vllm import cpu_linear  # only reached in a vLLM process: CPU tensors of a prepared layer

    return cpu_linear.pack(prepared)


def fuse_dense(shards: list[PreparedShard]) -> PreparedShard | None:
    """Consecutive ``dense_gemm_`` shards of one layer as one: their ``(in, out)`` weights concatenated along the
    output, one GEMM writing all their columns (the layer holds the same bytes; the shards' own weights are freed when
    the caller drops them). None when a shard is not a plain ``dense_gemm_`` shard."""
    weights = [s.tensors.get("weight") for s in shards]
    if any(s.run is not dense_gemm_ or len(s.tensors) != 1 or s.static for s in shards) or any(
        w is None or w.shape[0] != weights[0].shape[0] for w in weights
    ):
        return None
    if all(w.t().is_contiguous() for w in weights):
        # transposes of (out, in) matrices (the reference kernels' layout): stacked along their rows, the result
        # stays in the layout vLLM's CPU GEMM packs from, with no transposing copy
        w = torch.cat([w.t() for w in weights], dim=0).t()
    else:
        w = torch.cat(weights, dim=1)
    return PreparedShard(dense_gemm_, {"weight": w}, w.shape[1])


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

    @classmethod
    def fuse(cls, shards: list[PreparedShard]) -> PreparedShard | None:
        """One GEMM over the layer's concatenated dense shards (:func:`fuse_dense`)."""
        return fuse_dense(shards)

    @classmethod
    def finalize(cls, prepared: PreparedShard) -> PreparedShard:
        """On vLLM's CPU platform, vLLM's own CPU GEMM (:func:`finalize_dense`)."""
        return finalize_dense(prepared)
