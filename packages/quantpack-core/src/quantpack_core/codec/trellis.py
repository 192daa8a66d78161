"""EXL3 trellis tiles: bitrate K, the tail-biting bitstream, 16-bit states and their tensor-core placement.

One quantized linear layer stores ``trellis`` as int16 of shape ``(k/16, n/16, 16*K)``: one 16x16 tile of the
(Hadamard-domain) weight per ``[tk, tn]``, each a ring of 256*K bits. Follows docs/exl3-format.md (steps 1, 2 and 4
of "The math") and exllamav3's ``exllamav3_ext/quant/exl3_dq.cuh`` / ``frac.cuh`` (half-integer K) and
``exllamav3/modules/quant/exl3_lib/quantize.py`` (``frac_k``, ``trellis_words``).
"""

from __future__ import annotations

import functools

import torch

from ..errors import CodecError
from .codebook import Codebook, codebook_table

TILE = 16
#: weights in one tile
TILE_WEIGHTS = TILE * TILE
#: integer bitrates the kernels accept
INTEGER_K = (1, 2, 3, 4, 5, 6, 7, 8)
#: half-integer bitrates (mul1 codebook only); the tile is then 16*KA + 8 int16 words
HALF_K = (1.5, 2.5, 3.5)
LEGAL_K = tuple(sorted(INTEGER_K + HALF_K))
#: how many tiles to decode at once: the int32 scratch (2 MiB per array) stays in the CPU's caches, which makes the
#: decode 3x faster than with 64 MiB arrays (measured on 2 cores: 0.52 -> 0.18 s for a 2048 x 8192 layer)
DECODE_CHUNK_TILES = 2048


