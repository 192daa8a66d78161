"""``quantpack verify``: a bundled pack agrees with the logits exllamav3 stored beside it and with its bf16 source;
the same pack with one layer's output scales negated (a pack that decodes, but wrongly) is beyond the bounds (exit
1); no reference is a named error (exit 2)."""

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
