"""The tensors of one escha-coded linear layer and their math (decode, reference forward, tensor-parallel cut).

An escha shard stores (docs/escha-format.md):

* ``escha_code``: int16 ``(in/16, out/16, 16*K)``, integer K 1..8 - EXL3 trellis tiles, decoded with EXL3's mcg
  codebook (:mod:`quantpack_core.codec`);
* ``escha_rin`` and ``escha_s_in``: ``(in,)`` input-side scales, applied before the input Hadamard transform
  (``rin`` carries the projection's weight scale);
* ``escha_rout`` and ``escha_s_out``: ``(out,)`` output-side scales, applied after the output transform;
* optionally ``escha_config`` (geometry, informational) and ``bias`` (loaded, never applied: the format's published
  results were made without biases).

The forward, with ``H`` the unnormalized 128-point Sylvester Hadamard transform over each 128-feature block::

    y = H(H((x * s_in) * rin) @ What) * rout * s_out

so an EXL3 layer with the same trellis is the same layer when ``s_in * rin = suh / sqrt(128)`` and
``rout * s_out = svh / sqrt(128)`` (EXL3's transforms are normalized).

Plain torch on any device; the oracle the escha kernels are tested against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quantpack_core.codec import HAD_BLOCK, TILE, Codebook, decode_matrix, had128, k_from_width
from quantpack_core.errors import CodecError
from quantpack_core.tp import TpCut

#: the codebook every escha code is decoded with
CODEBOOK = Codebook.MCG
#: the code tensor's suffix (the pack reader names escha modules by it: :class:`~quantpack_escha.format.EschaFormat`)
CODE = "escha_code"
#: the scales' suffixes, input side (``(in,)``) then output side (``(out,)``)
IN_SCALES, OUT_SCALES = ("escha_rin", "escha_s_in"), ("escha_rout", "escha_s_out")
#: the optional geometry record of its writer (int32 ``[16, K, 2, 1, in, out]``; informational)
CONFIG = "escha_config"
#: unnormalized transforms on both sides: sqrt(128) each relative to EXL3's normalized ones
HAD_GAIN = math.sqrt(HAD_BLOCK)


@dataclass(frozen=True)
class EschaTensors:
    """One escha-coded linear shard as the pack stores it (see the module).

    Attributes:
        code: int16 ``(k/16, n/16, 16*K)``; k and n (stored in / out features) are multiples of 128.
        rin, s_in: ``(k,)`` float16 / float32 input-side scales.
        rout, s_out: ``(n,)`` float16 / float32 output-side scales.
        bias: optional ``(n,)`` bias (carried, never applied).

    Raises:
        CodecError: at construction, a code that is not int16 3-D with a legal integer K, scales of the wrong
            length or dtype, or scales holding NaN / infinities.
    """

    code: torch.Tensor
    rin: torch.Tensor
    s_in: torch.Tensor
    rout: torch.Tensor
    s_out: torch.Tensor
    bias: torch.Tensor | None = None

    def __post_init__(self):
        c = self.code
        if c.dtype != torch.int16 or c.dim() != 3:
            raise CodecError(f".{CODE} must be int16 (in/16, out/16, 16*K), got {c.dtype} {list(c.shape)}")
        width = c.shape[2]
        if width % 16 or not 1 <= width // 16 <= 8:
            raise CodecError(f".{CODE} has {width} words per tile: escha codes hold 16*K words for an integer K 1..8")
        k, n = self.stored_shape
        if k % HAD_BLOCK or n % HAD_BLOCK:
            raise CodecError(f".{CODE} codes a {k}x{n} matrix; escha stores whole 128-feature blocks on both sides")
        for names, length in ((IN_SCALES, k), (OUT_SCALES, n)):
            for name in names:
                v = getattr(self, name.removeprefix("escha_"))
                if not v.is_floating_point() or v.dim() != 1 or v.shape[0] != length:
                    raise CodecError(
                        f".{name} must be a float vector of {length} (the code's "
                        f"{'input' if names is IN_SCALES else 'output'} features), got {v.dtype} {list(v.shape)}"
                    )
                if not bool(torch.isfinite(v).all()):
                    raise CodecError(f".{name} holds {int((~torch.isfinite(v)).sum())} NaN or infinite values")

    @property
    def k_bits(self) -> int:
        """Bits per weight K (an integer for escha)."""
        return int(k_from_width(self.code.shape[2]))

    @property
    def stored_shape(self) -> tuple[int, int]:
        """(k, n): stored input and output features."""
        return self.code.shape[0] * TILE, self.code.shape[1] * TILE

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> EschaTensors:
        """Build from a ``{suffix: tensor}`` dict as read from a pack.

        Raises:
            CodecError: a missing tensor (named), or one the constructor refuses.
        """
        missing = [s for s in (CODE, *IN_SCALES, *OUT_SCALES) if s not in tensors]
        if missing:
            raise CodecError(f"missing {', '.join('.' + m for m in missing)}")
        return cls(
            tensors[CODE],
            tensors["escha_rin"],
            tensors["escha_s_in"],
            tensors["escha_rout"],
            tensors["escha_s_out"],
            tensors.get("bias"),
        )

    def input_scale(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``s_in * rin`` (k,) in ``dtype``: what multiplies the input before its transform."""
        return self.s_in.to(dtype) * self.rin.to(dtype)

    def output_scale(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``rout * s_out`` (n,) in ``dtype``: what multiplies the output after its transform."""
        return self.rout.to(dtype) * self.s_out.to(dtype)


def dequantize(t: EschaTensors, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense ``W (k, n)`` of one escha layer with ``y = x @ W`` (biases not applied).

    ``W = diag(s_in * rin) H What H diag(rout * s_out)`` with ``H`` unnormalized; float32 or float64.
    """
    what = decode_matrix(t.code, CODEBOOK).to(dtype) * (HAD_GAIN * HAD_GAIN)  # had128 is normalized
    w = had128(had128(what, 0), 1)
    return t.input_scale(dtype)[:, None] * w * t.output_scale(dtype)[None, :]


def dense_tensors(tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """One escha module as transformers' linear layer holds it (the ``quantpack.dense_decoders`` entry point:
    ``quantpack verify`` and the reference model): ``weight`` ``(out, in)``, and a zero ``bias`` where the pack stores
    one (escha never applies it, and the model's layer then has one).

    Raises:
        CodecError: a missing or malformed tensor (:meth:`EschaTensors.from_tensors`).
    """
    t = EschaTensors.from_tensors(tensors)
    out = {"weight": dequantize(t, dtype).T.contiguous()}
    if t.bias is not None:
        out["bias"] = torch.zeros(t.bias.shape, dtype=dtype)
    return out


def reference_linear(
    x: torch.Tensor, t: EschaTensors, dtype: torch.dtype = torch.float32, out_features: int | None = None
) -> torch.Tensor:
    """Reference forward of one escha layer: ``H(H((x * s_in) * rin) @ What) * rout * s_out``, no bias.

    Args:
        x: ``(..., in)`` with ``in <= k``; a narrower input is zero-extended.
        t: the layer's tensors.
        dtype: compute dtype (float32 or float64).
        out_features: trim the output to this many columns; default all n.

    Raises:
        CodecError: ``x`` wider than the stored input features.
    """
    k = t.stored_shape[0]
    if x.shape[-1] > k:
        raise CodecError(f"input has {x.shape[-1]} features, the layer stores {k}")
    xf = torch.nn.functional.pad(x.to(dtype), (0, k - x.shape[-1]))
    what = decode_matrix(t.code, CODEBOOK).to(dtype)
    y = had128(had128(xf * t.s_in.to(dtype) * t.rin.to(dtype)) @ what) * (HAD_GAIN * HAD_GAIN)
    y = y * t.rout.to(dtype) * t.s_out.to(dtype)
    return y if out_features is None else y[..., :out_features]


def cut_tensors(t: EschaTensors, cut: TpCut) -> EschaTensors:
    """The rank's escha tensors: whole 128-feature blocks of its :attr:`TpCut.spans`.

    A column cut takes the code's tile columns of every span (a source that spans several output partitions, such
    as a GDN ``in_proj_qkv``, is cut partition by partition) with ``rout`` / ``s_out`` alongside; a row cut takes the
    code's tile rows with ``rin`` / ``s_in``. The bias follows the output side.
    """
    spans = cut.spans
    stored = t.stored_shape[1] if cut.column else t.stored_shape[0]
    if spans == ((0, stored),):
        return t

    def pick(v: torch.Tensor) -> torch.Tensor:
        return torch.cat([v[a:b] for a, b in spans]).contiguous()

    if cut.column:
        code = torch.cat([t.code[:, a // TILE : b // TILE] for a, b in spans], 1).contiguous()
        bias = None if t.bias is None else pick(t.bias)
        return EschaTensors(code, t.rin, t.s_in, pick(t.rout), pick(t.s_out), bias)
    code = torch.cat([t.code[a // TILE : b // TILE] for a, b in spans], 0).contiguous()
    return EschaTensors(code, pick(t.rin), pick(t.s_in), t.rout, t.s_out, t.bias)
