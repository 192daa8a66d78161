"""The trellis_mma kernels' library on a machine without a GPU: nvcc compiles ``csrc/`` for sm_90 (a
compile error fails here, before any GPU run); the kernels' own decode (window, state extraction, codebook hash,
fp16 arithmetic, fragment placement), built for the host from the same source, equals the project's codec bit for
bit on random tiles of every K and codebook; the host-side launch plan (how k is split over CTAs) keeps the rules the
kernels rely on; a missing compiler or bad geometry gives errors that name the fix. The kernels' results as a whole
are checked on the GPU (quantpack-exl3's ``test_exl3_gpu_kernels.py``)."""

import ctypes

import pytest
import torch
from hypothesis import given
from hypothesis import settings as examples
from hypothesis import strategies as st

from quantpack_core.codec import Codebook
from quantpack_core.codec.trellis import HALF_K, LEGAL_K, decode_tiles, tile_words, width_from_k
from quantpack_core.trellis_mma import library, settings
from quantpack_core.trellis_mma.ops import COUNTERS, PARTIAL_FLOATS

#: partial rows a column block's last CTA sums at most (TAIL_ROWS in csrc/common.cuh)
TAIL_ROWS = 128

needs_nvcc = pytest.mark.skipif(library.nvcc_path() is None, reason="needs nvcc (the CUDA toolkit's compiler)")

#: (in, out) shapes of the Llama-3-8B linears, a padded small layer, and the 128-multiple extremes
SHAPES = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096), (4096, 128256), (256, 384), (128, 128)]
ROWS = [1, 7, 16, 17, 64, 100, 512]


@pytest.fixture(scope="module")
def lib():
    """The library built for sm_90 (a compile error fails the tests that use it). The build cache is the user's
    (``library.cache_dir``): its key is the source's hash with nvcc's version and flags, so a cached library is this
    very source compiled, and the matrix's sessions compile it once between them (1-2 minutes on 2 cores)."""
    try:
        yield library.load(90)
    finally:
        library.load.cache_clear()


DECODE_CASES = [(k, cb.value) for k in LEGAL_K for cb in Codebook if k not in HALF_K or cb == "mul1"]


@needs_nvcc
@pytest.mark.parametrize("k_bits,codebook", DECODE_CASES, ids=[f"K{k:g}-{cb}" for k, cb in DECODE_CASES])
def test_kernel_decode_equals_the_codec(lib, k_bits, codebook):
    """64 random tiles (every bit pattern is a legal trellis) plus the all-zero and all-one tiles."""
    g = torch.Generator().manual_seed(int(k_bits * 10) + Codebook(codebook).kernel_id)
    width = width_from_k(k_bits)
    tiles = torch.randint(-(1 << 15), 1 << 15, (66, 1, width), generator=g, dtype=torch.int32).to(torch.int16)
    tiles[64], tiles[65] = 0, -1
    want = decode_tiles(tiles, codebook, k_bits).view(torch.int16).reshape(66, 256)
    words = tile_words(tiles).reshape(66, -1).to(torch.int64)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).contiguous()
    got = torch.empty((66, 256), dtype=torch.int16)
    for t in range(66):
        code = lib.qp_decode_tile_host(
            ctypes.c_void_p(words[t].data_ptr()), Codebook(codebook).kernel_id, round(2 * k_bits),
            ctypes.c_void_p(got[t].data_ptr()),
        )  # fmt: skip
        assert code == 0
    assert torch.equal(got, want), (got != want).nonzero()[:5]


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
        if rows <= 16:
            assert splits * rows <= TAIL_ROWS  # what a column block's last CTA sums stays small


@needs_nvcc
def test_split_plan_fills_the_gpu_when_k_allows(lib):
    """One row of a 4096 -> 1024 layer (8 column blocks) is split until about the target number of CTAs."""
    assert lib.qp_trellis_mma_splits(1, 4096, 1024, 264, PARTIAL_FLOATS, COUNTERS) == 32
    assert lib.qp_trellis_mma_splits(1, 4096, 128256, 264, PARTIAL_FLOATS, COUNTERS) == 1
    # whole waves: 112 column blocks (14336 columns) at 528 slots take 4 splits (448 CTAs), not 5 (560: a second wave)
    assert lib.qp_trellis_mma_splits(1, 4096, 14336, 528, PARTIAL_FLOATS, COUNTERS) == 4
    # 16 rows: at most 128 partial rows per column block (8 splits), however few the column blocks
    assert lib.qp_trellis_mma_splits(16, 4096, 1024, 264, PARTIAL_FLOATS, COUNTERS) == 8


@needs_nvcc
def test_bad_geometry_is_refused_before_any_launch(lib):
    """k or n not a multiple of 128 returns -1 (no CUDA call is made), and check() names it."""
    ptrs, ints = ctypes.c_void_p * 1, ctypes.c_int * 1
    code = lib.qp_trellis_mma(
        None, None, ptrs(None), ptrs(None), ptrs(None), ints(256), ints(0), ints(256), 1,
        None, None, 0, None, 0, 1, 100, 100, 100, 256, 2, 8, 0, 264, 16, None,
    )  # fmt: skip
    assert code == -1
    with pytest.raises(library.LibraryError, match="multiples of 128"):
        library.check(code, "test")


