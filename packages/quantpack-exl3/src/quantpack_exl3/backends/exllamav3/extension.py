"""Importing exllamav3's CUDA extension (``exllamav3_ext``) once per process, with the environment it needs.

* ``EXL3_INT8_GEMV`` is pinned to ``0``: exllamav3's int8-activation GEMV (on by default for mul1 tensors on CUDA)
  changes the numerics (about 0.9% output RMS deviation in its default mode) and allocates on first use, which
  CUDA-graph capture forbids.
* ``EXL3_EXPANDABLE_SEGMENTS`` defaults to ``0`` before exllamav3 is imported, so importing it leaves the PyTorch
  allocator as vLLM configured it.

Source: exllamav3 1.6.5, ``exllamav3/ext.py`` and ``exllamav3/modules/quant/exl3.py``.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("vllm.quantpack.exl3")

INSTALL_HINT = (
    "install exllamav3 into this environment: `pip install exllamav3==1.6.5` (its CUDA extension is built on first "
    "import, which needs nvcc matching torch.version.cuda and takes ~5 minutes on 16 cores; set "
    "TORCH_CUDA_ARCH_LIST to your GPU, e.g. 9.0, to build only that), or a prebuilt wheel from exllamav3's "
    'releases matching `python -c "import torch; print(torch.__version__, torch.version.cuda)"`'
)

_ext = None


def load_extension():
    """Import ``exllamav3_ext`` once per process (after pinning the environment knobs above).

    Returns:
        the extension module.

    Raises:
        ImportError (or whatever the import raised): exllamav3 is missing or its extension cannot be built/loaded.
    """
    global _ext
    if _ext is None:
        previous = os.environ.get("EXL3_INT8_GEMV")
        if previous not in (None, "0"):
            logger.warning(
                "quantpack-exl3: EXL3_INT8_GEMV=%s overridden to 0 (see quantpack_exl3.backends.exllamav3)", previous
            )
        os.environ["EXL3_INT8_GEMV"] = "0"
        os.environ.setdefault("EXL3_EXPANDABLE_SEGMENTS", "0")
        from exllamav3.ext import exllamav3_ext

        _ext = exllamav3_ext
    return _ext
