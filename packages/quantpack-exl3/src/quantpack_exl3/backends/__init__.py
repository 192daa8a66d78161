"""Kernel backends of the EXL3 linear method.

A backend turns one shard's EXL3 tensors into the form its kernel wants (at load) and runs that kernel through one
registered custom op (at forward). Selection happens once, when the quantization config is built, so an unusable
environment is reported before any weight is read:

* ``reference`` (:mod:`.reference`): plain torch, any device; the oracle of every test and the CPU serving path.
* ``exllamav3``: exllamav3's CUDA kernels (not in this release: a CUDA device without it is refused at config time,
  naming the fix, unless the reference backend is chosen explicitly).

The environment variable ``QUANTPACK_EXL3_BACKEND`` (``reference``) overrides the choice.
"""

from __future__ import annotations

import os

from quantpack_core.errors import QuantpackError

from .reference import ReferenceBackend

BACKEND_ENV = "QUANTPACK_EXL3_BACKEND"
BACKENDS = {ReferenceBackend.name: ReferenceBackend}


class BackendUnavailableError(QuantpackError):
    """No backend can serve EXL3 on this device; the message lists why each one declined and how to fix it."""


def select_backend(device_type: str):
    """Choose the backend for a device type (``"cpu"``, ``"cuda"``, ...).

    Args:
        device_type: vLLM's ``current_platform.device_type``.

    Returns:
        the backend class.

    Raises:
        BackendUnavailableError: when ``QUANTPACK_EXL3_BACKEND`` names an unknown backend, or when no backend suits
            the device.
    """
    forced = os.environ.get(BACKEND_ENV, "").strip().lower()
    if forced:
        if forced not in BACKENDS:
            raise BackendUnavailableError(
                f"{BACKEND_ENV}={forced!r} is not a backend of this version; choose one of "
                f"{', '.join(sorted(BACKENDS))}, or unset it"
            )
        return BACKENDS[forced]
    if device_type in ("cpu", ""):
        return ReferenceBackend
    raise BackendUnavailableError(
        f"quantpack-exl3 has no fast EXL3 kernel backend for device type {device_type!r} in this version: the "
        "exllamav3 CUDA backend is not part of it yet. To run anyway with the reference backend (it dequantizes every "
        f"layer at load, so it needs the memory of the dense model), set {BACKEND_ENV}=reference."
    )
