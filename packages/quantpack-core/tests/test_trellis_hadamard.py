import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantpack_core import CodecError, GeometryError, had128, hadamard_matrix, k_from_width, width_from_k
from quantpack_core.codec.trellis import LEGAL_K, tile_placement


@pytest.mark.parametrize("k", LEGAL_K)
def test_width_roundtrip(k):
    assert k_from_width(width_from_k(k)) == k


@pytest.mark.parametrize("width", [0, 8, 15, 17, 24 + 64, 136, 144, 16 * 9, 16 * 4 + 8])
def test_illegal_widths_raise(width):
    with pytest.raises(CodecError, match="not 16\\*K"):
        k_from_width(width)


def test_placement_is_a_permutation():
    p = tile_placement()
    assert sorted(p.tolist()) == list(range(256))


def test_hadamard_is_orthogonal_and_sylvester():
    h = hadamard_matrix(128, torch.float64)
    assert torch.allclose(h @ h, torch.eye(128, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(h, h.T)
    assert torch.allclose(h[0], torch.full((128,), 1 / math.sqrt(128), dtype=torch.float64))
    h2 = hadamard_matrix(2, torch.float64) * math.sqrt(2)
    assert h2.tolist() == [[1, 1], [1, -1]]


@settings(max_examples=25, deadline=None)
@given(blocks=st.integers(1, 4), rows=st.integers(1, 5), seed=st.integers(0, 2**31))
def test_had128_equals_block_diagonal_matmul(blocks, rows, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 128 * blocks, generator=g, dtype=torch.float64)
    h = torch.block_diag(*[hadamard_matrix(128, torch.float64)] * blocks)
    assert torch.allclose(had128(x), x @ h, atol=1e-12)
    assert torch.allclose(had128(x.T.contiguous(), 0), (x @ h).T, atol=1e-12)


def test_had128_rejects_unaligned():
    with pytest.raises(GeometryError, match="multiple of 128"):
        had128(torch.zeros(2, 200))
