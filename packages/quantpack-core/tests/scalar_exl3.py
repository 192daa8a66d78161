"""An independent, deliberately slow scalar EXL3 decoder written from docs/exl3-format.md alone.

It shares no code with quantpack_core: plain Python integers, one bit at a time, numpy for the fp16 rounding. The
tests compare quantpack_core's vectorised decoder against it bit for bit.
"""

from __future__ import annotations

import numpy as np


def f16(bits: int) -> float:
    """The value of a 16-bit fp16 pattern."""
    return float(np.array([bits], dtype=np.uint16).view(np.float16)[0])


def round_f16(x: float) -> float:
    return float(np.float16(x))


def codebook_value(state: int, codebook: str) -> float:
    """Step 3 of the format doc, with Python's exact integers and floats."""
    if codebook == "mul1":
        x = (state * 0x83DCD12D) % (1 << 32)
        b = sum((x >> (8 * i)) & 0xFF for i in range(4))
        return round_f16((1024 + b) * f16(0x1EEE) + f16(0xC931))
    x = (state * 0xCBAC1FED) % (1 << 32) if codebook == "mcg" else (state * 89226354 + 64248484) % (1 << 32)
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    return round_f16(f16(x & 0xFFFF) + f16(x >> 16))


def tile_bits(words: list[int]) -> list[int]:
    """Step 1: pair int16 words into uint32 (low word first) and read the bits most-significant first."""
    u16 = [w & 0xFFFF for w in words]
    bits = []
    for j in range(len(u16) // 2):
        w32 = u16[2 * j] | (u16[2 * j + 1] << 16)
        bits.extend((w32 >> (31 - i)) & 1 for i in range(32))
    return bits


def end_bit(t: int, k: float) -> int:
    """Step 2: where state t ends in the ring."""
    if float(k).is_integer():
        return (t + 1) * int(k)
    ka = int(k)
    return (t + 1) * ka + (t + 1) // 2


def tile_states(words: list[int], k: float) -> list[int]:
    bits = tile_bits(words)
    ring = len(bits)
    assert ring == round(256 * k)
    states = []
    for t in range(256):
        e = end_bit(t, k)
        s = 0
        for i in range(16):
            s = (s << 1) | bits[(e - 16 + i) % ring]
        states.append(s)
    return states


def place(t: int) -> tuple[int, int]:
    """Step 4: the (row, column) of position t in its 16x16 tile."""
    u, j = t // 8, t % 8
    r0, c0 = 2 * (u % 4), u // 4
    offsets = [(0, 0), (1, 0), (8, 0), (9, 0), (0, 8), (1, 8), (8, 8), (9, 8)]
    dr, dc = offsets[j]
    return r0 + dr, c0 + dc


def decode_tile(words: list[int], k: float, codebook: str) -> np.ndarray:
    """One tile -> (16, 16) float16 array, row = input feature, column = output feature."""
    out = np.zeros((16, 16), dtype=np.float16)
    for t, s in enumerate(tile_states(words, k)):
        r, c = place(t)
        out[r, c] = codebook_value(s, codebook)
    return out