@needs_nvcc
@pytest.mark.parametrize("shards,rows", [(9, 1), (9, 64), (0, 1)])
def test_shard_table_limits_are_refused_before_any_launch(lib, shards, rows):
    """One launch runs 1..8 shards at any row count: anything else returns -5 before any CUDA call."""
    ptrs, ints = ctypes.c_void_p * 9, ctypes.c_int * 9
    code = lib.qp_trellis_mma(
        None, None, ptrs(), ptrs(), ptrs(), ints(*[256] * 9), ints(), ints(*[256] * 9), shards,
        None, None, 0, None, 0, rows, 256, 256, 256, 512, 2, 8, 0, 264, 16, None,
    )  # fmt: skip
    assert code == -5
    with pytest.raises(library.LibraryError, match="1-8 shards"):
        library.check(code, "test")


def test_missing_nvcc_names_the_fix(tmp_path):
    with settings.using(nvcc=str(tmp_path / "no-nvcc"), cache_dir=tmp_path):
        with pytest.raises(library.LibraryError, match="CUDA_HOME or QUANTPACK_NVCC"):
            library.build(90)


def test_a_library_at_its_key_is_used_without_building(tmp_path):
    """build() returns a library found at library_path() (what ci/gpu/stage.sh stages from another machine with the
    same compiler) without running the compiler; another compiler's --version output keys another path."""
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo 'release 13.0, V13.0.88'; exit 0; }\nexit 7\n")
    nvcc.chmod(0o755)
    with settings.using(cache_dir=tmp_path / "cache"):
        _check_the_key(nvcc, tmp_path)


def _check_the_key(nvcc, tmp_path) -> None:
    target = library.library_path(90, str(nvcc))
    assert target.parent == tmp_path / "cache" and target.name.startswith("trellis_mma-sm90-")
    with pytest.raises(library.LibraryError, match="building its kernels failed"):
        library.build(90, str(nvcc))  # nothing there: the stand-in compiler is run and fails
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(b"staged")
    assert library.build(90, str(nvcc)) == target  # found: the compiler is not run
    assert library.library_path(91, str(nvcc)) != target
    nvcc.write_text("#!/bin/sh\necho 'release 13.1, V13.1.0'\n")
    assert library.library_path(90, str(nvcc)) != target


def test_row_buckets_and_their_codes():
    """Calls fall into the power-of-two row buckets (the last one open-ended), and a run's bucket_kernels holds one
    3-bit code per bucket."""
    from quantpack_core.trellis_mma.ops import (
        DELEGATE,
        ROW_BUCKETS,
        SPLIT,
        TC256,
        bucket_kernels_of,
        kernel_of,
        row_bucket,
    )

    for rows in range(1, 5000):
        i = row_bucket(rows)
        low = ROW_BUCKETS[i - 1] + 1 if i else 1
        assert low <= rows and (rows <= ROW_BUCKETS[i] or i == len(ROW_BUCKETS) - 1), rows
    codes = [SPLIT] * 5 + [DELEGATE] * 2 + [TC256] * 5
    packed = bucket_kernels_of(codes)
    assert [kernel_of(packed, bound) for bound in ROW_BUCKETS] == codes
    assert kernel_of(packed, 10**6) == TC256 and kernel_of(packed, 17) == DELEGATE and kernel_of(packed, 16) == SPLIT


def test_the_options_of_each_bucket_under_the_settings():
    """Which kernels may serve a row bucket: up to 16 rows the split-K kernel; above, the split-K kernel, on Hopper the
    tensor-core one at every row count per CTA up to the bucket's, from 1024 rows the dense route (timed at load),
    or one of them where QUANTPACK_TRELLIS_MMA_WIDE_KERNEL says (the tensor-core kernel only on Hopper); a delegate
    is timed beside them unless QUANTPACK_TRELLIS_MMA_DELEGATE_ROWS is set, which then sends exactly the buckets
    whose smallest row count exceeds it (a threshold above 1024 counting as 1024: the open-ended bucket above 1024
    rows goes to the delegate)."""
    from quantpack_core.trellis_mma.ops import DELEGATE, DENSE, ROW_BUCKETS, SPLIT, TC64, TC128, TC256
    from quantpack_core.trellis_mma.selection import Delegate, bucket_options
    from quantpack_core.trellis_mma.settings import using

    other = Delegate("other", lambda *a: None)
    every = range(len(ROW_BUCKETS))
    with using(delegate_rows=None, wide_kernel=None):
        assert [bucket_options(i, False, None) for i in every] == [[SPLIT]] * 10 + [[SPLIT, DENSE]] * 2
        hopper = [bucket_options(i, True, other) for i in every]
        assert hopper[:5] == [[SPLIT, DELEGATE]] * 5 and hopper[5] == hopper[6] == [SPLIT, TC64, DELEGATE]
        assert hopper[7] == [SPLIT, TC64, TC128, DELEGATE]
        assert hopper[8:10] == [[SPLIT, TC64, TC128, TC256, DELEGATE]] * 2
        assert hopper[10:] == [[SPLIT, TC64, TC128, TC256, DENSE, DELEGATE]] * 2
    with using(delegate_rows=0, wide_kernel="tc"):
        assert [bucket_options(i, True, other) for i in every] == [
            [c] for c in [SPLIT] * 5 + [TC64] * 2 + [TC128] + [TC256] * 4
        ]
        assert [bucket_options(i, False, other) for i in every] == [[SPLIT]] * len(ROW_BUCKETS)
    with using(delegate_rows=0, wide_kernel="dense"):
        for tensor_cores in (False, True):
            assert [bucket_options(i, tensor_cores, other) for i in every] == [[SPLIT]] * 5 + [[DENSE]] * 7
    with using(wide_kernel="split"):
        for above, first_delegated in ((16, 5), (20, 6), (1, 1), (512, 10), (1024, 11), (1500, 11), (10**6, 11)):
            with using(delegate_rows=above):
                codes = [bucket_options(i, True, other) for i in every]
                assert codes == [[SPLIT]] * first_delegated + [[DELEGATE]] * (len(ROW_BUCKETS) - first_delegated)
                assert [bucket_options(i, True, None) for i in every] == [[SPLIT]] * len(ROW_BUCKETS)


