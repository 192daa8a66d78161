"""How the project registers its custom ops (namespace ``quantpack``): one op per kernel call, each with a fake
implementation, so torch.compile traces a model through them with exact shapes and no graph break.

Every op writes its result into a caller-owned output (``Tensor(a!) out``), so a fused layer's shards fill one output
without a concatenation and nothing is allocated for the result inside the op. The ops are defined on a private
``torch.library.Library`` fragment rather than vLLM's shared one, so that defining them needs no vLLM platform, and
defining one twice (vLLM loads plugins in every process, sometimes twice) is a no-op. Each kernel backend defines
its own ops next to their implementations with :func:`define_op`; :func:`defined_ops` lists them for the tests (every
op must have an ``opcheck`` case). Follows vLLM's ``vllm/utils/torch_utils.py::direct_register_custom_op`` (define +
impl + ``_register_fake``, without ``torch.library.custom_op``'s dispatch overhead).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

NAMESPACE = "quantpack"

_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")  # kept alive for the life of the process
_DEFINED: dict[str, str] = {}


def no_result(*args: object, **kwargs: object) -> None:
    """The fake implementation of an op that only writes its ``out`` argument (shapes are the caller's)."""
    return None


def define_op(name: str, schema: str, impls: Mapping[str, Callable[..., None]], fake=no_result) -> None:
    """Define ``quantpack::<name>`` once per process.

    Args:
        name: the op's name (``exl3_gemm_``: a trailing underscore for ops that write their ``out``).
        schema: its argument list and result, e.g. ``"(Tensor x, Tensor w, Tensor(a!) out, int col) -> ()"``.
        impls: dispatch key (``"CUDA"``, ``"CompositeExplicitAutograd"``) -> implementation.
        fake: the meta implementation torch.compile traces with.
    """
    _DEFINED.setdefault(name, schema)
    if hasattr(getattr(torch.ops, NAMESPACE), name):
        return
    _LIB.define(f"{name}{schema}")
    for key, impl in impls.items():
        _LIB.impl(name, impl, key)
    _LIB._register_fake(name, fake)


def defined_ops() -> dict[str, str]:
    """Every op defined in this process through :func:`define_op`: name -> schema."""
    return dict(_DEFINED)
