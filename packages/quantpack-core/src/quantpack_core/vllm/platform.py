"""vLLM's current platform as a :class:`~quantpack_core.kernels.Platform` (kind, CUDA capability, ROCm arch).

vLLM's ROCm platform reports ``device_type == "cuda"`` (PyTorch's HIP build uses the CUDA device type), so the kind
is taken from ``is_rocm()`` / ``is_cuda()`` / ``is_cpu()`` rather than from the device type. Follows vLLM's
``vllm/platforms/interface.py`` (``Platform.is_*``, ``get_device_capability``).
"""

from __future__ import annotations

from quantpack_core.kernels import CPU, CUDA, ROCM, Platform


def current_platform() -> Platform:
    """The platform vLLM runs on in this process.

    Returns:
        ``Platform("cuda", capability=90)``, ``Platform("rocm", arch="gfx1201")`` (the arch where this process already
        uses the device, else None), ``Platform("cpu")``, or the device type of any other vLLM platform.
    """
    from vllm.platforms import current_platform as vp

    if vp.is_rocm():
        import torch

        arch = None
        if torch.cuda.is_initialized():  # never initialize the device here: vLLM's front end must not
            arch = torch.cuda.get_device_properties(torch.cuda.current_device()).gcnArchName.split(":")[0]
        return Platform(ROCM, arch=arch)
    if vp.is_cuda():
        cap = vp.get_device_capability()
        return Platform(CUDA, capability=cap.to_int() if cap is not None else None)
    if vp.is_cpu():
        return Platform(CPU)
    return Platform(str(getattr(vp, "device_type", "") or "unknown"))