def test_the_dense_route_is_no_candidate_without_its_buffer():
    """A workspace reserved while the settings kept the dense route out has no buffer for it: no bucket may then be
    given to the route, unless the setting forces it (whose warm-up then fails with the op's error naming it)."""
    from quantpack_core.trellis_mma.ops import DELEGATE, DENSE, ROW_BUCKETS, SPLIT
    from quantpack_core.trellis_mma.selection import Delegate, bucket_options
    from quantpack_core.trellis_mma.settings import using

    other = Delegate("other", lambda *a: None)
    every = range(len(ROW_BUCKETS))
    with using(delegate_rows=None, wide_kernel=None):
        for tensor_cores in (False, True):
            assert all(DENSE not in bucket_options(i, tensor_cores, other, dense=False) for i in every)
            assert DENSE in bucket_options(len(ROW_BUCKETS) - 1, tensor_cores, other, dense=True)
        assert bucket_options(10, False, other, dense=False) == [SPLIT, DELEGATE]
    with using(delegate_rows=0, wide_kernel="dense"):
        assert bucket_options(10, True, other, dense=False) == [DENSE]


def test_the_dense_routes_gemms_on_the_8b_shapes_and_a_cut_layer():
    """q / k / v (4,096 + 1,024 + 1,024 columns) share one GEMM; gate / up (2 x 14,336) take two, up cut at 2,048;
    shards of 300, 200 and 640 columns over a buffer of 3 blocks: 300 | 200 + 128 | 384 | 128."""
    from quantpack_core.trellis_mma.ops import dense_plan

    qkv = dense_plan((4096, 1024, 1024), 16384)
    assert qkv == ((0, 6144, ((0, 0, 4096, 0), (1, 0, 1024, 4096), (2, 0, 1024, 5120))),)
    gate_up = dense_plan((14336, 14336), 16384)
    assert gate_up == ((0, 16384, ((0, 0, 14336, 0), (1, 0, 2048, 14336))), (16384, 12288, ((1, 2048, 12288, 0),)))
    assert [(first, width) for first, width, _ in dense_plan((300, 200, 640), 384)] == [
        (0, 300), (300, 328), (628, 384), (1012, 128),
    ]  # fmt: skip
    for piece in (0, 64, -128, 200):  # no block to cut a wider shard at: refused, not planned forever
        with pytest.raises(ValueError, match=f"a buffer of {piece} columns"):
            dense_plan((300,), piece)


@examples(max_examples=300, deadline=None)
@given(
    widths=st.lists(st.integers(1, 2000), min_size=1, max_size=8),
    blocks=st.integers(1, 40),
)
def test_the_dense_routes_gemms_cover_each_column_once(widths, blocks):
    """Any layer over any buffer: every GEMM fills the buffer's rows from 0 without a gap and no more than it holds,
    its output columns follow the last GEMM's, each rebuild starts on a 128-column block of its shard and lies in it,
    and together they rebuild each shard's columns once, in order."""
    from quantpack_core.trellis_mma.ops import dense_plan

    piece, covered, column = 128 * blocks, [0] * len(widths), 0
    for first, width, rebuilds in dense_plan(tuple(widths), piece):
        assert first == column and 0 < width <= piece
        row = 0
        for shard, c0, n, at in rebuilds:
            assert at == row and c0 == covered[shard] and c0 % 128 == 0 and 0 < n and c0 + n <= widths[shard]
            assert sum(widths[:shard]) + c0 == first + row  # the buffer's row lands on its output column
            covered[shard], row = c0 + n, row + n
        assert row == width
        column += width
    assert covered == widths and column == sum(widths)


def test_the_dense_buffer_is_held_only_where_the_route_may_serve():
    """The route's 128 MiB are held only where some bucket a call reaches may take the route: under ``wide_kernel``
    unset from 513 rows, "dense" from 17, never under "tc" or "split", nor where ``delegate_rows`` sends every
    bucket from 513 rows to the run's delegate."""
    from quantpack_core.trellis_mma.selection import Delegate, dense_may_serve
    from quantpack_core.trellis_mma.settings import using

    other = Delegate("other", lambda *a: None)
    may = {}
    for wide in (None, "dense", "tc", "split"):
        for above in (None, 0, 256, 512, 513, 1024, 10**6):
            for delegate in (None, other):
                with using(delegate_rows=above, wide_kernel=wide):
                    may[wide, above, delegate is None] = dense_may_serve(delegate, None)
    assert {key for key, yes in may.items() if yes} == {
        (wide, above, alone) for wide in (None, "dense") for above in (None, 0, 256, 512, 513, 1024, 10**6)
        for alone in (True, False) if alone or not above or (wide is None and above > 512)
        or (wide == "dense" and above > 16)
    }  # fmt: skip