def k_from_width(width: int) -> float:
    """Bits per weight K from the last dimension of a trellis tensor.

    Args:
        width: ``trellis.shape[-1]`` (int16 words per tile).

    Returns:
        K as a float (``4.0``, ``2.5``).

    Raises:
        CodecError: when the width is not ``16*K`` for an integer K in 1..8 nor ``16*KA + 8`` for K in {1.5, 2.5, 3.5}.
    """
    if width % 16 == 0 and width // 16 in INTEGER_K:
        return float(width // 16)
    if width % 16 == 8 and (width - 8) / 16 + 0.5 in HALF_K:
        return (width - 8) / 16 + 0.5
    legal = ", ".join(f"{k:g}->{width_from_k(k)}" for k in LEGAL_K)
    raise CodecError(f"trellis width {width} is not 16*K for a legal K (K->width: {legal})")


def width_from_k(k: float) -> int:
    """int16 words per tile for bitrate K (inverse of :func:`k_from_width`).

    Raises:
        CodecError: for an illegal K.
    """
    if k not in LEGAL_K:
        raise CodecError(f"K={k:g} is not a legal EXL3 bitrate (legal: {', '.join(f'{x:g}' for x in LEGAL_K)})")
    return round(16 * k)


def check_k_codebook(k: float, codebook: Codebook | str) -> None:
    """Half-integer K exists for the mul1 codebook only.

    Raises:
        CodecError: for a half-integer K with 3INST or mcg.
    """
    if k in HALF_K and Codebook.parse(codebook) is not Codebook.MUL1:
        raise CodecError(f"half-integer K={k:g} requires the mul1 codebook, got {Codebook.parse(codebook).value}")


@functools.cache
def state_bit_offsets(k: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each of the 256 states of a tile starts in its bitstream.

    State t is the 16 ring bits ending at ``end(t)`` (exclusive): ``end(t) = (t+1)*K`` for integer K and
    ``(t+1)*KA + (t+1)//2`` for K = KA + 0.5. Bits are read most-significant first across uint32 words.

    Returns:
        ``(word, next_word, shift)``, int64 tensors of shape (256,): the state is
        ``((w[word] << 32 | w[next_word]) >> shift) & 0xFFFF`` with ``w`` the tile's uint32 words.
    """
    width = width_from_k(k)
    ring = 16 * width  # bits
    words = width // 2
    t = torch.arange(1, TILE_WEIGHTS + 1, dtype=torch.int64)
    if k in HALF_K:
        ka = int(k)
        end = t * ka + t // 2
    else:
        end = t * int(k)
    start = (end - 16) % ring
    word = start // 32
    return word, (word + 1) % words, 48 - start % 32


@functools.cache
def tile_placement() -> torch.Tensor:
    """Tensor-core placement of the 256 decoded values in a 16x16 tile.

    Position t -> lane ``u = t // 8``, slot ``j = t % 8``, ``r0 = 2*(u % 4)``, ``c0 = u // 4``; slots 0..7 land at rows
    ``r0, r0+1, r0+8, r0+9`` of column ``c0`` (slots 0..3) and of column ``c0+8`` (slots 4..7).

    Returns:
        int64 tensor of shape (256,): ``placement[r*16 + c]`` is the stream position t whose value sits at row r
        (along k) and column c (along n).
    """
    t = torch.arange(TILE_WEIGHTS, dtype=torch.int64)
    u, j = t // 8, t % 8
    r = 2 * (u % 4) + torch.tensor([0, 1, 8, 9, 0, 1, 8, 9])[j]
    c = u // 4 + torch.tensor([0, 0, 0, 0, 8, 8, 8, 8])[j]
    placement = torch.empty(TILE_WEIGHTS, dtype=torch.int64)
    placement[r * TILE + c] = t
    return placement


@functools.cache
def placed_windows(k: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each weight of a tile finds its state among 16-bit words, indexed by its place in the tile.

    The stream reads the tile's uint32 words most-significant bit first, so it meets the int16 words in the order
    ``u16[1], u16[0], u16[3], u16[2], ...`` (stream half-word ``a`` is ``u16[a ^ 1]``), and a 16-bit state starting at
    stream bit ``s`` lies in the 32-bit window ``S[a] << 16 | S[a + 1]`` of ``a = s // 16`` (mod the ring), shifted
    right by ``16 - s % 16``. Indexing by place (``r * 16 + c``, :func:`tile_placement`) rather than by stream position
    makes one gather land every value where the matrix wants it; int32 windows instead of int64 pairs of uint32 words
    halve the scratch. Same states as :func:`trellis_states`, checked by the tests.

    Returns:
        ``(hi, lo, window, shift)``, int64 tensors: ``hi`` and ``lo`` (``(width,)``) pick the int16 words of window
        ``a`` (``hi[a] = a ^ 1``, ``lo[a] = ((a + 1) % width) ^ 1``); ``window`` and ``shift`` (``(256,)``, by place)
        name the window of each weight and its right shift (1..16).
    """
    width = width_from_k(k)
    word, _, shift64 = state_bit_offsets(k)
    start = 32 * word + 48 - shift64  # the stream bit each state starts at
    a = torch.arange(width, dtype=torch.int64)
    placement = tile_placement()
    return a ^ 1, ((a + 1) % width) ^ 1, (start // 16)[placement], (16 - start % 16)[placement]


def decode_rows(trellis: torch.Tensor, table: torch.Tensor, k: float) -> torch.Tensor:
    """Decode a band of trellis tiles straight into matrix layout, through a lookup table of any dtype.

    Args:
        trellis: int16 tensor ``(kt, nt, 16*K)``: ``kt`` tile rows of ``nt`` tiles (a band of the layer).
        table: ``(65536,)`` value of every state, e.g. :func:`~.codebook.codebook_table` converted once to the
            compute dtype (the conversion of a float16 value is exact for float32 and float64, so the result equals
            :func:`decode_matrix` converted afterwards).
        k: the trellis' bitrate.

    Returns:
        ``(16*kt, 16*nt)`` tensor of ``table``'s dtype, rows = input features.
    """
    hi, lo, window, shift = (x.to(trellis.device) for x in placed_windows(k))
    u = trellis.to(torch.int32).bitwise_and_(0xFFFF)
    # int32 arithmetic: the left shift wraps into the sign bit and the right shift copies it down, but the 16 bits
    # kept (bits shift .. shift + 15, at most bit 31) are the window's own
    w = u[..., hi].bitwise_left_shift_(16).bitwise_or_(u[..., lo])
    kt, nt = trellis.shape[:2]
    # the shift writes its contiguous result in matrix order (tile row, row, tile column, column): the tile ->
    # matrix reorder costs no pass of its own
    placed = w[..., window].view(kt, nt, TILE, TILE).permute(0, 2, 1, 3)
    states = torch.empty((kt, TILE, nt, TILE), dtype=torch.int32, device=trellis.device)
    torch.bitwise_right_shift(placed, shift.to(torch.int32).view(TILE, 1, TILE), out=states)
    return table.index_select(0, states.view(-1).bitwise_and_(0xFFFF)).view(kt * TILE, nt * TILE)


def check_trellis(trellis: torch.Tensor, what: str = "trellis") -> float:
    """Validate a trellis tensor and return its K.

    Args:
        trellis: int16 tensor ``(k/16, n/16, 16*K)``.
        what: name used in error messages.

    Raises:
        CodecError: wrong dtype, wrong rank or illegal width.
    """
    if trellis.dtype != torch.int16:
        raise CodecError(f"{what}: dtype {trellis.dtype}, expected torch.int16")
    if trellis.dim() != 3:
        raise CodecError(f"{what}: shape {tuple(trellis.shape)}, expected 3 dims (k/16, n/16, 16*K)")
    try:
        return k_from_width(trellis.shape[-1])
    except CodecError as e:
        raise CodecError(f"{what}: {e}") from None


def tile_words(trellis: torch.Tensor) -> torch.Tensor:
    """Pair int16 words into the tiles' uint32 words: ``w[j] = u16[2j] | u16[2j+1] << 16``.

    Args:
        trellis: int16 tensor ``(..., 16*K)``.

    Returns:
        int64 tensor ``(..., 8*K)`` holding values in 0..2^32-1.
    """
    u = trellis.to(torch.int64) & 0xFFFF
    return u[..., 0::2] | (u[..., 1::2] << 16)


def trellis_states(trellis: torch.Tensor, k: float | None = None) -> torch.Tensor:
    """The 256 16-bit states of every tile, in stream order.

    Args:
        trellis: int16 tensor ``(..., 16*K)`` (any leading shape).
        k: bitrate; derived from the width when omitted.

    Returns:
        int64 tensor ``(..., 256)``, values in 0..65535.

    Raises:
        CodecError: illegal width.
    """
    k = k_from_width(trellis.shape[-1]) if k is None else k
    word, nxt, shift = (x.to(trellis.device) for x in state_bit_offsets(k))
    w = tile_words(trellis)
    v = (w[..., word] << 32) | w[..., nxt]
    return (v >> shift) & 0xFFFF


def decode_tiles(trellis: torch.Tensor, codebook: Codebook | str, k: float | None = None) -> torch.Tensor:
    """Decode trellis tiles to their 16x16 fp16 values (Hadamard domain, before suh/svh).

    Args:
        trellis: int16 tensor ``(kt, nt, 16*K)``.
        codebook: the tensor's codebook.
        k: bitrate; derived from the width when omitted.

    Returns:
        float16 tensor ``(kt, nt, 16, 16)``; ``[tk, tn, r, c]`` is the weight at row ``16*tk + r`` (input feature)
        and column ``16*tn + c`` (output feature).

    Raises:
        CodecError: illegal width, or half-integer K with a codebook other than mul1.
    """
    k = check_trellis(trellis) if k is None else k
    check_k_codebook(k, codebook)
    table = codebook_table(codebook, trellis.device)
    placement = tile_placement().to(trellis.device)
    lead = trellis.shape[:-1]
    flat = trellis.reshape(-1, trellis.shape[-1])
    out = torch.empty((flat.shape[0], TILE_WEIGHTS), dtype=torch.float16, device=trellis.device)
    for a in range(0, flat.shape[0], DECODE_CHUNK_TILES):
        states = trellis_states(flat[a : a + DECODE_CHUNK_TILES], k)
        out[a : a + DECODE_CHUNK_TILES] = table[states][:, placement]
    return out.view(*lead, TILE, TILE)


def tiles_to_matrix(tiles: torch.Tensor) -> torch.Tensor:
    """Assemble ``(kt, nt, 16, 16)`` tiles into the ``(16*kt, 16*nt)`` matrix (rows = input features)."""
    kt, nt = tiles.shape[:2]
    return tiles.permute(0, 2, 1, 3).reshape(kt * TILE, nt * TILE)


def decode_matrix(trellis: torch.Tensor, codebook: Codebook | str) -> torch.Tensor:
    """Decode a whole trellis tensor to the Hadamard-domain weight ``What``.

    Args:
        trellis: int16 tensor ``(k/16, n/16, 16*K)``.
        codebook: the tensor's codebook.

    Returns:
        float16 tensor ``(k, n)``.
    """
    return tiles_to_matrix(decode_tiles(trellis, codebook))
