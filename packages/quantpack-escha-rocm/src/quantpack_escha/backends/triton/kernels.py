"""The Triton kernel: escha shards on CUDA and ROCm through :mod:`.escha_triton` (the trellis decoded per block of
weights inside the GEMM, the input and output Hadamard transforms as matrix products).

Takes every escha shard of float16 / bfloat16 / float32 models (the transformed input is rounded to float16, the
decoded weights are float16, accumulation is float32). Its correctness is checked on CPU under Triton's interpreter;
on a GPU it compiles at the first call of each K (the warm-up in :meth:`prepare`, before graph capture).
"""

from __future__ import annotations

import functools

import torch

from quantpack_core.kernels import CUDA, ROCM, LinearKernel, LinearSpec, Platform, PreparedShard

from ...codec import EschaTensors

NAME = "triton"

_warmed: set[tuple] = set()


@functools.cache
def triton_reason() -> str | None:
    """Why Triton cannot be used here (not importable), or None."""
    try:
        import triton  # noqa: F401
    except Exception as e:
        return f"needs Triton ({type(e).__name__}: {e})"
    return None


class EschaTritonLinearKernel(LinearKernel):
    """One escha shard per call: an input-transform launch and a decode-GEMM launch (see the module)."""

    name = NAME

    @classmethod
    def available(cls, platform: Platform) -> tuple[bool, str | None]:
        """CUDA or ROCm with Triton importable."""
        if platform.kind not in (CUDA, ROCM):
            return False, f"needs a CUDA or ROCm GPU (this platform is {platform.kind!r})"
        why = triton_reason()
        return (why is None), why

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str | None]:
        """Every escha shard (integer K 1..8, any shape, tensor-parallel cut and model dtype)."""
        if spec.format != "escha":
            return False, f"runs escha only, this is {spec.format}"
        return True, None

    @classmethod
    def prepare(cls, shard: EschaTensors, spec: LinearSpec, device: torch.device) -> PreparedShard:
        """The code's uint32 words, ``a = s_in * rin`` and ``b = rout * s_out`` (float32) on ``device``; the device's
        workspace reserved; the kernels compiled for this K and dtype by one warm-up call."""
        from .ops import escha_triton_, reserve

        t = shard
        tensors = {
            "code": t.code.contiguous().view(torch.uint8).view(torch.int32).to(device),
            "a": t.input_scale(torch.float32).to(device).contiguous(),
            "b": t.output_scale(torch.float32).to(device).contiguous(),
        }
        reserve(device, t.stored_shape[0])
        prepared = PreparedShard(escha_triton_, tensors, spec.out_features, (t.k_bits, spec.out_features))
        key = (t.k_bits, spec.act_dtype, str(device))
        if key not in _warmed:
            x = torch.zeros((1, spec.in_features), dtype=spec.act_dtype, device=device)
            out = torch.empty((1, spec.out_features), dtype=spec.act_dtype, device=device)
            prepared.run(x, *tensors.values(), *prepared.static, out, 0)
            _warmed.add(key)
        return prepared