def stand_in_workspace(dense_bytes: int, max_rows: int | None = None):
    """A Hopper workspace as reserve() leaves it (CPU tensors; only the selection reads it here)."""
    from quantpack_core.trellis_mma import ops

    return ops.Workspace(
        partials=torch.empty(0), counters=torch.empty(0, dtype=torch.int32),
        xh=torch.empty((ops.XH_ROWS, 256), dtype=torch.float16), dense=torch.empty(dense_bytes, dtype=torch.uint8),
        arch=90, target_ctas=132, target_ctas_wide=264, tensor_cores=True, max_rows=max_rows,
    )  # fmt: skip


@pytest.mark.parametrize("buffer", [True, False], ids=["dense-buffer", "no-dense-buffer"])
def test_a_bucket_goes_to_the_dense_route_only_where_it_wins_at_both_ends(monkeypatch, buffer):
    """The load-time choice with a cost model in place of the GPU's timings: the dense route a fixed rebuild plus a
    little per row, the tensor-core kernel more per row and nothing fixed. At 1,024 rows alone the route would win
    the bucket of 513-1,024 rows and lose its calls of 513; timed at both ends (their sum decides) that bucket stays
    on the tensor-core kernel, while the route, ahead at both ends of the bucket above 1,024, serves it. Without the
    buffer no bucket is timed or served on the route, and its warm-up is left out."""
    from quantpack_core.kernels import PreparedShard
    from quantpack_core.trellis_mma import ops, selection

    timed: dict[int, set[int]] = {}

    def cost_us(run, x, out, bucket_kernels):
        code, rows = ops.kernel_of(bucket_kernels, 1), x.shape[0]
        timed.setdefault(code, set()).add(rows)
        return {ops.DENSE: 20 + 0.01 * rows, ops.SPLIT: 1.0 * rows}.get(code, 0.03 * rows + 0.001 * code)

    warmed = []
    ws = stand_in_workspace(ops.DENSE_BYTES if buffer else 0)
    monkeypatch.setattr(selection, "_records", {})
    monkeypatch.setattr(selection, "workspace", lambda device: ws)
    monkeypatch.setattr(selection, "_graph_us", cost_us)
    monkeypatch.setattr(selection, "warm_up", lambda *args: warmed.append(args[-1]))
    tensors = {"trellis": torch.zeros((16, 8, 64), dtype=torch.int16), "suh": torch.ones(256), "svh": torch.ones(128)}
    run = PreparedShard(ops.trellis_mma_, tensors, 128, (2, 4.0, 128, 0))
    with settings.using(wide_kernel=None, delegate_rows=None):
        codes = selection.measure_bucket_kernels(run, torch.float16, None)
    served = {rows: ops.kernel_of(codes, rows) for rows in (512, 1024, 2048)}
    assert served[512] == ops.TC64 and served[1024] == ops.TC64
    assert served[2048] == (ops.DENSE if buffer else ops.TC64) and warmed == [buffer]
    assert timed.get(ops.DENSE, set()) == ({1024, 513, 2048, 1025} if buffer else set())
    assert {1024, 513, 2048, 1025} <= timed[ops.TC64] if buffer else 513 not in timed[ops.TC64]
    # the record names the row counts behind each time (two, summed, where the route competed); no time where the
    # bucket had one candidate
    (record,) = selection.selection_records()
    assert [record.timed_rows(i) for i in (0, 4, 9, 10, 11)] == [
        (), (), (512,), (513, 1024) if buffer else (1024,), (1025, 2048) if buffer else (2048,)
    ]  # fmt: skip
    line = record.describe()
    assert "1: split, 2: split," in line and "16: split, 32: tc64 (32 rows: split 32.0 " in line
    at_1024 = "1024: tc64 (513+1024 rows: split 1537.0 " if buffer else "1024: tc64 (1024 rows: split 1024.0 "
    assert at_1024 in line


def test_no_dense_buffer_where_no_call_reaches_the_route():
    """An engine whose calls take at most 512 rows never calls a bucket the dense route may serve (513 rows on; 17
    with ``wide_kernel`` "dense"). A workspace's limit widens with each linear run prepared and stays unknown once
    a run did not know it."""
    from quantpack_core.trellis_mma.selection import dense_may_serve
    from quantpack_core.trellis_mma.settings import using

    with using(wide_kernel=None, delegate_rows=None):
        assert [dense_may_serve(None, n) for n in (1, 512, 513, 8192, None)] == [False, False, True, True, True]
    with using(wide_kernel="dense", delegate_rows=None):
        assert [dense_may_serve(None, n) for n in (16, 17, None)] == [False, True, True]
    ws = stand_in_workspace(0, max_rows=0)  # as reserve() makes it
    for allowed, now in ((512, 512), (300, 512), (4096, 4096), (None, None), (64, None)):
        ws.allow_rows(allowed)
        assert ws.max_rows == now


