"""What a backend hands the linear method for each shard, and the dense form every backend shares."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..ops import exl3_reference_gemm_


@dataclass(frozen=True)
class ShardKernel:
    """One prepared shard: how to run it and on what.

    Attributes:
        run: ``run(x, *tensors.values(), *static, out, col)``; one registered custom op call that writes
            ``out[:, col:col + out_features]``.
        tensors: the shard's device tensors (registered as parameters of the layer, so they move and count with it).
        static: Python scalars passed after the tensors (codebook, K, widths).
        out_features: how many output columns the shard writes.
    """

    run: Callable[..., None]
    tensors: dict[str, torch.Tensor]
    out_features: int
    static: tuple = field(default=())


def dense_kernel(weight: torch.Tensor, dtype: torch.dtype, device: torch.device) -> ShardKernel:
    """A dense checkpoint shard (``(out, in)``, nn.Linear layout) as a ``(in, out)`` weight in the model dtype,
    converted once, run through ``quantpack::exl3_reference_gemm_`` on any device."""
    w = weight.to(device=device, dtype=dtype).t().contiguous()
    return ShardKernel(exl3_reference_gemm_, {"weight": w}, w.shape[1])


@dataclass(frozen=True)
class MoeRun:
    """One prepared MoE expert bank: how ``Exl3MoEMethod.apply`` runs it.

    Attributes:
        fn: the op wrapper, ``fn(x, topk_ids, topk_weights, *tensors.values(), *static, out)``; one registered custom
            op call that writes ``out (T, hidden)``.
        tensors: device tensors the op reads (registered as parameters of the layer, so they count with it).
        static: Python scalars / lists after the tensors.
    """

    fn: Callable[..., None]
    tensors: dict[str, torch.Tensor]
    static: tuple = field(default=())
