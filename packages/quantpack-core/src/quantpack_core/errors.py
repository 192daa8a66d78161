"""Error types a user can catch, each carrying what went wrong, where, and the fix.

Every error raised on bad input names the module (layer), the tensor and what to do about it, so that a broken pack
is reported when it is opened or loaded, never as garbage output or a crash inside a kernel.
"""

from __future__ import annotations

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
        lines = "\n".join(f"  - {p}" for p in self.problems)
        n = len(self.problems)
        super().__init__(
            f"{self.path}: {n} problem{'s' if n != 1 else ''} found in this pack:\n{lines}\n"
            "Nothing in the pack directory was modified."
        )


class CodecError(QuantpackError):
    """An EXL3 tensor cannot be decoded as given (illegal trellis width, wrong dtype, mismatched vectors)."""


class GeometryError(QuantpackError):
    """Shapes that cannot fit together: a layer's stored tensors against the model's layer, or a tensor-parallel cut
    against the 128-wide Hadamard blocks."""