@pytest.mark.parametrize("max_rows", [300, 512, 700, 1500, 8192])
def test_buckets_above_the_engines_largest_call_are_not_timed(monkeypatch, max_rows):
    """With the engine's token budget known (the workspace's ``max_rows``), the selection times the buckets a call
    can reach, the last one at the budget where it is less than the bucket's bound, and every bucket above serves
    as that one (a call above the budget, which the engine never makes, is still computed)."""
    from quantpack_core.kernels import PreparedShard
    from quantpack_core.trellis_mma import ops, selection

    timed_rows: set[int] = set()

    def cost_us(run, x, out, bucket_kernels):
        code, rows = ops.kernel_of(bucket_kernels, 1), x.shape[0]
        timed_rows.add(rows)
        return {ops.DENSE: 20 + 0.01 * rows, ops.SPLIT: 1.0 * rows}.get(code, 0.03 * rows + 0.001 * code)

    ws = stand_in_workspace(ops.DENSE_BYTES if max_rows > 512 else 0, max_rows=max_rows)
    monkeypatch.setattr(selection, "_records", {})
    monkeypatch.setattr(selection, "workspace", lambda device: ws)
    monkeypatch.setattr(selection, "_graph_us", cost_us)
    monkeypatch.setattr(selection, "warm_up", lambda *args: None)
    tensors = {"trellis": torch.zeros((16, 8, 64), dtype=torch.int16), "suh": torch.ones(256), "svh": torch.ones(128)}
    run = PreparedShard(ops.trellis_mma_, tensors, 128, (2, 4.0, 128, 0))
    with settings.using(wide_kernel=None, delegate_rows=None):
        codes = selection.measure_bucket_kernels(run, torch.float16, None)
    (record,) = selection.selection_records()
    reached = ops.row_bucket(max_rows) + 1
    assert max(timed_rows) == min(max_rows, 2048) and len(record.rows) == reached
    assert record.rows[-1] == min(max_rows, 2048) and record.rows[:-1] == ops.ROW_BUCKETS[: reached - 1]
    last = ops.kernel_of(codes, record.rows[-1])
    assert all(ops.kernel_of(codes, rows) == last for rows in (max_rows, max_rows + 1, 2 * max_rows, 10**5))
    if max_rows == 700:  # the route competes in its first bucket, timed at its ends: 513 and 700 rows
        assert record.timed_rows(10) == (513, 700) and "1024" not in record.describe()
    assert ("above: as" in record.describe()) == (reached < len(ops.ROW_BUCKETS))


def test_an_output_of_the_wrong_shape_is_refused_before_any_launch(monkeypatch):
    """The op writes ``out[:, col : col + sum(out_features)]`` of ``rows`` rows: an output with other rows, or too few
    columns, would be written out of bounds by the kernels (or resized by cuBLAS on the dense route)."""
    from quantpack_core.trellis_mma import ops
    from quantpack_core.trellis_mma.library import LibraryError

    monkeypatch.setitem(ops._workspaces, None, stand_in_workspace(0))  # CPU tensors: device index None
    x = torch.zeros((4, 256), dtype=torch.float16)
    trellis, suh, svh = [torch.zeros((16, 8, 64), dtype=torch.int16)], [torch.ones(256)], [torch.ones(128)]
    for shape, col in (((3, 128), 0), ((5, 128), 0), ((4, 127), 0), ((4, 200), 100)):
        out = torch.empty(shape, dtype=torch.float16)
        with pytest.raises(LibraryError, match=r"an output of .* it needs 4 rows and at least"):
            ops.run_trellis_mma(x, trellis, suh, svh, 2, 4.0, [128], 0, out, col)


def test_a_bad_delegate_rows_setting_measures_instead(caplog):
    """QUANTPACK_TRELLIS_MMA_DELEGATE_ROWS: unset or not an integer >= 0 -> measured delegated row buckets (None, with a
    warning for the latter); an integer -> that threshold."""
    from quantpack_core.trellis_mma.settings import Settings

    for raw, want in (("", None), ("abc", None), ("-3", None), ("0", 0), ("300", 300)):
        assert Settings.from_env({"QUANTPACK_TRELLIS_MMA_DELEGATE_ROWS": raw}).delegate_rows == want, raw
    assert "is not an integer >= 0; measuring each layer's delegated row buckets instead" in caplog.text


def test_the_wide_kernel_setting(caplog):
    """QUANTPACK_TRELLIS_MMA_WIDE_KERNEL: "split", "tc" or "dense" (any case) forces that kernel above 16 rows; unset
    or another value (with a warning) -> measured per row bucket (None)."""
    from quantpack_core.trellis_mma.settings import Settings

    for raw, want in (("", None), ("split", "split"), ("TC", "tc"), ("Dense", "dense"), ("wgmma", None)):
        assert Settings.from_env({"QUANTPACK_TRELLIS_MMA_WIDE_KERNEL": raw}).wide_kernel == want, raw
    assert "WIDE_KERNEL='wgmma' is not one of ('split', 'tc', 'dense'); measuring each run's kernels" in caplog.text


