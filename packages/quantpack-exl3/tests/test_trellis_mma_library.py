"""The trellis_mma kernels' library on a machine without a GPU: nvcc compiles ``csrc/trellis_mma.cu`` for sm_90 (a
compile error fails here, before any GPU run), its host-side launch plan (how k is split over CTAs) keeps the rules
the kernels rely on, and a missing compiler or bad geometry gives errors that name the fix. The kernels' numbers are
checked on the GPU (``test_exl3_gpu_kernels.py``)."""

import pytest

from quantpack_exl3.backends.trellis_mma import library
from quantpack_exl3.backends.trellis_mma.ops import COUNTERS, PARTIAL_FLOATS

needs_nvcc = pytest.mark.skipif(library.nvcc_path() is None, reason="needs nvcc (the CUDA toolkit's compiler)")

#: (in, out) shapes of the Llama-3-8B linears, a padded small layer, and the 128-multiple extremes
SHAPES = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096), (4096, 128256), (256, 384), (128, 128)]
ROWS = [1, 7, 16, 17, 64, 100, 512]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    """The library built for sm_90 into a fresh cache (a compile error fails the tests that use it)."""
    import os

    os.environ["QUANTPACK_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    try:
        yield library.load(90)
    finally:
        library.load.cache_clear()
        os.environ.pop("QUANTPACK_CACHE_DIR")


@needs_nvcc
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("target", [1, 264, 528, 4096])
def test_split_plan_covers_k_in_whole_hadamard_blocks(lib, k, n, rows, target):
    """Every split is a whole number of 128-column blocks, the splits cover k exactly once, and a split plan's
    partial sums and counters fit the workspace the op allocates."""
    splits = lib.qp_trellis_mma_splits(rows, k, n, target, PARTIAL_FLOATS, COUNTERS)
    ktiles = k // 16
    assert 1 <= splits <= ktiles // 8
    slice_tiles = (ktiles // 8 + splits - 1) // splits * 8
    assert slice_tiles % 8 == 0
    assert (splits - 1) * slice_tiles < ktiles <= splits * slice_tiles
    if splits > 1:
        chunk_rows = 16 if rows <= 16 else 64
        chunks = -(-rows // chunk_rows)
        assert chunks * splits * min(rows, chunk_rows) * n <= PARTIAL_FLOATS
        assert chunks * (n // 128) <= COUNTERS


@needs_nvcc
def test_split_plan_fills_the_gpu_when_k_allows(lib):
    """One row of a 4096 -> 1024 layer (8 column blocks) is split until about the target number of CTAs."""
    assert lib.qp_trellis_mma_splits(1, 4096, 1024, 264, PARTIAL_FLOATS, COUNTERS) == 32
    assert lib.qp_trellis_mma_splits(1, 4096, 128256, 264, PARTIAL_FLOATS, COUNTERS) == 1


@needs_nvcc
def test_bad_geometry_is_refused_before_any_launch(lib):
    """k or n not a multiple of 128 returns -1 (no CUDA call is made), and check() names it."""
    code = lib.qp_trellis_mma(
        None, None, None, None, None, None, None, 0, None, 0, 1, 100, 100, 100, 256, 256, 0, 256, 2, 8, 0, 264, None
    )
    assert code == -1
    with pytest.raises(library.LibraryError, match="multiples of 128"):
        library.check(code, "test")


def test_missing_nvcc_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("QUANTPACK_NVCC", str(tmp_path / "no-nvcc"))
    monkeypatch.setenv("QUANTPACK_CACHE_DIR", str(tmp_path))
    with pytest.raises(library.LibraryError, match="CUDA_HOME or QUANTPACK_NVCC"):
        library.build(90)
