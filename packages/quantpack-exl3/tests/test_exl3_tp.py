"""Tensor parallelism, every layer kind, 2 / 4 / 8 ranks simulated in one process on CPU.

Each rank's layer is vLLM's own (``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``RowParallelLinear``,
``ParallelLMHead``, ``VocabParallelEmbedding``) built while vLLM's tensor-parallel rank and size functions report
that rank, so vLLM computes the partition sizes, KV-head replicas and vocabulary ranges itself. Every rank is fed the
whole checkpoint tensors, as vLLM's loader hands them over, and keeps its part. The ranks' outputs, gathered (column
parallel) or summed (row parallel, the all-reduce), are compared with the unsharded layer through the core codec in
float64. The expert layer is the method on a plain module (as in test_exl3_moe.py), its ranks summed against the
core's float64 MoE forward of the whole bank.
"""

import contextlib

import pytest
import torch

from quantpack_core import Exl3Tensors, GeometryError, Pack, reference_linear
from quantpack_core.compare import relative_error
from quantpack_core.moe import reference_moe_forward
from quantpack_core.synthetic import random_exl3_layer

pytest.importorskip("vllm")

from test_exl3_layers import feed, make_config
from test_exl3_moe import HIGH, LAYER, E, H, exl3_config, expert_tensors, load, moe_config, oracle_bank

TOL = 1e-5


@contextlib.contextmanager
def as_rank(monkeypatch, tp, rank):
    """While vLLM builds layers: its tensor-parallel world reports ``rank`` of ``tp``."""
    import vllm.model_executor.layers.linear as lin
    import vllm.model_executor.layers.vocab_parallel_embedding as vpe

    with monkeypatch.context() as m:
        for mod in (lin, vpe):
            m.setattr(mod, "get_tensor_model_parallel_rank", lambda: rank)
            m.setattr(mod, "get_tensor_model_parallel_world_size", lambda: tp)
        yield


