"""The row-ring codec of n-gram tables (:mod:`quantpack_core.codec.ring`): against a decoder written bit by bit from
docs/exl3-format.md ("Row rings") in plain Python integers, packed and unpacked round trips, the errors; and, where
exllamav3's wheel is installed (the GPU tier), bit for bit against exllamav3 1.6.5's own n-gram codec."""

import importlib.util
from pathlib import Path

import pytest
import torch

from quantpack_core.codec import codebook_values
from quantpack_core.codec.ring import (
    NGRAM_ROW_DIM,
    decode_ring_rows,
    pack_ring_rows,
    ring_dim,
    ring_words,
    states_from_symbols,
    unpack_ring_rows,
)
from quantpack_core.errors import CodecError


def random_rows(rows: int, k_bits: int, dim: int = NGRAM_ROW_DIM, seed: int = 0):
    """Random symbols (every bit pattern is a legal ring) and scales of a real table's size."""
    g = torch.Generator().manual_seed(seed)
    symbols = torch.randint(0, 1 << k_bits, (rows, dim), generator=g)
    scales = (torch.rand(rows, generator=g) * 0.05 + 0.001).half()
    return symbols, scales


def reference_row(words: list[int], k_bits: int) -> list[float]:
    """One packed row decoded from the format's description alone, bit by bit, in float64."""
    u16 = [w & 0xFFFF for w in words]
    scale = torch.tensor([u16[0]], dtype=torch.int32).to(torch.int16).view(torch.float16).item()
    ring = u16[1:]
    dim = len(ring) * 16 // k_bits

    def bit(b: int) -> int:  # stream bit b: bit b % 16 of ring word b // 16
        return (ring[b // 16] >> (b % 16)) & 1

    symbol = [sum(bit(i * k_bits + t) << t for t in range(k_bits)) for i in range(dim)]
    out = []
    for i in range(dim):
        state, back = 0, 0
        while back * k_bits < 16:  # position i's symbol lowest, then i - 1, ... around the ring
            state |= symbol[(i - back) % dim] << (back * k_bits)
            back += 1
        value = codebook_values(torch.tensor([state & 0xFFFF]), "mul1").double().item()
        out.append(value * scale)
    return out


@pytest.mark.parametrize("k_bits", range(1, 9))
def test_decode_matches_the_bitwise_reference(k_bits):
    symbols, scales = random_rows(3, k_bits, seed=k_bits)
    packed = pack_ring_rows(symbols, scales, k_bits)
    assert packed.dtype == torch.int16 and packed.shape == (3, ring_words(k_bits))
    got = decode_ring_rows(packed, k_bits)
    assert got.dtype == torch.float32 and got.shape == (3, NGRAM_ROW_DIM)
    for r in range(3):
        ref = torch.tensor(reference_row(packed[r].tolist(), k_bits), dtype=torch.float64)
        assert torch.allclose(got[r].double(), ref, rtol=1e-7, atol=0), (k_bits, r)


@pytest.mark.parametrize("k_bits", [2, 3, 4])
def test_round_trip_and_bias(k_bits):
    """Symbols and scales come back exactly; a row's value is the codebook at its stacked state times its scale, plus
    the head bias."""
    symbols, scales = random_rows(5, k_bits, dim=96, seed=10 + k_bits)
    packed = pack_ring_rows(symbols, scales, k_bits)
    back, back_scales = unpack_ring_rows(packed, k_bits)
    assert torch.equal(back, symbols) and torch.equal(back_scales, scales)
    bias = torch.randn(96)
    table = codebook_values(states_from_symbols(symbols, k_bits), "mul1").float()
    want = table * scales.float()[:, None] + bias
    assert torch.equal(decode_ring_rows(packed, k_bits, bias), want)


def test_states_stack_the_preceding_symbols_around_the_ring():
    """K=4: state i holds symbols i, i-1, i-2, i-3 from bit 0 up; position 0 reaches back to the row's end."""
    symbols = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    states = states_from_symbols(symbols, 4)
    assert states[0, 3].item() == 0x1234 and states[0, 0].item() == 0x6781
    assert states_from_symbols(symbols, 3)[0, 5].item() == (6 | 5 << 3 | 4 << 6 | 3 << 9 | 2 << 12 | 1 << 15) & 0xFFFF


def test_bad_rows_are_named():
    with pytest.raises(CodecError, match=r"K in 1\.\.8 and dim \* K a multiple of 16, got K=3, dim=100"):
        ring_words(3, 100)
    with pytest.raises(CodecError, match="31 words are no ring row of K=7"):
        ring_dim(31, 7)
    with pytest.raises(CodecError, match=r"ring rows are 2-D int16, got torch\.int32"):
        unpack_ring_rows(torch.zeros((2, 41), dtype=torch.int32), 4)
    symbols, scales = random_rows(2, 4)
    with pytest.raises(CodecError, match="2 ring rows need 2 scales, got \\[3\\]"):
        pack_ring_rows(symbols, torch.ones(3), 4)
    with pytest.raises(CodecError, match="a bias of width 7 for ring rows of 160 positions"):
        decode_ring_rows(pack_ring_rows(symbols, scales, 4), 4, torch.zeros(7))


def exllamav3_ngram_codec():
    """exllamav3 1.6.5's n-gram codec module, loaded by file path (it imports only torch), or None."""
    spec = importlib.util.find_spec("exllamav3")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "modules" / "quant" / "exl3_lib" / "ngram_codec.py"
    if not path.exists():
        return None
    module_spec = importlib.util.spec_from_file_location("exl3_ngram_codec", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.mark.gpu
@pytest.mark.parametrize("k_bits", range(1, 9))
def test_bit_for_bit_with_exllamav3s_codec(k_bits):
    """Where exllamav3's wheel is installed (the GPU tier's machine; no GPU used): its packing equals ours, and its
    states, scales and dequantized rows (with a per-row bias) equal ours exactly."""
    codec = exllamav3_ngram_codec()
    if codec is None:
        pytest.skip("exllamav3 is not installed here (the GPU tier installs its wheel)")
    symbols, scales = random_rows(7, k_bits, seed=40 + k_bits)
    states = states_from_symbols(symbols, k_bits)
    ours = pack_ring_rows(symbols, scales, k_bits)
    assert torch.equal(codec.pack_rows(states, scales, k_bits), ours)
    their_states, their_scales = codec.unpack_rows(ours, k_bits)
    assert torch.equal(their_states, states) and torch.equal(their_scales, scales)
    bias = torch.randn((7, NGRAM_ROW_DIM)).half()
    theirs = codec.dequant_rows(ours, k_bits, codec.mul1_codebook("cpu"), bias=bias)
    assert torch.equal(decode_ring_rows(ours, k_bits, bias), theirs)