def test_settings_from_the_environment():
    """Each knob from its variable; a bad value keeps the default with a warning naming the variable; the wide CTA
    target follows QUANTPACK_TRELLIS_MMA_CTAS_PER_SM where only that is set; the cache under XDG_CACHE_HOME."""
    from quantpack_core.trellis_mma.settings import Settings

    default = Settings.from_env({})
    assert (default.delegate_rows, default.inline_transform_rows, default.wide_fused) == (None, 1, True)
    assert (default.ctas_per_sm, default.ctas_per_sm_wide, default.nvcc) == (4, 2, None)
    env = {
        "QUANTPACK_TRELLIS_MMA_DELEGATE_ROWS": "16",
        "QUANTPACK_TRELLIS_MMA_INLINE_TRANSFORM_ROWS": "7",
        "QUANTPACK_TRELLIS_MMA_CTAS_PER_SM": "5",
        "QUANTPACK_TRELLIS_MMA_WIDE_FUSED": "0",
        "QUANTPACK_NVCC": "/opt/nvcc",
        "XDG_CACHE_HOME": "/xdg",
    }
    s = Settings.from_env(env)
    assert (s.delegate_rows, s.inline_transform_rows, s.ctas_per_sm, s.ctas_per_sm_wide) == (16, 1, 5, 5)
    assert (s.wide_fused, s.nvcc, str(s.cache_dir)) == (False, "/opt/nvcc", "/xdg/quantpack")
    s = Settings.from_env({**env, "QUANTPACK_TRELLIS_MMA_CTAS_PER_SM_WIDE": "3", "QUANTPACK_CACHE_DIR": "/c"})
    assert (s.ctas_per_sm_wide, str(s.cache_dir)) == (3, "/c")
    assert Settings.from_env({"QUANTPACK_TRELLIS_MMA_CTAS_PER_SM": "0"}).ctas_per_sm == 4  # below the minimum


@pytest.mark.parametrize("value", ["", " ", "0", "33", "2**31", "four"])
def test_a_cta_target_not_given_keeps_both_defaults(value, caplog):
    """A blank or invalid QUANTPACK_TRELLIS_MMA_CTAS_PER_SM (outside 1-32: ctypes would wrap a huge target) keeps 4
    and leaves the wide target at its own default, 2, instead of following the variable's mere presence; an
    invalid one is named in a warning."""
    from quantpack_core.trellis_mma.settings import Settings

    s = Settings.from_env({"QUANTPACK_TRELLIS_MMA_CTAS_PER_SM": value})
    assert (s.ctas_per_sm, s.ctas_per_sm_wide) == (4, 2)
    assert ("CTAS_PER_SM=" in caplog.text) == bool(value.strip())
    wide = Settings.from_env({"QUANTPACK_TRELLIS_MMA_CTAS_PER_SM_WIDE": "100"})
    assert wide.ctas_per_sm_wide == 2 and "is not an integer from 1 to 32" in caplog.text


@pytest.mark.parametrize(
    ("value", "fused", "warned"),
    [("0", False, False), ("off", False, False), ("False", False, False), ("no", False, False),
     ("1", True, False), ("ON", True, False), ("yes", True, False), ("", True, False), ("2", True, True),
     ("disable", True, True)],
)  # fmt: skip
def test_wide_fused_takes_the_usual_switch_spellings(value, fused, warned, caplog):
    """QUANTPACK_TRELLIS_MMA_WIDE_FUSED: 1 / 0, true / false, on / off, yes / no in any case; anything else keeps the
    default (on) with a warning naming the variable."""
    from quantpack_core.trellis_mma.settings import Settings

    assert Settings.from_env({"QUANTPACK_TRELLIS_MMA_WIDE_FUSED": value}).wide_fused is fused
    assert ("WIDE_FUSED=" in caplog.text) is warned


@pytest.mark.parametrize(
    "changes",
    [{"delegate_rows": -5}, {"wide_kernel": "Dense"}, {"ctas_per_sm": 0}, {"ctas_per_sm_wide": 2**31},
     {"inline_transform_rows": 2}, {"wide_fused": 0}, {"moe_tc_picks": -1}, {"delegate_rows": 1.5}],
)  # fmt: skip
def test_using_refuses_a_value_no_knob_takes(changes):
    """settings.using() (tests and benchmarks) refuses what the environment's parsers would have warned about and
    replaced: a negative delegate threshold would delegate every bucket, a wide kernel's other spelling would quietly
    mean "measured"; the error names the field and value, and the settings in force stay as they were."""
    from quantpack_core.trellis_mma import settings

    before = settings.current()
    name, value = next(iter(changes.items()))
    with pytest.raises(ValueError, match=f"{name}={value!r} out of range"), settings.using(**changes):
        pass
    assert settings.current() is before


def test_settings_are_read_once_and_replaced_only_inside_using(monkeypatch):
    """current() reads the environment once (a later change of it is not seen); using() replaces fields for its block
    and restores them, also when the block raises; the settings are frozen; an unknown field is refused."""
    import dataclasses

    from quantpack_core.trellis_mma import settings

    monkeypatch.setattr(settings, "_current", None)
    monkeypatch.setenv("QUANTPACK_TRELLIS_MMA_CTAS_PER_SM", "6")
    first = settings.current()
    monkeypatch.setenv("QUANTPACK_TRELLIS_MMA_CTAS_PER_SM", "7")
    assert settings.current() is first and first.ctas_per_sm == 6
    with settings.using(delegate_rows=0, wide_fused=False) as inside:
        assert settings.current() is inside and (inside.delegate_rows, inside.wide_fused, inside.ctas_per_sm) == (
            0,
            False,
            6,
        )
        with settings.using(delegate_rows=32):
            assert settings.current().delegate_rows == 32 and not settings.current().wide_fused
        assert settings.current() is inside
    assert settings.current() is first
    with pytest.raises(RuntimeError), settings.using(delegate_rows=8):
        raise RuntimeError
    assert settings.current() is first
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.delegate_rows = 3
    with pytest.raises(TypeError), settings.using(no_such_knob=1):
        pass


