"""``quantpack inspect``'s figures beyond the checks: the note on a config whose stated bit counts contradict the
tensors, and sizes printed in a unit that shows them."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from quantpack_core.cli import main

LLAMA = "llama-tiny-exl3-4.0bpw-mul1"


@pytest.mark.parametrize(
    ("change", "noted"),
    [
        (
            {"bits": 2.0, "head_bits": 3},
            "bits 2 and head_bits 3, but the decoder layers' mean K is 4.00 and lm_head's K is 6",
        ),
        ({"bits": 3.6}, None),  # within half a bit of the layers' mean K 4: a fractional target's mix straddles it
        ({"bits": 3.4}, "bits 3.4, but the decoder layers' mean K is 4.00"),
        ({"head_bits": 8}, "head_bits 8, but lm_head's K is 6"),
    ],
)
def test_stated_bits_that_contradict_the_tensors_are_noted(fixtures_dir, tmp_path, change, noted):
    """The 4.0 bpw pack (every decoder layer K 4, head K 6) with its config's bits / head_bits changed: inspect still
    passes (no loader reads those figures) and notes the contradiction; the pack as made gets no note."""
    runner = CliRunner()
    as_made = runner.invoke(main, ["inspect", str(fixtures_dir / LLAMA)])
    assert as_made.exit_code == 0 and "note: quantization_config says" not in as_made.output
    dst = tmp_path / "p"
    shutil.copytree(fixtures_dir / LLAMA, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"].update(change)
    (dst / "config.json").write_text(json.dumps(config))
    out = runner.invoke(main, ["inspect", str(dst)])
    assert out.exit_code == 0, out.output
    if noted is None:
        assert "note: quantization_config says" not in out.output
    else:
        assert f"note: quantization_config says {noted}: the tensors are what is served" in out.output


def test_a_short_sequence_s_kv_cache_is_printed_in_kib(fixtures_dir):
    """4 attention layers x 2 KV heads x 64 features x K and V x 2 bytes = 2 KiB per token at TP 1 (1 KiB per rank
    at TP 2): 512 tokens are 512 KiB per rank at TP 2 - where a GiB figure read 0.000 - and 128 tokens 256 KiB."""
    config = json.loads((fixtures_dir / LLAMA / "config.json").read_text())
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    per_token = config["num_hidden_layers"] * kv * (config["hidden_size"] // heads) * 2 * 2
    runner = CliRunner()
    for tp, tokens in ((2, 512), (1, 128)):
        out = runner.invoke(
            main, ["inspect", str(fixtures_dir / LLAMA), "--tp", str(tp), "--max-model-len", str(tokens)]
        )
        nbytes = per_token // tp * tokens
        want = f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.2f} KiB"
        assert f", {want} for one sequence of {tokens} tokens" in out.output, out.output


def test_sizes_no_tensor_proves_are_noted(fixtures_dir):
    """llama-tiny's head split (4 x 64, 2 key-value heads) stores exactly as 8 x 32 with 4: inspect says no tensor
    proves it and points at verify; Qwen3-MoE's per-head q_norm / k_norm give head_dim, so no such note."""
    runner = CliRunner()
    llama = runner.invoke(main, ["inspect", str(fixtures_dir / LLAMA)])
    assert llama.exit_code == 0, llama.output
    assert "note: no tensor proves the split of the attention into num_attention_heads 4 x head_dim 64" in llama.output
    assert "quantpack verify PACK" in llama.output
    moe = runner.invoke(main, ["inspect", str(fixtures_dir / "qwen3moe-tiny-exl3-4.0bpw-mul1")])
    assert moe.exit_code == 0 and "no tensor proves" not in moe.output, moe.output
