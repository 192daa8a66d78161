"""Values of the pack's small tensors, read at open (``CheckSettings.values``): non-finite values, and finite ones no
trained model holds (:data:`VALUE_LIMIT`), in the 1-D floating tensors of dense, int8-row and other modules and in
dense vocabulary tables (:func:`vector_problems`); the formats' own value rules use :func:`read_value`,
:func:`finite_problems` and :func:`implausible_vector_problems` on their scales and markers.
"""

from __future__ import annotations

import torch

from ..errors import Problem
from ..inventory import DENSE, FIX_REDOWNLOAD, ModuleInfo, PackView
from .layers import is_norm

#: the largest magnitude a norm weight, an EXL3 ``suh`` / ``svh``, an escha scale or a value of a dense vocabulary
#: table may have. Measured on the bundled packs (11 EXL3, their bf16 sources, the EAGLE draft) and the packs
#: converted from them (3 escha, 2 with int8 tables): norm weights up to 1.72 (llama-tiny 2.5 bpw's model.norm),
#: svh 2.67, suh 0.249, escha scales 2.0, embedding tables 0.283, a dense head 0.381. The limit lies some 3,700 times
#: above the largest of those and below float16's largest value (65,504), the activations' dtype in exllamav3's
#: kernels: a gain past it would overflow any float16 activation above 6.6, so no trained model holds it. A norm
#: weight of 3.0e38 was served before with every logprob NaN (vLLM 0.32, float32).
VALUE_LIMIT = 1e4
#: elements up to which a dense module's floating vectors are read and checked for NaN / Inf (norm weights, biases,
#: int8 row scales; whole tables and matrices are not read)
VECTOR_CHECK_ELEMENTS = 1 << 20
#: module names whose dense 2-D floating weight is scanned whole for NaN / Inf (vocabulary tables: a non-finite
#: row poisons every token that meets it), in chunks of this many elements
TABLE_MODULES = ("embed_tokens", "lm_head")
TABLE_CHUNK_ELEMENTS = 1 << 24


def read_value(pack: PackView, key: str, name: str, out: list[Problem]) -> torch.Tensor | None:
    """Tensor ``name`` of module ``key``, or None after recording why safetensors cannot read its bytes."""
    try:
        return pack.get_tensor(name)
    except Exception as e:  # bytes safetensors cannot read
        out.append(Problem(key, name, f"unreadable ({type(e).__name__}: {e})", FIX_REDOWNLOAD))
        return None


def finite_problems(key: str, name: str, v: torch.Tensor) -> list[Problem]:
    """A problem when ``v`` holds NaN or infinite values (float8 and other types ``isfinite`` does not take are read
    as float32)."""
    if v.is_floating_point() and v.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        v = v.float()
    if bool(torch.isfinite(v).all()):
        return []
    count = int((~torch.isfinite(v)).sum())
    return [Problem(key, name, f"{count} of {v.numel()} values are NaN or infinite", FIX_REDOWNLOAD)]


def implausible_vector_problems(
    key: str, name: str, v: torch.Tensor, *, scale: bool, zero_ok: bool = False
) -> list[Problem]:
    """A 1-D vector's finite values beyond :data:`VALUE_LIMIT` in magnitude (counted, the first index and value
    named; NaN / Inf are the finiteness check's), and for a ``scale`` vector (EXL3 ``suh`` / ``svh``, escha scales)
    unless ``zero_ok``, one that is all zero: every weight of its layer is then 0 (an all-zero ``suh`` was served
    before at KL 5.2 nats).
    Vectorised: one pass over the vector."""
    a = v.detach().float().abs()
    out: list[Problem] = []
    huge = torch.isfinite(a) & (a > VALUE_LIMIT)
    if bool(huge.any()):
        i = int(huge.nonzero()[0, 0])
        what = (
            f"{int(huge.sum())} of {v.numel()} values lie beyond {VALUE_LIMIT:g} in magnitude (first: index {i}, "
            f"{float(v[i]):.3g}): no trained model keeps such a {'scale' if scale else 'norm weight'}"
        )
        out.append(Problem(key, name, what, FIX_REDOWNLOAD))
    if scale and not zero_ok and v.numel() and not bool(a.any()):
        what = f"all {v.numel()} values are 0: every weight of the layer would be 0"
        out.append(Problem(key, name, what, FIX_REDOWNLOAD))
    return out


