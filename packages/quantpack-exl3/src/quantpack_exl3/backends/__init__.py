"""Kernel backends of the EXL3 linear method.

A backend turns one shard's EXL3 tensors into the form its kernel wants (at load) and runs that kernel through one
registered custom op per call (at forward). The choice is made once, when the quantization config is built, so an
unusable environment is reported before any weight is read:

* ``exllamav3`` (:mod:`.exllamav3`): exllamav3's CUDA kernels; chosen on CUDA devices.
* ``reference`` (:mod:`.reference`): plain torch on any device; chosen on CPU, and the oracle of every test.

``QUANTPACK_EXL3_BACKEND=reference`` (or ``exllamav3``) forces a backend, e.g. the reference one on a GPU to debug.
"""

from __future__ import annotations

import os

from quantpack_core.errors import QuantpackError

from .exllamav3 import Exllamav3Backend
from .reference import ReferenceBackend

BACKEND_ENV = "QUANTPACK_EXL3_BACKEND"
BACKENDS = {b.name: b for b in (Exllamav3Backend, ReferenceBackend)}


class BackendUnavailableError(QuantpackError):
    """No backend can serve EXL3 here; the message says why and how to fix it."""


def select_backend(device_type: str, capability: int | None = None):
    """Choose the backend for this platform.

    Args:
        device_type: vLLM's ``current_platform.device_type`` (``"cuda"``, ``"cpu"``, ...).
        capability: the GPU's compute capability as ``major * 10 + minor``, if known.

    Returns:
        the backend class.

    Raises:
        BackendUnavailableError: ``QUANTPACK_EXL3_BACKEND`` names an unknown backend or one that cannot run here,
            or no backend suits the device; the message gives the reason and the fix.
    """
    forced = os.environ.get(BACKEND_ENV, "").strip().lower()
    if forced:
        backend = BACKENDS.get(forced)
        if backend is None:
            raise BackendUnavailableError(
                f"{BACKEND_ENV}={forced!r} is not a backend of this version; choose one of "
                f"{', '.join(sorted(BACKENDS))}, or unset it"
            )
        reason = (
            backend.unavailable(device_type)
            if backend is ReferenceBackend
            else backend.unavailable(device_type, capability)
        )
        if reason:
            raise BackendUnavailableError(f"{BACKEND_ENV}={forced}: the {forced} backend {reason}")
        return backend
    if device_type in ("cpu", ""):
        return ReferenceBackend
    reason = Exllamav3Backend.unavailable(device_type, capability)
    if reason is None:
        return Exllamav3Backend
    raise BackendUnavailableError(
        f"quantpack-exl3 cannot serve EXL3 on this {device_type!r} device with exllamav3's kernels: the exllamav3 "
        f"backend {reason}. To run anyway with the reference backend (it dequantizes every layer at load, so it needs "
        f"the memory of the dense model and runs at dense speed), set {BACKEND_ENV}=reference."
    )