def synthetic(i, o, k=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return random_exl3_layer(i, o, k, "mul1", generator=g)


def ref(x, tensors, outs):
    """fp64 reference of the unsharded layer: each shard through the core codec, concatenated."""
    return torch.cat(
        [
            reference_linear(x.double(), Exl3Tensors.from_tensors(t), torch.float64, out_features=o)
            for t, o in zip(tensors, outs, strict=True)
        ],
        -1,
    )


def run_ranks(monkeypatch, tp, build, shards, x, kind):
    """Build, feed and run the layer on every rank; return (gathered or summed output, per-rank layers)."""
    outs, layers = [], []
    for rank in range(tp):
        with as_rank(monkeypatch, tp, rank):
            layer = build()
        for sid, tensors in shards:
            feed(layer, tensors, sid)
        layer.quant_method.process_weights_after_loading(layer)
        if kind == "row":
            share = x.shape[-1] // tp
            outs.append(layer.quant_method.apply(layer, x[:, rank * share : (rank + 1) * share]))
        else:
            outs.append(layer.quant_method.apply(layer, x))
        layers.append(layer)
    y = sum(outs) if kind == "row" else torch.cat(outs, -1)
    return y, layers


def held(layer) -> tuple[int, int]:
    """``(in, out)`` of the dense weight a rank's first run holds (vLLM's CPU GEMM keeps its own packed copy and
    records the shape it packed)."""
    fn = layer.quant_state.runs[0].fn
    return tuple(getattr(fn, "shape", None) or layer.shard0_weight.shape)


def fallback_of(layer):
    return layer.quant_state.col_select or layer.quant_state.row_pad is not None


# ---------------------------------------------------------------------------------- qkv with GQA (fixture + wide)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "tp", "fallback"),
    [
        (4, 2, 64, 2, True),  # llama-tiny: q 128 per rank (sliced), k / v 64 per rank (inside a block)
        (4, 2, 64, 4, True),  # q 64 per rank; k / v one head on two ranks each (replicated)
        (16, 8, 64, 8, True),  # q 128 per rank sliced, k / v 64 per rank
        (16, 2, 128, 8, False),  # k / v: 2 heads of 128 over 8 ranks (4 replicas each): whole blocks
        (16, 16, 64, 8, False),  # everything 128 per rank
    ],
)
def test_qkv_with_gqa(vllm_layers, monkeypatch, heads, kv_heads, head_dim, tp, fallback):
    from vllm.model_executor.layers.linear import QKVParallelLinear

    cfg = make_config(vllm_layers)
    hidden = 256
    outs = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    tensors = [synthetic(hidden, o, seed=s) for s, o in enumerate(outs)]
    x = torch.randn(5, hidden)

    def build():
        return QKVParallelLinear(
            hidden, head_dim, heads, kv_heads, bias=False, quant_config=cfg, prefix="model.layers.0.self_attn.qkv_proj"
        )

    y, layers = run_ranks(monkeypatch, tp, build, list(zip("qkv", tensors, strict=True)), x, "column")
    # vLLM's layout: every rank's [q | k | v]; rebuild it from the unsharded output
    full = ref(x, tensors, outs)
    q, k, v = full.split(outs, -1)
    qs, ks, reps = outs[0] // tp, max(outs[1] // tp, head_dim), max(1, tp // kv_heads)
    want = torch.cat(
        [
            torch.cat(
                [q[:, r * qs : (r + 1) * qs], *(t[:, (r // reps) * ks : (r // reps + 1) * ks] for t in (k, v))], -1
            )
            for r in range(tp)
        ],
        -1,
    )
    assert y.shape == want.shape
    assert relative_error(y, want) < TOL
    assert any(fallback_of(la) for la in layers) == fallback


def test_llama_fixture_layers_at_tp2_and_tp4(vllm_layers, monkeypatch, fixtures_dir):
    """The bundled exllamav3 pack's own tensors: gate_up (640 -> 320 / 160 per rank: fallback), down (row, fallback),
    o (row: 128 per rank sliced at TP 2, 64 fallback at TP 4)."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear

    pack = Pack.open(fixtures_dir / "llama-tiny-exl3-4.0bpw-mul1")
    cfg = make_config(vllm_layers, pack)
    p = "model.layers.1"
    gate, up = (pack.module_tensors(f"{p}.mlp.{n}") for n in ("gate_proj", "up_proj"))
    down, o = pack.module_tensors(f"{p}.mlp.down_proj"), pack.module_tensors(f"{p}.self_attn.o_proj")
    for tp in (2, 4):
        x = torch.randn(6, 256)
        y, layers = run_ranks(
            monkeypatch,
            tp,
            lambda: MergedColumnParallelLinear(
                256, [640, 640], bias=False, quant_config=cfg, prefix=f"{p}.mlp.gate_up_proj"
            ),
            [(0, gate), (1, up)],
            x,
            "column",
        )
        g_full, u_full = ref(x, [gate], [640]), ref(x, [up], [640])
        s = 640 // tp
        want = torch.cat(
            [torch.cat([g_full[:, r * s : (r + 1) * s], u_full[:, r * s : (r + 1) * s]], -1) for r in range(tp)], -1
        )
        assert relative_error(y, want) < TOL and all(fallback_of(la) for la in layers)
        for tensors, width, name, sliced in (
            (down, 640, "mlp.down_proj", False),
            (o, 256, "self_attn.o_proj", tp == 2),
        ):
            x = torch.randn(6, width)
            y, layers = run_ranks(
                monkeypatch,
                tp,
                lambda w=width, n=name: RowParallelLinear(w, 256, bias=False, quant_config=cfg, prefix=f"{p}.{n}"),
                [(None, tensors)],
                x,
                "row",
            )
            assert relative_error(y, ref(x, [tensors], [256])) < TOL, (tp, name)
            assert all(fallback_of(la) != sliced for la in layers), (tp, name)
            # each rank holds only the 128-row blocks its input share touches, not the whole matrix
            share = width // tp
            kept = [min(-(-(r + 1) * share // 128) * 128, width) - r * share // 128 * 128 for r in range(tp)]
            assert [held(la)[0] for la in layers] == kept, (tp, name)


# ----------------------------------------------------------------------------- gate_up / down, row and column


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("inter", [1024, 640, 200 * 8])
def test_gate_up_and_down(vllm_layers, monkeypatch, tp, inter):
    """1024: 512 / 256 / 128 per rank, sliced; 640: inside a block at every size (fallbacks); 1600: sliced only
    where the share is whole blocks."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear

    cfg = make_config(vllm_layers)
    gate, up, down = synthetic(256, inter, seed=1), synthetic(256, inter, 4.0, seed=2), synthetic(inter, 256, seed=3)
    x = torch.randn(4, 256)
    y, _ = run_ranks(
        monkeypatch,
        tp,
        lambda: MergedColumnParallelLinear(256, [inter] * 2, bias=False, quant_config=cfg, prefix="mlp.gate_up_proj"),
        [(0, gate), (1, up)],
        x,
        "column",
    )
    g_full, u_full = ref(x, [gate], [inter]), ref(x, [up], [inter])
    s = inter // tp
    want = torch.cat(
        [torch.cat([g_full[:, r * s : (r + 1) * s], u_full[:, r * s : (r + 1) * s]], -1) for r in range(tp)], -1
    )
    assert relative_error(y, want) < TOL
    x = torch.randn(4, inter)
    y, layers = run_ranks(
        monkeypatch,
        tp,
        lambda: RowParallelLinear(inter, 256, bias=False, quant_config=cfg, prefix="mlp.down_proj"),
        [(None, down)],
        x,
        "row",
    )
    assert relative_error(y, ref(x, [down], [256])) < TOL
    assert all(fallback_of(la) == ((inter // tp) % 128 != 0) for la in layers)


def test_dense_shards_are_cut_exactly(vllm_layers, monkeypatch):
    """A layer the pack stores dense (.weight) behind the EXL3 method is cut like vLLM cuts it, no block rule."""
    from vllm.model_executor.layers.linear import RowParallelLinear

    cfg = make_config(vllm_layers)
    w = torch.randn(256, 96)
    x = torch.randn(3, 96)
    y, _ = run_ranks(
        monkeypatch,
        4,
        lambda: RowParallelLinear(96, 256, bias=False, quant_config=cfg, prefix="mlp.down_proj"),
        [(None, {"weight": w})],
        x,
        "row",
    )
    torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------- in_proj_qkvz: tuple shard ids, one fused shard


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_in_proj_qkvz_tuple_shards_of_the_qwen3_5_fixture(vllm_layers, monkeypatch, fixtures_dir, tp):
    """Qwen3.5: in_proj_qkv arrives as shard (0, 1, 2) over partitions [key, key, value], in_proj_z as 3. At TP 2 the
    qkv shard's three ranges are inside blocks (fallback) while z's is a whole block (sliced): one layer, both."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    pack = Pack.open(fixtures_dir / "qwen3_5-tiny-exl3-4.0bpw-mul1")
    cfg = make_config(vllm_layers, pack)
    pre = "model.language_model.layers.0.linear_attn"
    qkv, z = pack.module_tensors(f"{pre}.in_proj_qkv"), pack.module_tensors(f"{pre}.in_proj_z")
    key, value = 128, 256
    x = torch.randn(5, 256)
    y, layers = run_ranks(
        monkeypatch,
        tp,
        lambda: MergedColumnParallelLinear(
            256, [key, key, value, value], bias=False, quant_config=cfg, prefix=f"{pre}.in_proj_qkvz"
        ),
        [((0, 1, 2), qkv), (3, z)],
        x,
        "column",
    )
    q, k, v = ref(x, [qkv], [2 * key + value]).split([key, key, value], -1)
    zz = ref(x, [z], [value])
    parts = []
    for r in range(tp):
        for t, n in ((q, key), (k, key), (v, value), (zz, value)):
            s = n // tp
            parts.append(t[:, r * s : (r + 1) * s])
    want = torch.cat(parts, -1)
    assert relative_error(y, want) < TOL
    assert all(fallback_of(la) for la in layers)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_one_fused_shard_split_evenly(vllm_layers, monkeypatch, tp):
    """Qwen3-Next: the interleaved in_proj_qkvz is one tensor (shard id None) over one partition."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    cfg = make_config(vllm_layers)
    t = synthetic(256, 2048, seed=5)
    x = torch.randn(3, 256)
    y, layers = run_ranks(
        monkeypatch,
        tp,
        lambda: MergedColumnParallelLinear(
            256, [2048], bias=False, quant_config=cfg, prefix="linear_attn.in_proj_qkvz"
        ),
        [(None, t)],
        x,
        "column",
    )
    assert relative_error(y, ref(x, [t], [2048])) < TOL
    assert not any(fallback_of(la) for la in layers)  # 1024 / 512 / 256 per rank
    assert held(layers[0]) == (256, 2048 // tp)  # the rank holds only its columns


# ------------------------------------------------------------------------------------ vocabulary: head, embedding


@pytest.mark.parametrize("keeps_tp_rank", [True, False])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_lm_head_vocab_rows(vllm_layers, monkeypatch, fixtures_dir, tp, keeps_tp_rank):
    """The fixture's EXL3 head (1024 rows): 512 / 256 / 128 rows per rank, each rank's logits its vocabulary rows;
    the rank is read from vLLM's vocabulary split, also where the layer keeps no ``tp_rank`` (vLLM 0.25's
    ``VocabParallelEmbedding``: simulated by hiding the attribute while the method creates its weights)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    from quantpack_exl3.methods import Exl3LinearMethod

    if not keeps_tp_rank:
        create = Exl3LinearMethod.create_weights

        def without_tp_rank(self, layer, *args, **kwargs):
            saved = layer.__dict__.pop("tp_rank", None)  # vLLM before 0.26 has none to hide
            try:
                return create(self, layer, *args, **kwargs)
            finally:
                if saved is not None:
                    layer.__dict__["tp_rank"] = saved

        monkeypatch.setattr(Exl3LinearMethod, "create_weights", without_tp_rank)
    pack = Pack.open(fixtures_dir / "llama-tiny-exl3-4.0bpw-mul1")
    cfg = make_config(vllm_layers, pack)
    head = pack.module_tensors("lm_head")
    x = torch.randn(4, 256)
    y, layers = run_ranks(
        monkeypatch,
        tp,
        lambda: ParallelLMHead(1024, 256, quant_config=cfg, prefix="lm_head"),
        [(None, head)],
        x,
        "column",
    )
    assert relative_error(y, ref(x, [head], [1024])) < TOL
    assert not any(fallback_of(la) for la in layers)


def test_lm_head_off_block_rows_fall_back_and_say_so(vllm_layers, monkeypatch, caplog):
    """1088 rows (17 x 64) over 2 ranks: 544 rows each, not whole 128-row blocks. Each rank keeps the blocks its rows
    touch (rank 0: rows 0-639, rank 1: 512-1087) and selects its rows; the fallback is announced once, when the head
    is built."""
    import logging

    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    import quantpack_core.vllm.linear as lin

    monkeypatch.setattr(lin, "_reported", set())
    cfg = make_config(vllm_layers)
    head = synthetic(256, 1088, 6.0, seed=7)
    x = torch.randn(3, 256)
    with caplog.at_level(logging.WARNING, logger="vllm.quantpack.exl3"):
        y, layers = run_ranks(
            monkeypatch,
            2,
            lambda: ParallelLMHead(1088, 256, quant_config=cfg, prefix="lm_head"),
            [(None, head)],
            x,
            "column",
        )
    assert relative_error(y, ref(x, [head], [1088])) < TOL
    assert all(fallback_of(la) for la in layers)
    assert [held(la)[1] for la in layers] == [640, 576]
    notes = [r.getMessage() for r in caplog.records if "Hadamard block" in r.getMessage()]
    assert len(notes) == 1 and "lm_head" in notes[0] and "544 of 1088 features" in notes[0], notes


def test_lm_head_padded_partition_refused_when_built(vllm_layers, monkeypatch):
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    cfg = make_config(vllm_layers)
    with (
        as_rank(monkeypatch, 2, 0),
        pytest.raises(GeometryError, match=r"lm_head: the vocabulary \(1000 rows\).*--tensor-parallel-size 1"),
    ):
        ParallelLMHead(1000, 256, quant_config=cfg, prefix="lm_head")


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("vocab", [1024, 1000])
def test_int8_embedding_rows_per_rank(vllm_layers, monkeypatch, tp, vocab):
    """Each rank keeps its vocabulary rows of the int8 table; vLLM's own forward masks the ids outside them, and the
    ranks' sum (the all-reduce) is the whole table's lookup. 1000 rows leave the last rank's partition padded."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    from quantpack_core.embedding import dequantize_rows, quantize_rows

    cfg = make_config(vllm_layers)
    w = torch.randn(vocab, 256)
    q, s = quantize_rows(w)
    ids = torch.randint(0, vocab, (40,))
    total = 0
    for rank in range(tp):
        with as_rank(monkeypatch, tp, rank):
            layer = VocabParallelEmbedding(vocab, 256, quant_config=cfg, prefix="model.embed_tokens")
        feed(layer, {"qweight": q, "scales": s})
        layer.quant_method.process_weights_after_loading(layer)
        assert layer.qweight.shape[0] == layer.num_embeddings_per_partition  # only this rank's rows
        total = total + layer.forward(ids)
    torch.testing.assert_close(total, dequantize_rows(q, s)[ids].float(), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------------- experts


def make_rank_layer(tp, rank, inter=256):
    from quantpack_exl3.methods import Exl3MoEMethod

    method = Exl3MoEMethod(moe_config(tp_size=tp, tp_rank=rank), exl3_config(), LAYER)
    layer = torch.nn.Module()
    layer.layer_name = LAYER
    method.create_weights(layer, E, H, inter // tp, torch.float32)
    return method, layer


@pytest.mark.parametrize("tp", [2, 4, 8, 16])
def test_experts_summed_over_ranks(fixtures_dir, monkeypatch, caplog, tp):
    """The fixture's 8 experts (intermediate 256): at TP 2 each rank keeps one 128-channel block of every expert; at
    4 and 8 the share is inside a block and the experts are split whole (rank r keeps experts r, r + tp, ...: vLLM's
    own round-robin expert map), each rank adding only its experts' picks; at 16 half the ranks hold no expert and
    add zero. The split is announced once, by rank 0, when the layer is built. Every rank's kernel spec names the
    layer's 8 experts beside its bank's (a kernel choosing a path by picks per expert counts them over the layer's)."""
    import logging

    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    import quantpack_core.vllm.moe as moe_mod
    from quantpack_exl3.format import Exl3Format

    monkeypatch.setattr(moe_mod, "_reported", set())
    specs, spec_of = [], Exl3Format.expert_spec
    monkeypatch.setattr(Exl3Format, "expert_spec", lambda *a: specs.append(spec_of(*a)) or specs[-1])
    caplog.set_level(logging.WARNING, logger="vllm.quantpack.exl3")
    tensors = expert_tensors(fixtures_dir / HIGH)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(16)])
    w = torch.rand(16, 2, generator=g).softmax(-1)
    total = 0
    for rank in range(tp):
        method, layer = make_rank_layer(tp, rank)
        load(layer, tensors)
        method.process_weights_after_loading(layer)
        part = method.apply(layer, x, w, ids.to(torch.int32))
        mine = list(range(rank, E, tp))
        if mine:
            assert (specs[-1].num_experts, specs[-1].layer_experts) == (E if tp == 2 else len(mine), E)
        if tp == 2:  # this rank's intermediate block of every expert (laid out for vLLM's CPU MoE kernel, or not)
            from quantpack_core.vllm.cpu_moe import cpu_fused_moe_

            cpu_kernel = layer.quant_state.fn is cpu_fused_moe_
            assert layer.bank_w2.shape == ((E, H, 128) if cpu_kernel else (E, 128, H))
        elif mine:
            assert layer.bank_w2.shape == (len(mine), 256, H)  # this rank's experts, whole
            vllm_map = determine_expert_map(tp, rank, E, "round_robin")[1]
            assert layer.local_ids.tolist() == vllm_map.tolist()
            # alone, the rank's part is the layer restricted to its own experts' picks
            own = torch.isin(ids, torch.tensor(mine))
            want_part = reference_moe_forward(oracle_bank(tensors), x, ids, w * own)
            assert relative_error(part, want_part) < TOL
        else:
            assert layer.quant_state.idle and not part.any()
        total = total + part
    want = reference_moe_forward(oracle_bank(tensors), x, ids, w)
    assert relative_error(total, want) < TOL
    notes = [r.getMessage() for r in caplog.records if "split whole" in r.getMessage()]
    if tp == 2:
        assert notes == []
    else:
        assert len(notes) == 1 and f"e % {tp} == r" in notes[0] and notes[0].endswith("instead: 2"), notes
