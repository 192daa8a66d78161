"""Loading the HIP extension ``radiance_escha_kernel`` (built for ROCm gfx1201; installed separately, not on PyPI).

The extension is a Python module with two entry points (the interface its serving path uses):

* ``set_decode_scratch(partial_ptr, nbytes, counters_ptr)``: the split-K partial slab (float32) and its block
  counters (int32, 4096), device memory the extension keeps using until the next call;
* ``launch(x, code, rin, rout, s_in, s_out, a_q, a_scale, a_max, c, out, rows, n, k, kbits, ldo, col, stream)``:
  one escha projection, every argument a device pointer or an integer: the activations ``x`` (contiguous bf16
  ``(rows, k)``), the code as int32 words, the scales (``rin`` / ``rout`` float16, ``s_in`` / ``s_out`` float32),
  the extension's activation pre-quantization buffers (``a_q`` uint8 ``(rows, k)``, ``a_scale`` float32 ``(rows,)``,
  ``a_max`` float32 ``(rows,)`` zeroed before each call), its bf16 ``(rows, n)`` intermediate ``c``, and the output
  ``out`` whose columns ``col .. col + n`` of rows of stride ``ldo`` it writes.

Nothing here was run on ROCm: the tests replace the module at this import boundary with a stand-in that computes
through the reference (``tests/test_escha_hip.py``).
"""

from __future__ import annotations

import functools
import importlib

#: the extension's module name
MODULE = "radiance_escha_kernel"


@functools.cache
def load_extension():
    """The imported extension module (cached).

    Raises:
        ImportError: it is not installed or fails to import (the message says which).
    """
    return importlib.import_module(MODULE)


def extension_reason() -> str | None:
    """Why the extension cannot be used here (not installed, or its import fails), or None."""
    try:
        ext = load_extension()
    except Exception as e:  # ImportError, or the extension's own load failure (missing HIP runtime ...)
        return f"its extension {MODULE} does not import ({type(e).__name__}: {e}); install it for your ROCm build"
    missing = [name for name in ("launch", "set_decode_scratch") if not hasattr(ext, name)]
    if missing:
        return f"its extension {MODULE} lacks {', '.join(missing)} (another version of it is installed)"
    return None
