"""The HIP kernel: escha shards through the ``radiance_escha_kernel`` extension on ROCm (gfx1201).

Chosen on ROCm when the extension imports, for bfloat16 models (the extension reads and writes bf16) and shards
stored at their logical size (it writes the whole stored width; escha packs store multiples of 128). The code is
handed over as int32 words, ``rin`` / ``rout`` as float16 and ``s_in`` / ``s_out`` as float32, as the extension
reads them; its workspace is reserved in :meth:`prepare` (:func:`.ops.reserve`), before any graph capture.
"""

from __future__ import annotations

import torch

from quantpack_core.kernels import ROCM, LinearKernel, LinearSpec, Platform, PreparedShard

from ...codec import EschaTensors
from .extension import extension_reason
from .ops import escha_hip_, reserve

NAME = "hip"
#: K the extension decodes
HIP_K = (1, 2, 3, 4)


class EschaHipLinearKernel(LinearKernel):
    """One escha shard per launch of the HIP extension (see the module)."""

    name = NAME

    @classmethod
    def available(cls, platform: Platform) -> tuple[bool, str | None]:
        """ROCm, and the extension imports (:func:`.extension.extension_reason`)."""
        if platform.kind != ROCM:
            return False, f"needs ROCm (this platform is {platform.kind!r})"
        why = extension_reason()
        return (why is None), why

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str | None]:
        """escha shards of K 1..4 in bfloat16 models, stored at their logical size."""
        if spec.format != "escha":
            return False, f"runs escha only, this is {spec.format}"
        if spec.act_dtype != torch.bfloat16:
            return False, f"its extension reads and writes bfloat16; this model is {spec.act_dtype} (serve it in bf16)"
        if spec.k_bits not in HIP_K:
            return False, f"its extension decodes K {', '.join(map(str, HIP_K))}, this shard is K={spec.k_bits:g}"
        if (spec.stored_in, spec.stored_out) != (spec.in_features, spec.out_features):
            return False, (
                f"it writes the stored width; this shard is stored {spec.stored_in}x{spec.stored_out} for "
                f"{spec.in_features}x{spec.out_features}"
            )
        return True, None

    @classmethod
    def prepare(cls, shard: EschaTensors, spec: LinearSpec, device: torch.device) -> PreparedShard:
        """The shard's tensors on ``device`` in the extension's dtypes, and the device's workspace reserved for it.

        Raises:
            ImportError: the extension does not import.
        """
        t = shard
        code = t.code.contiguous().view(torch.uint8).view(torch.int32)  # the same bytes as uint32 words
        tensors = {
            "code": code.to(device),
            "rin": t.rin.to(device=device, dtype=torch.float16).contiguous(),
            "rout": t.rout.to(device=device, dtype=torch.float16).contiguous(),
            "s_in": t.s_in.to(device=device, dtype=torch.float32).contiguous(),
            "s_out": t.s_out.to(device=device, dtype=torch.float32).contiguous(),
        }
        k, n = t.stored_shape
        reserve(device, k, n)
        return PreparedShard(escha_hip_, tensors, spec.out_features, (t.k_bits,))
