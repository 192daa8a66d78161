"""quantpack_core's vectorised decoder against the independent scalar decoder (scalar_exl3.py), bit for bit."""

import numpy as np
import pytest
import torch
from scalar_exl3 import codebook_value, decode_tile

from quantpack_core import LEGAL_K, Codebook, codebook_table, decode_tiles, width_from_k
from quantpack_core.codec.trellis import HALF_K

CASES = [(k, cb) for k in LEGAL_K for cb in ("3inst", "mcg", "mul1") if k not in HALF_K or cb == "mul1"]


@pytest.mark.parametrize("codebook", ["3inst", "mcg", "mul1"])
def test_codebook_table_matches_scalar_for_every_state(codebook):
    table = codebook_table(codebook).numpy()
    scalar = np.array([codebook_value(s, codebook) for s in range(65536)], dtype=np.float16)
    assert np.array_equal(table.view(np.uint16), scalar.view(np.uint16))


def test_codebooks_differ_and_are_finite():
    tables = [codebook_table(c) for c in Codebook]
    for t in tables:
        assert torch.isfinite(t.float()).all()
        assert t.float().std() > 0.5
    assert not torch.equal(tables[0], tables[1]) and not torch.equal(tables[1], tables[2])


@pytest.mark.parametrize("k,codebook", CASES, ids=[f"K{k:g}-{cb}" for k, cb in CASES])
def test_decode_tiles_bit_exact(k, codebook):
    g = torch.Generator().manual_seed(int(k * 10) * 7 + len(codebook))
    trellis = torch.randint(-32768, 32768, (2, 3, width_from_k(k)), generator=g, dtype=torch.int32).to(torch.int16)
    fast = decode_tiles(trellis, codebook).numpy()
    for tk in range(2):
        for tn in range(3):
            ref = decode_tile(trellis[tk, tn].tolist(), k, codebook)
            assert np.array_equal(fast[tk, tn].view(np.uint16), ref.view(np.uint16)), (tk, tn)


def test_decode_tiles_edge_patterns():
    """All-zero and all-one words: every state is 0x0000 or 0xFFFF."""
    for k in (2, 3.5, 8):
        width = width_from_k(k)
        for word in (0, -1):
            trellis = torch.full((1, 1, width), word, dtype=torch.int16)
            fast = decode_tiles(trellis, "mul1").numpy()
            ref = decode_tile([word] * width, k, "mul1")
            assert np.array_equal(fast[0, 0].view(np.uint16), ref.view(np.uint16))
