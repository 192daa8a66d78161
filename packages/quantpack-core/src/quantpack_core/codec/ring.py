"""exllamav3's row codec for embedding-like tables: each row one tail-biting trellis ring over the mul1 codebook with
an fp16 scale (the hashed n-gram table of Qwen3.8-Flash-Next's per-layer embedding, ``ngram_embedding.safetensors``).

A packed row is ``1 + dim * K / 16`` little-endian uint16 words, stored as int16: word 0 is the fp16 scale's bit
pattern, the other words a ring of ``dim * K`` bits in which stream bits ``[i*K, (i+1)*K)`` (bit ``b`` is bit ``b %
16`` of word ``b // 16``) are the *symbol* of position ``i``: the low K bits of its 16-bit trellis state. The state's
higher bits are the symbols of the positions before it, K bits each, counted around the ring (tail-biting), so state
``i = sum_j symbol[(i - j) mod dim] << (j * K)`` truncated to 16 bits. An n-gram row is then ``value[i] =
mul1(state[i]) * scale + head_bias[head][i]`` (float32), 160 wide. This differs from the linear layers' tiles
(:mod:`.trellis`: read most-significant bit first, 256 positions per tile).

Everything here is plain torch on any device and decodes only the rows it is given (the real table has 320 M rows).
Source: docs/exl3-format.md ("Row rings"), which follows exllamav3 1.6.5's n-gram codec
(``exllamav3/modules/quant/exl3_lib/ngram_codec.py``); ``tests/test_ring_codec.py`` checks this module against it bit
for bit where exllamav3's wheel is installed.
"""

from __future__ import annotations

import torch

from ..errors import CodecError
from .codebook import Codebook, codebook_table

#: positions of one n-gram row (one hash head's embedding slice)
NGRAM_ROW_DIM = 160
#: symbol widths K a ring may have (bits per weight)
RING_K = tuple(range(1, 9))


def ring_words(k_bits: int, dim: int = NGRAM_ROW_DIM) -> int:
    """int16 words of one packed row: the scale and ``dim * K / 16`` ring words.

    Raises:
        CodecError: K not in 1..8, or ``dim * K`` not a whole number of 16-bit words.
    """
    if k_bits not in RING_K or (dim * k_bits) % 16:
        raise CodecError(f"a ring row needs K in 1..8 and dim * K a multiple of 16, got K={k_bits}, dim={dim}")
    return 1 + dim * k_bits // 16


def ring_dim(words: int, k_bits: int) -> int:
    """Positions of a packed row of ``words`` int16 words at K bits per position.

    Raises:
        CodecError: a width that no whole ring of K-bit positions fills.
    """
    if k_bits not in RING_K or words < 2 or ((words - 1) * 16) % k_bits:
        raise CodecError(f"{words} words are no ring row of K={k_bits} (1 scale word + dim * K / 16 ring words)")
    return (words - 1) * 16 // k_bits


def states_from_symbols(symbols: torch.Tensor, k_bits: int) -> torch.Tensor:
    """The 16-bit trellis states of rows of ring symbols: position ``i`` stacks the symbols of ``i, i - 1, ...``
    (mod the row length) from bit 0 up, K bits each.

    Args:
        symbols: ``(rows, dim)`` integers in ``0 .. 2^K - 1``.

    Returns:
        int64 ``(rows, dim)`` states in ``0 .. 65535``.
    """
    symbols = symbols.to(torch.int64)
    states = torch.zeros_like(symbols)
    for back in range(-(-16 // k_bits)):  # ceil(16 / K) positions reach bit 15
        states |= torch.roll(symbols, shifts=back, dims=-1) << (back * k_bits)
    return states & 0xFFFF


def pack_ring_rows(symbols: torch.Tensor, scales: torch.Tensor, k_bits: int) -> torch.Tensor:
    """Pack rows of symbols and their scales into the stored layout (the writer of test packs).

    Args:
        symbols: ``(rows, dim)`` integers; only their low K bits are kept.
        scales: ``(rows,)`` row scales, rounded to float16.
        k_bits: K, 1..8.

    Returns:
        int16 ``(rows, 1 + dim * K / 16)``.

    Raises:
        CodecError: as :func:`ring_words`, or scales that do not match the rows.
    """
    rows, dim = symbols.shape
    words = ring_words(k_bits, dim)
    if scales.shape != (rows,):
        raise CodecError(f"{rows} ring rows need {rows} scales, got {list(scales.shape)}")
    sym = symbols.to(torch.int64) & ((1 << k_bits) - 1)
    bits = (sym.unsqueeze(-1) >> torch.arange(k_bits, device=sym.device)) & 1  # (rows, dim, K), low bit first
    bits = bits.reshape(rows, words - 1, 16)
    packed = (bits << torch.arange(16, device=sym.device)).sum(-1)
    packed = torch.where(packed >= 0x8000, packed - 0x10000, packed).to(torch.int16)
    scale_words = scales.to(torch.float16).view(torch.int16).unsqueeze(1)
    return torch.cat([scale_words, packed], dim=1)


def unpack_ring_rows(packed: torch.Tensor, k_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symbols and scales of packed rows.

    Args:
        packed: int16 ``(rows, words)``.

    Returns:
        ``(symbols, scales)``: int64 ``(rows, dim)`` and float16 ``(rows,)``.

    Raises:
        CodecError: a tensor that is not 2-D int16 of a ring width for K.
    """
    if packed.dtype != torch.int16 or packed.dim() != 2:
        raise CodecError(f"ring rows are 2-D int16, got {packed.dtype} {list(packed.shape)}")
    dim = ring_dim(packed.shape[1], k_bits)
    scales = packed[:, 0].contiguous().view(torch.float16)
    stream = packed[:, 1:].to(torch.int64) & 0xFFFF  # the uint16 words
    nwords = stream.shape[1]
    first = torch.arange(dim, device=packed.device) * k_bits  # first stream bit of each position
    word = first // 16
    # a symbol spans at most two words: read both (the next one around the ring) and shift
    window = stream[:, word] | (stream[:, (word + 1) % nwords] << 16)
    symbols = (window >> (first % 16)) & ((1 << k_bits) - 1)
    return symbols, scales


def decode_ring_rows(packed: torch.Tensor, k_bits: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Values of packed rows: ``mul1(state) * scale (+ bias)``, in float32.

    Args:
        packed: int16 ``(rows, words)`` (only the rows to decode: a gather's rows).
        k_bits: K of the table, 1..8.
        bias: optional ``(rows, dim)`` or ``(dim,)`` additive term (an n-gram table's ``head_bias`` of each row's
            head), any float dtype.

    Returns:
        float32 ``(rows, dim)``.

    Raises:
        CodecError: as :func:`unpack_ring_rows`, or a bias of another width.
    """
    symbols, scales = unpack_ring_rows(packed, k_bits)
    states = states_from_symbols(symbols, k_bits)
    table = codebook_table(Codebook.MUL1, packed.device)
    values = table[states].to(torch.float32) * scales.to(torch.float32).unsqueeze(1)
    if bias is not None:
        if bias.shape[-1] != values.shape[1]:
            raise CodecError(f"a bias of width {bias.shape[-1]} for ring rows of {values.shape[1]} positions")
        values = values + bias.to(torch.float32)
    return values