def vector_problems(pack: PackView, m: ModuleInfo) -> list[Problem]:
    """Non-finite values in a dense, int8-row or other module's 1-D floating tensors (a norm's weight, a bias, the
    row scales of an int8 table, the Gated DeltaNet's A_log / dt_bias: a NaN there reaches every token) and in a
    dense vocabulary table (:data:`TABLE_MODULES`), read in chunks of rows so the check's memory stays at one chunk
    (64 MiB in float32); a norm weight beyond :data:`VALUE_LIMIT`."""
    out: list[Problem] = []
    if m.format == DENSE and m.key.rsplit(".", 1)[-1] in TABLE_MODULES:
        out += table_problems(pack, m)
    for suffix, info in m.tensors.items():
        if len(info.shape) != 1 or not info.dtype.is_floating_point or info.shape[0] > VECTOR_CHECK_ELEMENTS:
            continue
        if info.file in pack.bad_files:
            continue
        name = f"{m.key}.{suffix}"
        v = read_value(pack, m.key, name, out)
        if v is not None:
            out += finite_problems(m.key, name, v)
            if is_norm(m.key) and suffix == "weight":
                out += implausible_vector_problems(m.key, name, v, scale=False)
    return out


def table_problems(pack: PackView, m: ModuleInfo) -> list[Problem]:
    """The rows of module ``m``'s 2-D floating ``weight`` holding non-finite values, or values beyond
    :data:`VALUE_LIMIT` (each counted, the first row named)."""
    info = m.tensors.get("weight")
    if info is None or len(info.shape) != 2 or not info.dtype.is_floating_point or info.file in pack.bad_files:
        return []
    name = f"{m.key}.weight"
    try:
        sl = pack.get_slice(name)
    except Exception as e:  # bytes safetensors cannot read
        return [Problem(m.key, name, f"unreadable ({type(e).__name__}: {e})", FIX_REDOWNLOAD)]
    rows, cols = info.shape
    step = max(1, TABLE_CHUNK_ELEMENTS // max(cols, 1))
    bad_rows, first, huge_rows, first_huge = 0, None, 0, None
    for r0 in range(0, rows, step):
        try:
            chunk = sl[r0 : r0 + step]
        except Exception as e:
            return [Problem(m.key, name, f"unreadable ({type(e).__name__}: {e})", FIX_REDOWNLOAD)]
        bad = ~torch.isfinite(chunk).all(dim=1)
        if bool(bad.any()):
            bad_rows += int(bad.sum())
            first = r0 + int(bad.nonzero()[0, 0]) if first is None else first
        huge = ~bad & (chunk.abs().amax(dim=1) > VALUE_LIMIT) if chunk.numel() else bad
        if bool(huge.any()):
            huge_rows += int(huge.sum())
            first_huge = r0 + int(huge.nonzero()[0, 0]) if first_huge is None else first_huge
    out: list[Problem] = []
    if bad_rows:
        what = f"{bad_rows} of {rows} rows hold NaN or infinite values (first: row {first})"
        out.append(Problem(m.key, name, what, FIX_REDOWNLOAD))
    if huge_rows:
        what = (
            f"{huge_rows} of {rows} rows hold values beyond {VALUE_LIMIT:g} in magnitude (first: row {first_huge}):"
            " no trained model's table holds such a row"
        )
        out.append(Problem(m.key, name, what, FIX_REDOWNLOAD))
    return out
