"""``quantpack inspect --tp N``: each quantized module's cut at N ranks (exact on whole 128-feature blocks, the block
fallback, or refused), the weights and KV cache per rank, checked against the split written out here from the
fixture packs' shapes and config."""

import json

import pytest
from click.testing import CliRunner

from quantpack_core import Pack
from quantpack_core.cli import main
from quantpack_core.tp_report import EXACT, FALLBACK, REFUSED, kv_element_bytes, tp_report

LLAMA = "llama-tiny-exl3-4.0bpw-mul1"
MOE = "qwen3moe-tiny-exl3-mixed-k"


def expected(features: int, tp: int) -> tuple[str, int, int]:
    """(outcome, rank 0's share, features rank 0 keeps) of an even split of ``features`` over ``tp`` ranks."""
    if features % tp:
        return REFUSED, 0, 0
    share = features // tp
    if share % 128 == 0:
        return EXACT, share, share
    return FALLBACK, share, -(-share // 128) * 128


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_llama_cuts_follow_the_block_rule(fixtures_dir, tp):
    pack = Pack.open(fixtures_dir / LLAMA)
    cfg = json.loads((fixtures_dir / LLAMA / "config.json").read_text())
    r = tp_report(pack, tp)
    assert len(r.cuts) == sum(m.format == "exl3" for m in pack.modules.values())
    for c in r.cuts:
        m = pack.modules[c.key]
        if tp == 1:
            assert c.outcome == EXACT and c.rank_bytes == m.nbytes
            continue
        n_in, n_out = m.padded_shape
        name = c.key.rsplit(".", 1)[-1]
        if name in ("k_proj", "v_proj") and cfg["num_key_value_heads"] < tp:  # one replicated head per rank
            want = (EXACT, 64, 64) if cfg["head_dim"] % 128 == 0 else (FALLBACK, 64, 128)
        else:
            want = expected(n_in if name in ("o_proj", "down_proj") else n_out, tp)
        assert (c.outcome, c.share, c.kept) == want, c
    heads = max(1, cfg["num_key_value_heads"] // tp)
    assert r.attention_layers == cfg["num_hidden_layers"]
    assert r.kv_bytes_per_token == 2 * cfg["num_hidden_layers"] * heads * cfg["head_dim"] * 2
    assert r.weights_bytes <= sum(m.nbytes for m in pack.modules.values())


def test_experts_below_a_block_fall_back_to_whole_experts(fixtures_dir):
    """Intermediate 256: 128 channels per rank at TP 2 (exact), 64 at TP 4 (whole experts per rank instead)."""
    pack = Pack.open(fixtures_dir / MOE)
    experts = lambda r: [c for c in r.cuts if ".experts." in c.key]  # noqa: E731
    assert {c.outcome for c in experts(tp_report(pack, 2))} == {EXACT}
    four = experts(tp_report(pack, 4))
    assert {c.outcome for c in four} == {FALLBACK}
    assert all("whole experts" in c.why for c in four)


def test_a_format_without_the_fallback_refuses_inexact_shares(fixtures_dir):
    """escha keeps no blocks around a share: what EXL3 loads through the fallback is refused."""
    pack = Pack.open(fixtures_dir / LLAMA)
    exl3, escha = tp_report(pack, 2), tp_report(pack, 2, fallback=False)
    assert {c.key for c in escha.refused} == {c.key for c in exl3.fallbacks}


def test_cli_lists_fallbacks_and_exits_1_on_refusals(fixtures_dir):
    runner = CliRunner()
    ok = runner.invoke(main, ["inspect", str(fixtures_dir / LLAMA), "--tp", "2", "--max-model-len", "1024"])
    assert ok.exit_code == 0, ok.output
    assert "model.layers.0.mlp.gate_proj" in ok.output and "fallback" in ok.output
    assert "0 refused" in ok.output and "KV cache per rank: 1.00 KiB per token (4 attention layers" in ok.output
    assert "bytes per storage kind: dense 0.5 MiB, exl3 1.5 MiB" in ok.output
    assert "note: --max-model-len" not in ok.output  # 1024 is the model's own length
    long = runner.invoke(main, ["inspect", str(fixtures_dir / LLAMA), "--max-model-len", "32768"])
    assert long.exit_code == 0 and "beyond the model's max_position_embeddings 1024" in long.output, long.output
    bad = runner.invoke(main, ["inspect", str(fixtures_dir / LLAMA), "--tp", "3"])
    assert bad.exit_code == 1
    assert "640 features do not split evenly over 3 ranks" in bad.output
    # no per-rank weight figure for a model no rank can hold; the servable one states it
    assert "not servable" in bad.output and "weights per rank" not in bad.output
    assert "weights per rank about" in ok.output


def test_kv_cache_element_follows_the_kv_cache_dtype(fixtures_dir):
    """auto takes the model's dtype (4 bytes for a float32 model), fp8 one byte; an unknown name is a usage error."""
    assert kv_element_bytes({"torch_dtype": "float32"}) == 4
    assert kv_element_bytes({"dtype": "bfloat16"}) == 2 and kv_element_bytes({}) == 2
    assert kv_element_bytes({"dtype": "float32"}, "fp8_e4m3") == 1
    with pytest.raises(ValueError, match="unknown KV-cache dtype 'int3'"):
        kv_element_bytes({}, "int3")
    pack = Pack.open(fixtures_dir / LLAMA)
    assert tp_report(pack, 2, kv_cache_dtype="fp8").kv_bytes_per_token * 2 == tp_report(pack, 2).kv_bytes_per_token
    runner = CliRunner()
    fp8 = runner.invoke(main, ["inspect", str(fixtures_dir / LLAMA), "--tp", "2", "--kv-cache-dtype", "fp8"])
    assert fp8.exit_code == 0 and "0.50 KiB per token (4 attention layers, 1-byte elements)" in fp8.output
    for args in (["--tp", "2"], []):  # refused before the pack is read, with or without --tp
        bad = runner.invoke(main, ["inspect", str(fixtures_dir / LLAMA), *args, "--kv-cache-dtype", "int3"])
        assert bad.exit_code == 2 and "unknown KV-cache dtype 'int3'" in bad.output
        assert "model.layers.0" not in bad.output


def test_a_tensor_of_several_partitions_is_split_per_partition(fixtures_dir):
    """Qwen3.5's GDN in_proj_qkv holds q, k, v (128, 128, 256 here): at TP 2 rank 0 owns 64 + 64 + 128 features in
    three spans, off the blocks, so the loader keeps the three blocks they touch (384 features) - not one exact
    256-feature half."""
    pack = Pack.open(fixtures_dir / "qwen3_5-tiny-exl3-4.0bpw-mul1")
    cuts = [c for c in tp_report(pack, 2).cuts if c.key.endswith("in_proj_qkv")]
    assert cuts and all((c.outcome, c.share, c.kept) == (FALLBACK, 256, 384) for c in cuts)


def test_head_counts_vllm_refuses(fixtures_dir):
    """4 attention heads over 8 ranks: vLLM refuses the model whatever the modules' cuts."""
    r = tp_report(Pack.open(fixtures_dir / LLAMA), 8)
    assert any("4 attention heads do not divide over 8 ranks" in why for why in r.model_refusals)
    out = CliRunner().invoke(main, ["inspect", str(fixtures_dir / LLAMA), "--tp", "8"])
    assert out.exit_code == 1 and "the model cannot be served at tensor parallelism 8" in out.output


def test_a_padded_vocabulary_is_refused_only_where_tensor_parallelism_cuts_the_head(fixtures_dir, tmp_path):
    """vocab_size 1000 over llama-tiny's 1,024 stored rows: served at size 1 (the pack check accepts it, the
    embedding keeps the vocabulary's rows); at size 2 vLLM pads the vocabulary to 1,024 rows split 512 / 512 and a
    quantized head is cut to whole vocabulary rows, so the model is refused there (as the head's method refuses it
    when vLLM builds it); a vocabulary of 1,024 is not."""
    import shutil

    pack = tmp_path / "p"
    shutil.copytree(fixtures_dir / "llama-tiny-exl3-4.0bpw-mul1", pack)
    config = json.loads((pack / "config.json").read_text())
    (pack / "config.json").write_text(json.dumps({**config, "vocab_size": 1000}))
    p = Pack.open(pack)
    assert not tp_report(p, 1).model_refusals
    refused = tp_report(p, 2).model_refusals
    assert any("1000-token vocabulary does not fill the 2 partitions" in why for why in refused), refused
    assert not tp_report(Pack.open(fixtures_dir / "llama-tiny-exl3-4.0bpw-mul1"), 2).model_refusals