# ---------------------------------------------------------------------------------------------------- expert banks


def _plan_model(counts: list[int], group_lo: list[int], item_rows: int):
    """The sort step's plan, written out: slots in order, each slot's picks at consecutive sorted positions and cut
    into work items of ``item_rows`` rows, the items of a K group contiguous."""
    offsets, item_base, group_work, pos, item = [], [], [], 0, 0
    bounds = [*group_lo, len(counts)]
    for g in range(len(group_lo)):
        group_work.append(item)
        for s in range(bounds[g], bounds[g + 1]):
            offsets.append(pos)
            item_base.append(item)
            pos += counts[s]
            item += -(-counts[s] // item_rows)
    return [*offsets, pos], [*group_work, item], item_base


@needs_nvcc
@pytest.mark.parametrize("item_rows", [16, 64], ids=["mma-16", "tc-64"])
@pytest.mark.parametrize("seed", range(8))
def test_moe_sort_plan(lib, seed, item_rows):
    """The sort kernel's plan (the one serial step, built for the host from the same source) equals the written-out
    plan for the 16-row kernel's items and the tensor-core path's 64-row ones; the bank's work items stay within the
    grid extent the op launches for every K group at once (``group_items`` of all slots = ``qp_moe_items``), and so
    does each group's share, however the picks fall (seeds 6 and 7: a tensor-core chunk of 2,048 tokens at top-8,
    uniform and all on one expert)."""
    from quantpack_core.trellis_mma.moe import group_items

    g = torch.Generator().manual_seed(seed)
    experts = [8, 64, 128, 256, 3, 128, 128, 128][seed]
    top_k = [2, 8, 8, 8, 1, 8, 8, 8][seed]
    tokens = [5, 1, 64, 256, 600, 2, 2048, 2048][seed]
    cuts = sorted(torch.randperm(experts - 1, generator=g)[: min(3, experts - 1)].add(1).tolist())
    group_lo = [0, *cuts][: 1 + seed % 4]
    slots = tokens * top_k
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).reshape(-1)
    if seed in (5, 7):
        ids[:] = 0  # every pick on one expert
    counts = torch.bincount(ids, minlength=experts).to(torch.int32)
    groups = len(group_lo)
    offsets = torch.empty(experts + 1, dtype=torch.int32)
    group_work = torch.empty(groups + 1, dtype=torch.int32)
    item_base = torch.empty(experts, dtype=torch.int32)
    lo = (ctypes.c_int * groups)(*group_lo)
    lib.qp_moe_plan_host(
        ctypes.c_void_p(counts.data_ptr()), experts, lo, groups, ctypes.c_void_p(offsets.data_ptr()),
        ctypes.c_void_p(group_work.data_ptr()), ctypes.c_void_p(item_base.data_ptr()), item_rows,
    )  # fmt: skip
    want_offsets, want_group_work, want_base = _plan_model(counts.tolist(), group_lo, item_rows)
    assert offsets.tolist() == want_offsets
    assert group_work.tolist() == want_group_work
    assert item_base.tolist() == want_base
    assert offsets[-1] == slots
    assert group_work[-1] <= group_items(slots, experts, item_rows) == lib.qp_moe_items(slots, experts, item_rows)
    bounds = [*group_lo, experts]
    for i in range(groups):
        cap = group_items(slots, bounds[i + 1] - bounds[i], item_rows)
        assert cap == lib.qp_moe_items(slots, bounds[i + 1] - bounds[i], item_rows)
        assert group_work[i + 1] - group_work[i] <= cap


