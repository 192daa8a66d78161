"""Error types a user can catch, each carrying what went wrong, where, and the fix: every error of quantpack-core
and of the plugins built on it (quantpack-exl3, quantpack-escha-rocm) is defined here.

Every error raised on bad input names the module (layer), the tensor and what to do about it, so that a broken pack
is reported when it is opened or loaded, never as garbage output or a crash inside a kernel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One defect found in a pack.

    Attributes:
        module: HF module name (``model.layers.0.mlp.down_proj``), or ``""`` for a pack-level problem.
        tensor: full tensor name or file name the defect is in (``...down_proj.trellis``, ``model-00002.safetensors``).
        what: what is wrong, with the numbers that show it.
        fix: what the user should do.
    """

    module: str
    tensor: str
    what: str
    fix: str

    def __str__(self) -> str:
        where = self.module or "pack"
        return f"{where}: {self.tensor}: {self.what} -> {self.fix}"


class QuantpackError(Exception):
    """Base class of every error this project raises on bad input.

    Deliberately not a ValueError: vLLM builds its config in pydantic validators, which would fold a ValueError into
    a generic "validation error for VllmConfig"; these propagate as themselves.
    """


class PackError(QuantpackError):
    """A pack (checkpoint directory) is malformed: missing, extra, truncated or inconsistent tensors or files.

    Attributes:
        path: the pack directory.
        problems: every defect found, in the order found.
    """

    def __init__(self, path: str, problems: list[Problem]):
        self.path = str(path)
        self.problems = list(problems)
        shown = collapse(self.problems)
        lines = "\n".join(f"  - {line}" for line in shown)
        n = len(self.problems)
        # where alike problems fold into one line ("the same for N more"), the count says so
        folded = f" ({len(shown)} lines: alike ones folded)" if len(shown) < n else ""
        # a path that is no directory has no pack to leave untouched
        tail = "\nNothing in the pack directory was modified." if os.path.isdir(self.path) else ""
        super().__init__(f"{self.path}: {n} problem{'s' if n != 1 else ''} found in this pack{folded}:\n{lines}{tail}")


#: tensors named after a collapsed problem before "and N more"
COLLAPSE_NAMES = 3


def collapse(problems: list[Problem]) -> list[str]:
    """The problems as lines, one per kind: problems that say the same thing of different tensors (their ``what``
    equal once each one's own module and tensor names are taken out, and the same ``fix``) become the first one's
    line, followed by the next tensors' names and how many more there are (one missing file makes every tensor of
    it absent: one line, not a hundred). Order of first appearance is kept."""
    groups: dict[tuple[str, str], list[Problem]] = {}
    for p in problems:
        what = p.what
        for name in sorted({p.tensor, p.module} - {""}, key=len, reverse=True):
            what = what.replace(name, "<name>")
        groups.setdefault((what, p.fix), []).append(p)
    lines = []
    for same in groups.values():
        first = same[0]
        if len(same) == 1:
            lines.append(str(first))
            continue
        others = [p.tensor for p in same[1:]]
        shown = ", ".join(others[:COLLAPSE_NAMES])
        rest = f" and {len(others) - COLLAPSE_NAMES} more" if len(others) > COLLAPSE_NAMES else ""
        lines.append(f"{first} (the same for {len(others)} more: {shown}{rest})")
    return lines


class CodecError(QuantpackError):
    """An EXL3 tensor cannot be decoded as given (illegal trellis width, wrong dtype, mismatched vectors)."""


class GeometryError(QuantpackError):
    """Shapes that cannot fit together: a layer's stored tensors against the model's layer, or a tensor-parallel cut
    against the 128-wide Hadamard blocks."""


class LayerLoadError(QuantpackError):
    """A layer's loaded tensors do not fit it (missing, doubled or corrupt shards, a fused layer mixing kinds);
    raised while loading, before any forward pass."""


class UnsupportedLayerError(QuantpackError):
    """A layer kind this version cannot serve; raised when vLLM builds the layer."""


class UnsupportedMoeError(UnsupportedLayerError):
    """An MoE layer configuration this version cannot serve (named with the reason and the way out)."""


class BackendUnavailableError(QuantpackError):
    """No kernel can serve a format on this platform, or the kernel forced by an environment variable cannot; the
    message gives every kernel's reason and the fix."""


class NoKernelError(QuantpackError):
    """No kernel of the platform's priority list accepts one shard or expert bank; the message names the layer and
    every kernel's reason."""
