"""The three EXL3 codebooks: a 16-bit trellis state -> one fp16 weight value.

EXL3 uses a computed codebook (no stored table): the state is hashed by a 32-bit multiply and the bits are read back
as half-precision numbers. Follows docs/exl3-format.md ("Codebook value of a 16-bit state") and exllamav3's
``exllamav3_ext/quant/codebook.cuh`` / ``exllamav3/modules/quant/exl3_lib/quantize.py`` (the multipliers).

A 65536-entry table per codebook turns decoding into a gather; :func:`codebook_table` builds it once per process.
"""

from __future__ import annotations

import enum
import functools

import torch

from ..errors import CodecError

MASK32 = 0xFFFFFFFF

#: 3INST: x = s * 89226354 + 64248484 (mod 2^32).
INST3_MULT = 89226354
INST3_ADD = 64248484
#: mcg: x = s * 0xCBAC1FED (mod 2^32).
MCG_MULT = 0xCBAC1FED
#: mul1: x = s * 0x83DCD12D (mod 2^32).
MUL1_MULT = 0x83DCD12D

#: Mask and xor applied to both 16-bit halves of x for 3INST and mcg: they pin the fp16 exponent to [-3, 0].
HALF_MASK = 0x8FFF8FFF
HALF_XOR = 0x3B603B60

#: mul1 affine map of the byte sum b: value = (1024 + b) * MUL1_SCALE + MUL1_BIAS, fp16 bit patterns.
MUL1_SCALE_BITS = 0x1EEE  # 0.00676727294921875
MUL1_BIAS_BITS = 0xC931  # -10.3828125


class Codebook(enum.StrEnum):
    """Which codebook a tensor uses; the pack marks it with a 0-d int32 tensor (``.mcg`` / ``.mul1``) whose value is
    the multiplier, and no marker means 3INST."""

    INST3 = "3inst"
    MCG = "mcg"
    MUL1 = "mul1"

    @property
    def marker(self) -> str | None:
        """Suffix of the marker tensor in a pack (None for 3INST, which has none)."""
        return None if self is Codebook.INST3 else self.value

    @property
    def kernel_id(self) -> int:
        """The id the CUDA kernels take for it (trellis_mma's and exllamav3's): 0 = 3INST, 1 = mcg, 2 = mul1."""
        return {Codebook.INST3: 0, Codebook.MCG: 1, Codebook.MUL1: 2}[self]

    @property
    def multiplier(self) -> int:
        """The 32-bit multiplier of the state hash (also the value the pack's marker tensor holds)."""
        return {Codebook.INST3: INST3_MULT, Codebook.MCG: MCG_MULT, Codebook.MUL1: MUL1_MULT}[self]

    @classmethod
    def parse(cls, name: str | Codebook) -> Codebook:
        """Accept ``"3inst"``, ``"mcg"``, ``"mul1"`` (any case) or a Codebook.

        Raises:
            CodecError: for any other name.
        """
        if isinstance(name, Codebook):
            return name
        try:
            return cls(str(name).lower())
        except ValueError:
            raise CodecError(f"unknown EXL3 codebook {name!r}: expected one of 3inst, mcg, mul1") from None

    @classmethod
    def from_markers(cls, mcg: bool, mul1: bool) -> Codebook:
        """Codebook from which marker tensors a layer has.

        Raises:
            CodecError: when both markers are present (a pack can only use one codebook per tensor).
        """
        if mcg and mul1:
            raise CodecError("both .mcg and .mul1 markers present: a tensor uses exactly one codebook")
        return cls.MCG if mcg else cls.MUL1 if mul1 else cls.INST3


def _f16_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """int64 tensor of 16-bit patterns (0..65535) -> float32 tensor of the fp16 values they encode."""
    signed = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16)
    return signed.view(torch.float16).to(torch.float32)


def codebook_values(states: torch.Tensor, codebook: Codebook | str) -> torch.Tensor:
    """Decode 16-bit trellis states with one codebook, without a table.

    Args:
        states: integer tensor of any shape, values in 0..65535.
        codebook: which codebook.

    Returns:
        float16 tensor, same shape as ``states``.

    Every intermediate is exact: for 3INST/mcg both halves have exponents in [-3, 0], so their fp32 sum is exact and
    the single fp16 rounding matches the kernels' half addition; for mul1 the affine value is a multiple of 2^-18
    below 16 in magnitude, exact in fp32, rounded once to fp16.
    """
    cb = Codebook.parse(codebook)
    s = states.to(torch.int64)
    if cb is Codebook.MUL1:
        x = (s * MUL1_MULT) & MASK32
        b = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + ((x >> 24) & 0xFF)
        scale = _f16_from_bits(torch.tensor(MUL1_SCALE_BITS))
        bias = _f16_from_bits(torch.tensor(MUL1_BIAS_BITS))
        return ((1024 + b).to(torch.float32) * scale + bias).to(torch.float16)
    if cb is Codebook.MCG:
        x = (s * MCG_MULT) & MASK32
    else:
        x = (s * INST3_MULT + INST3_ADD) & MASK32
    x = (x & HALF_MASK) ^ HALF_XOR
    lo = _f16_from_bits(x & 0xFFFF)
    hi = _f16_from_bits(x >> 16)
    return (lo + hi).to(torch.float16)


@functools.cache
def _table_cpu(codebook: Codebook) -> torch.Tensor:
    return codebook_values(torch.arange(65536, dtype=torch.int64), codebook)


def codebook_table(codebook: Codebook | str, device: torch.device | str | None = None) -> torch.Tensor:
    """The 65536-entry lookup table of a codebook.

    Args:
        codebook: which codebook.
        device: where the table should live (default CPU). CPU tables are cached per process.

    Returns:
        float16 tensor of shape (65536,): ``table[s]`` is the value of state ``s``.
    """
    t = _table_cpu(Codebook.parse(codebook))
    return t if device is None or torch.device(device).type == "cpu" else t.to(device)
