"""``quantpack verify``: a bundled pack agrees with the logits exllamav3 stored beside it and with its bf16 source;
the same pack with one layer's output scales negated (a pack that decodes, but wrongly) is beyond the bounds (exit
1), with its reference and without one (its NLL on text); no reference and no tokenizer is a named error (exit
2)."""

import shutil

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from quantpack_core.cli import main
from quantpack_core.verify import verify_pack

pytest.importorskip("transformers")

PACK = "llama-tiny-exl3-4.0bpw-mul1"


def test_a_sound_pack_agrees_with_its_references(fixtures_dir):
    own = verify_pack(fixtures_dir / PACK)
    assert own.kind == "logits" and own.ok and own.agreement.kl <= 1e-4 and own.agreement.top1 >= 0.99
    source = verify_pack(fixtures_dir / PACK, fixtures_dir / "llama-tiny-bf16")
    assert source.kind == "model" and source.ok and source.agreement.positions == 128  # the pack's own ids


def test_a_pack_with_int8_embedding_rows_is_verified(fixtures_dir, tmp_path):
    """``quantpack embed-int8``'s output: the int8 table decodes to ``rows * scales`` for the reference model, and the
    pack stays within the bounds of its (copied) reference logits, a little further from them than the bf16 table."""
    from quantpack_core.embedding import convert_embedding_int8

    out = tmp_path / "int8"
    convert_embedding_int8(fixtures_dir / PACK, out)
    int8, own = verify_pack(out), verify_pack(fixtures_dir / PACK)
    assert int8.ok and own.agreement.kl < int8.agreement.kl < 1e-3, (int8, own)


def test_a_wrong_pack_is_beyond_the_bounds_and_no_reference_is_named(fixtures_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(fixtures_dir / PACK, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    for i in range(4):  # every layer's MLP output sign-flipped: still decodes, computes something else
        tensors[f"model.layers.{i}.mlp.down_proj.svh"] = -tensors[f"model.layers.{i}.mlp.down_proj.svh"]
    (bad / "model.safetensors").unlink()
    save_file(tensors, str(bad / "model.safetensors"))
    runner = CliRunner()
    out = runner.invoke(main, ["verify", str(bad)])
    assert out.exit_code == 1, out.output
    assert "beyond the bounds" in out.output
    good = runner.invoke(main, ["verify", str(fixtures_dir / PACK)])
    assert good.exit_code == 0 and "within the bounds" in good.output, good.output
    (bad / "reference_logits.pt").unlink()
    text = runner.invoke(main, ["verify", str(bad)])
    assert text.exit_code == 1 and "no reference: mean NLL" in text.output and "beyond the bound" in text.output
    (bad / "tokenizer.json").unlink()
    none = runner.invoke(main, ["verify", str(bad)])
    assert none.exit_code == 2 and "give --against" in none.output


def test_bad_references_and_bounds_are_named_errors(fixtures_dir, tmp_path):
    """What a user may hand over instead of a reference (a folder without a model, a file that is not a logits
    dict, another model, a model missing weights) or as bounds (NaN, a percentage) is an error naming it, exit 2,
    before anything is decoded."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "garbage.pt").write_text("hi")
    runner = CliRunner()
    pack = str(fixtures_dir / PACK)
    cases = [
        (["--against", str(tmp_path / "empty")], "not a model folder"),
        (["--against", str(tmp_path / "garbage.pt")], "not a reference logits file"),
        (["--against", str(fixtures_dir / "qwen3next-tiny-bf16")], "is another model than the pack"),
        (["--against", str(fixtures_dir / "llama-tiny-eagle-draft")], "is another model than the pack"),
        (["--max-kl", "nan"], "give a KL bound"),
        (["--min-top1", "95"], "a fraction between 0 and 1"),
    ]
    for args, needle in cases:
        out = runner.invoke(main, ["verify", pack, *args])
        assert out.exit_code == 2 and needle in out.output, (args, out.output)


def test_a_tied_config_with_a_stored_head_verifies_the_stored_head(fixtures_dir, tmp_path):
    """``tie_word_embeddings: true`` beside a stored ``lm_head`` (as exllamav3 1.4 wrote some packs): vLLM serves the
    stored head (``untie_if_head_stored``), so the reference model must too; tied, transformers overwrote one table
    with the other (KL 6.6 nats)."""
    import json

    tied = tmp_path / "tied"
    shutil.copytree(fixtures_dir / PACK, tied)
    cfg = json.loads((tied / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (tied / "config.json").write_text(json.dumps(cfg))
    got, own = verify_pack(tied), verify_pack(fixtures_dir / PACK)
    assert got.ok and abs(got.agreement.kl - own.agreement.kl) < 1e-9, (got, own)


def test_tokens_sets_the_positions_against_a_model(fixtures_dir):
    """``--tokens`` wins over the pack's own reference ids when given; without it those ids are used."""
    source = fixtures_dir / "llama-tiny-bf16"
    assert verify_pack(fixtures_dir / PACK, source, tokens=32).agreement.positions == 32


def test_without_a_reference_heads_the_shapes_cannot_tell_are_caught_on_text(fixtures_dir, tmp_path):
    """8 heads of 32 with 4 key-value heads in llama-tiny's config (4 of 64 and 2): every projection keeps its
    stored shape, the pack check accepts it, and vLLM would serve garbage (KL 4.41 nats against the reference with 2
    key-value heads). With no reference, verify runs the pack on Python source: the sound pack's NLL is 0.20 of a
    uniform guess, this one's above the guess itself (verify.TEXT_BOUND)."""
    import json

    from quantpack_core import Pack
    from quantpack_core.verify import TEXT_BOUND

    pack = tmp_path / "heads"
    shutil.copytree(fixtures_dir / PACK, pack)
    (pack / "reference_logits.pt").unlink()
    config = json.loads((pack / "config.json").read_text())
    config.update(num_attention_heads=8, head_dim=32, num_key_value_heads=4)
    (pack / "config.json").write_text(json.dumps(config))
    Pack.open(pack)  # no tensor tells
    wrong = verify_pack(pack)
    assert wrong.kind == "text" and not wrong.ok and wrong.nll > wrong.uniform
    shutil.copy(fixtures_dir / PACK / "config.json", pack / "config.json")
    sound = verify_pack(pack)
    assert sound.ok and sound.nll < 0.25 * sound.uniform < TEXT_BOUND * sound.uniform
