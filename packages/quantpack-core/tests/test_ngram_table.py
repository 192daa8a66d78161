"""The hashed n-gram table of Flash-Next's per-layer embedding (:mod:`quantpack_core.ngram`): a small table in
exllamav3's layout (4 heads x 160, head vocabularies of a few hundred rows, K 2 / 3 / 4, rows split over shards
with a short last one) is read back from ``ngram_embedding.safetensors``, and any gathered row decodes to what was
encoded plus its head's bias; a missing file or a malformed table is refused naming the tensor."""

import pytest
import torch
from safetensors.torch import save_file

from quantpack_core.codec import codebook_values
from quantpack_core.codec.ring import states_from_symbols
from quantpack_core.errors import PackError
from quantpack_core.ngram import NGRAM_FILE, NgramTable, make_ngram_tensors

KEY = "model.language_model.layers.1.ple.ple_embedding.ngram_embedding"
SIZES = [211, 307, 401, 503]  # primes, as the real table's head vocabularies are


@pytest.mark.parametrize("k_bits", [2, 3, 4])
def test_gathered_rows_decode_to_what_was_encoded(tmp_path, k_bits):
    tensors, symbols, scales = make_ngram_tensors(KEY, SIZES, k_bits, rows_per_shard=400)
    assert sorted(n for n in tensors if n.endswith(".trellis")) == [f"{KEY}.shard_{i}.trellis" for i in range(4)]
    save_file(tensors, str(tmp_path / NGRAM_FILE))
    table = NgramTable.load(tmp_path, KEY)
    assert (table.k_bits, table.num_rows, table.rows_per_shard) == (k_bits, sum(SIZES), 400)
    offsets = [0, 211, 518, 919]
    # the first and last row of each head, rows on both sides of each shard boundary, and random rows
    ids = torch.tensor([[0, 210, 211, 517], [518, 918, 919, 1421], [399, 400, 799, 800], [1200, 5, 1000, 1421]])
    got = table.rows(ids)
    assert got.shape == (4, 4, 160) and got.dtype == torch.float32
    flat = ids.reshape(-1)
    heads = torch.tensor([sum(int(r) >= o for o in offsets) - 1 for r in flat])
    assert torch.equal(table.heads_of(flat), heads)
    values = codebook_values(states_from_symbols(symbols[flat], k_bits), "mul1").float()
    bias = tensors[f"{KEY}.head_bias"].float()[heads]
    want = values * scales[flat].float()[:, None] + bias
    assert torch.equal(got.reshape(-1, 160), want)
    with pytest.raises(IndexError, match=r"row ids must lie in 0\.\.1421"):
        table.rows(torch.tensor([1422]))


def test_a_missing_table_file_is_named(tmp_path):
    with pytest.raises(PackError, match=f"{NGRAM_FILE}: missing: the n-gram table is stored outside the index"):
        NgramTable.load(tmp_path, KEY)


@pytest.mark.parametrize(
    "breakage,message",
    [
        (lambda t: t.pop(f"{KEY}.shard_1.trellis"), "shard_2.trellis: a shard after a gap in the shard numbers"),
        (lambda t: t.pop(f"{KEY}.head_bias"), "head_bias: missing"),
        (lambda t: t.__setitem__(f"{KEY}.head_bias", torch.zeros(3, 160).half()), r"shape \[3, 160\], want \[4, 160\]"),
        (  # a NaN head bias would serve NaN rows for the whole head
            lambda t: t[f"{KEY}.head_bias"].__setitem__((1, slice(0, 3)), float("nan")),
            r"head_bias: 3 NaN / Inf values",
        ),
        (
            lambda t: t.__setitem__(f"{KEY}.shard_0.trellis", t[f"{KEY}.shard_0.trellis"][:, :30]),
            "ring rows are 2-D int16 of one width",
        ),
        (
            lambda t: t.__setitem__(f"{KEY}.head_offsets", torch.tensor([0, 211, 518, 1300])),
            r"heads do not tile the table \(offsets \[0, 211, 518, 1300\]",
        ),
        (
            lambda t: t.__setitem__(f"{KEY}.head_vocab_sizes", torch.tensor([211, 307, 401, 600])),
            "heads reach row 1519, the table has 1422 rows",
        ),
        (  # overlapping heads would give rows another head's bias
            lambda t: t.__setitem__(f"{KEY}.head_offsets", torch.tensor([0, 200, 518, 919])),
            "heads do not tile the table",
        ),
        (lambda t: t.__setitem__(f"{KEY}.head_offsets", torch.tensor([-10, 211, 518, 919])), "do not tile"),
        (lambda t: t.__setitem__(f"{KEY}.head_offsets", torch.tensor([0.0, 211, 518, 919])), "are integers"),
        (
            lambda t: t.__setitem__(f"{KEY}.shard_0.trellis", t[f"{KEY}.shard_0.trellis"].int()),
            r"torch.int32 \[400, 31\]: ring rows are 2-D int16",
        ),
        (lambda t: [t.pop(n) for n in list(t) if n.endswith(".trellis")], "no ring rows for this n-gram table"),
    ],
    ids=[
        "shard-gap",
        "no-bias",
        "bias-shape",
        "bias-nan",
        "width",
        "offsets",
        "sizes",
        "overlap",
        "negative",
        "float",
        "int32",
        "no-rows",
    ],
)
def test_malformed_tables_are_refused_naming_the_tensor(breakage, message):
    tensors, _, _ = make_ngram_tensors(KEY, SIZES, 3, rows_per_shard=400)
    breakage(tensors)
    with pytest.raises(PackError, match=message):
        NgramTable.from_tensors(KEY, tensors)


def test_layout_from_the_header_and_row_ranges_read_alone(tmp_path):
    """The layout is read from the file's header (ring shards as meta tensors: nothing of the table is loaded), the
    module found by its canonical name in vLLM's spelling; any row range reads exactly those packed rows."""
    tensors, _, _ = make_ngram_tensors(KEY, SIZES, 3, rows_per_shard=400)
    save_file(tensors, str(tmp_path / NGRAM_FILE))
    table = NgramTable.open_layout(
        tmp_path / NGRAM_FILE, "language_model.model.layers.1.ple.ple_embedding.ngram_embedding"
    )
    assert table.key == KEY and all(s.is_meta for s in table.shards) and table.num_rows == sum(SIZES)
    whole = torch.cat([tensors[f"{KEY}.shard_{i}.trellis"] for i in range(4)])
    for start, stop in [(0, 1422), (399, 401), (400, 800), (1300, 1422), (5, 5)]:
        assert torch.equal(table.read_rows(tmp_path / NGRAM_FILE, start, stop), whole[start:stop])
    with pytest.raises(IndexError, match="outside the table"):
        table.read_rows(tmp_path / NGRAM_FILE, 1000, 1423)
    with pytest.raises(PackError, match="holds no n-gram table for this module"):
        NgramTable.open_layout(tmp_path / NGRAM_FILE, "model.layers.5.ple.ple_embedding.ngram_embedding")