@needs_nvcc
@pytest.mark.parametrize("item_rows", [16, 64], ids=["mma-16", "tc-64"])
@pytest.mark.parametrize("items", [1, 8, 16, 160, 2200])
@pytest.mark.parametrize("k,n", [(2048, 1536), (768, 2048), (256, 512), (7168, 4096)])
def test_moe_split_plan(lib, items, k, n, item_rows):
    """An expert launch's splits (16-row items, and the tensor-core path's 64-row ones) cover k in whole 128-column
    blocks, keep the partials and counters within the linear workspace, and a column block's last CTA sums at most
    128 partial rows."""
    splits = lib.qp_moe_splits(items, item_rows, k, n, 528, PARTIAL_FLOATS, COUNTERS)
    ktiles = k // 16
    slice_tiles = (ktiles // 8 + splits - 1) // splits * 8
    assert 1 <= splits <= ktiles // 8
    assert (splits - 1) * slice_tiles < ktiles <= splits * slice_tiles
    if splits > 1:
        assert items * splits * item_rows * n <= PARTIAL_FLOATS
        assert items * (n // 128) <= COUNTERS
        assert splits * item_rows <= TAIL_ROWS
    if items == 8 and (k, n) == (2048, 1536) and item_rows == 16:
        # batch 1, top-8 gate/up of a 30B-A3B layer: 96 CTAs; 5 splits would fit 528, but 16 blocks of k in equal
        # whole-block slices give 4 slices of 4 blocks (384 CTAs)
        assert splits == 4


@needs_nvcc
def test_moe_bad_arguments_are_refused_before_any_launch(lib):
    """k or an output width off the 128 grid, a K group count or grid extent out of range, a K the codebook has no
    kernel for, more K groups than a launch plan holds, or groups that do not start at slot 0: refused before any CUDA
    call, named by check()."""
    k8 = (ctypes.c_int * 16)(*([8] * 16))

    def gemm(groups, k2, items, k, codebook=2):
        return lib.qp_moe_gemm(
            0, 1, None, None, None, None, 8, None, None, None, None, groups, k2, None, 0, None, 0, None, 0,
            items, 8, k, k, k, 768, codebook, 0, 528, None,
        )  # fmt: skip

    code = gemm(1, k8, 4, 100)
    assert code == -1
    with pytest.raises(library.LibraryError, match="multiples of 128"):
        library.check(code, "test")
    for groups, items in ((17, 4), (0, 4), (1, 70000)):  # more K groups than the plan's 16, none, a grid z past 65535
        assert gemm(groups, k8, items, 256) == -1, (groups, items)
    assert gemm(1, None, 4, 256) == -1  # no K table
    mixed = (ctypes.c_int * 3)(4, 9, 6)  # K 4.5 has no kernel in any codebook
    assert gemm(3, mixed, 4, 256) == -2
    half = (ctypes.c_int * 2)(4, 5)  # K 2.5: mul1 only
    assert gemm(2, half, 4, 256, codebook=1) == -2
    assert gemm(1, k8, 4, 256, codebook=7) == -3
    for group_lo in ([0] * 17, [1, 2], [0, 3, 2]):
        lo = (ctypes.c_int * len(group_lo))(*group_lo)
        code = lib.qp_moe_sort(None, 0, None, 8, 8, lo, len(group_lo), 16, None, None, None, None, None, None)
        assert code == -1
    lo = (ctypes.c_int * 1)(0)
    assert lib.qp_moe_sort(None, 0, None, 8, 8, lo, 1, 0, None, None, None, None, None, None) == -1  # 0-row items


@needs_nvcc
def test_moe_tc_bad_arguments_are_refused_before_any_launch(lib):
    """The tensor-core expert path refuses rows per item other than 64, the 16-row path's geometry errors, a K with no
    kernel and an xh too small for the chunk's planes, before any CUDA call (so on any machine)."""
    k8 = (ctypes.c_int * 1)(8)

    def gemm(k2=k8, nr=64, k=2048, xh_halves=2 * 512 * 2048, down=0, codebook=2, groups=1):
        return lib.qp_moe_tc_gemm(
            down, 1, None, None, None, 1, xh_halves, None, 128, None, None, None, None, None, groups, k2, None, 0,
            None, 0, None, 0, 512, 136, nr, 8, 2048, 2048, k, 768, codebook, 0, 264, None,
        )  # fmt: skip

    assert gemm(nr=128) == -1
    assert gemm(nr=16) == -1
    assert gemm(k=2000) == -1
    assert gemm(groups=17) == -1
    assert gemm(k2=(ctypes.c_int * 1)(9)) == -2
    assert gemm(codebook=7) == -3
    assert gemm(xh_halves=2 * 512 * 2048 - 1) == -4  # gate/up of a gated bank: two planes
    assert gemm(down=1, k=768, xh_halves=512 * 768 - 1) == -4


def test_moe_path_choice_depends_on_the_token_count_only():
    """The tensor-core expert path runs a call from ``moe_tc_picks`` picks per expert of the layer on (tokens x top_k
    against the threshold x the layer's experts), only where the buffers hold its chunk (Hopper), never with the
    setting 0: the same answer for the same shapes, whatever the routing."""
    from quantpack_core.trellis_mma.moe import MoeBuffers, uses_tensor_cores

    none = torch.empty(0)
    with_tc = MoeBuffers(none, none, none, none, none, none, none, xh=torch.empty(1, dtype=torch.float16))
    without = MoeBuffers(none, none, none, none, none, none, none)
    with settings.using(moe_tc_picks=32):
        assert not uses_tensor_cores(with_tc, 511, 8, 128)  # 4088 picks < 32 x 128
        assert uses_tensor_cores(with_tc, 512, 8, 128)
        assert not uses_tensor_cores(without, 4096, 8, 128)
    with settings.using(moe_tc_picks=0):
        assert not uses_tensor_cores(with_tc, 4096, 8, 128)
    assert settings.Settings.from_env({"QUANTPACK_TRELLIS_MMA_MOE_TC_PICKS": "0"}).moe_tc_picks == 0
    assert settings.Settings.from_env({"QUANTPACK_TRELLIS_MMA_MOE_TC_PICKS": "-3"}).moe_tc_picks == 8


def test_the_dense_route_sums_in_float32_and_restores_the_switches():
    """Inside float32_sums() torch's switches that let cuBLAS round float16 / bfloat16 partial sums are off; after
    it (also after an error) they are as they were, split-K part included where the release has one."""
    import torch

    from quantpack_core.trellis_mma.ops import REDUCTION_SWITCHES, float32_sums

    matmul = torch.backends.cuda.matmul
    before = [getattr(matmul, name) for name in REDUCTION_SWITCHES]
    for start in (True, False):
        for name in REDUCTION_SWITCHES:
            setattr(matmul, name, start)
        try:
            with pytest.raises(RuntimeError), float32_sums():
                assert [getattr(matmul, name) for name in REDUCTION_SWITCHES] == [False, False]
                raise RuntimeError("inside")
            assert [getattr(matmul, name) for name in REDUCTION_SWITCHES] == [start, start]
        finally:
            for name, value in zip(REDUCTION_SWITCHES, before, strict=True):
                setattr(matmul, name, value)
