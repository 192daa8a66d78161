"""``quantpack escha-from-exl3``: the mcg llama-tiny fixture becomes an escha pack whose every coded module computes
what the EXL3 module did, with int8 tables, ``layer_meta`` and optional biases; other codebooks, a non-empty output
and a source pack are never touched or overwritten."""

import hashlib
import json
import math

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from quantpack_core import Pack
from quantpack_core.codec import reference_linear as exl3_linear
from quantpack_escha.codec import EschaTensors, reference_linear
from quantpack_escha.convert import ConversionError, escha_from_exl3

SOURCE = "llama-tiny-exl3-4.0bpw-mcg"


def digest(folder):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir()) if f.is_file()}


def tensors(folder):
    with safe_open(str(folder / "model.safetensors"), "pt") as st:
        return {k: st.get_tensor(k) for k in st.keys()}


@pytest.fixture(scope="module")
def converted(fixtures_dir, tmp_path_factory):
    src = fixtures_dir / SOURCE
    before = digest(src)
    out = tmp_path_factory.mktemp("escha") / "pack"
    report = escha_from_exl3(src, out, biases=True, random_split=True)
    assert digest(src) == before, "the source pack was modified"
    return src, out, report


def test_every_coded_module_computes_the_exl3_module(converted):
    src, out, report = converted
    pack = Pack.open(src)
    got = tensors(out)
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "escha" and cfg["attention_bias"] and cfg["mlp_bias"]
    exl3 = [k for k, m in pack.modules.items() if m.format == "exl3" and not k.endswith("lm_head")]
    assert sorted(qc["layer_meta"]) == sorted(exl3) == sorted(report.coded)
    for key in exl3:
        t = pack.exl3_tensors(key)
        e = EschaTensors.from_tensors({s.split(".")[-1]: v for s, v in got.items() if s.rsplit(".", 1)[0] == key})
        assert torch.equal(e.code, t.trellis)
        assert qc["layer_meta"][key]["K"] == e.k_bits == int(t.k_bits)
        assert not torch.allclose(e.rin.float(), t.suh.float() / math.sqrt(128))  # a nontrivial split
        assert e.bias is not None and float(e.bias.abs().min()) > 0
        x = torch.randn(3, t.padded_shape[0], dtype=torch.float64)
        y, ref = reference_linear(x, e, torch.float64), exl3_linear(x, t, torch.float64)
        assert float((y - ref).norm() / ref.norm()) < 3e-3, key


def test_the_default_split_is_plain_and_the_output_the_same_each_time(fixtures_dir, tmp_path):
    """Without --random-split: s_in = s_out = 1 and rin / rout the EXL3 scales over sqrt(128) in float16, no biases,
    and two conversions of the same pack give the same files byte for byte."""
    first = escha_from_exl3(fixtures_dir / SOURCE, tmp_path / "a").out_dir
    second = escha_from_exl3(fixtures_dir / SOURCE, tmp_path / "b").out_dir
    assert digest(first) == digest(second)
    pack, got = Pack.open(fixtures_dir / SOURCE), tensors(first)
    coded = [k for k, m in pack.modules.items() if m.format == "exl3" and not k.endswith("lm_head")]
    for key in coded:
        t = pack.exl3_tensors(key)
        assert torch.equal(got[f"{key}.escha_s_in"], torch.ones_like(got[f"{key}.escha_s_in"]))
        assert torch.equal(got[f"{key}.escha_s_out"], torch.ones_like(got[f"{key}.escha_s_out"]))
        assert torch.equal(got[f"{key}.escha_rin"], (t.suh.float() / math.sqrt(128)).half())
        assert torch.equal(got[f"{key}.escha_rout"], (t.svh.float() / math.sqrt(128)).half())
        assert f"{key}.bias" not in got


def test_tables_are_int8_rows_with_float16_scales(converted, fixtures_dir):
    _, out, report = converted
    got = tensors(out)
    assert set(report.int8_tables) == {"model.embed_tokens", "lm_head"}
    for key in report.int8_tables:
        q, s = got[f"{key}.weight_int8"], got[f"{key}.weight_scale"]
        assert q.dtype == torch.int8 and s.dtype == torch.float16 and q.shape == (1024, 256) and s.shape == (1024,)
        assert f"{key}.weight" not in got
    emb = Pack.open(fixtures_dir / SOURCE).get_tensor("model.embed_tokens.weight").float()
    back = got["model.embed_tokens.weight_int8"].float() * got["model.embed_tokens.weight_scale"].float()[:, None]
    assert float((back - emb).norm() / emb.norm()) < 0.01


def test_other_codebooks_and_non_empty_outputs_are_refused(fixtures_dir, tmp_path):
    with pytest.raises(ConversionError, match=r"mul1 codebook .* escha decodes mcg codes only"):
        escha_from_exl3(fixtures_dir / "llama-tiny-exl3-4.0bpw-mul1", tmp_path / "a")
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").iterdir())
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="never overwrites"):
        escha_from_exl3(fixtures_dir / SOURCE, tmp_path / "b")
    assert (tmp_path / "b" / "keep.txt").read_text() == "mine"
    (tmp_path / "c").write_text("mine too")
    with pytest.raises(FileExistsError, match="is a file; --out names the folder"):
        escha_from_exl3(fixtures_dir / SOURCE, tmp_path / "c")
    with pytest.raises(FileExistsError, match=r"lies below .*c, which is a file, not a folder"):
        escha_from_exl3(fixtures_dir / SOURCE, tmp_path / "c" / "d")
    assert (tmp_path / "c").read_text() == "mine too"


def test_outputs_inside_the_source_or_through_links_are_refused(fixtures_dir, tmp_path):
    """--out inside the source pack (or the pack itself) and a symbolic link as --out (dangling or not) are refused
    before anything is written; the source pack is left as it was."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(fixtures_dir / SOURCE, src)
    before = sorted(p.name for p in src.iterdir())
    for out in (src / "sub", src, src / "a" / "b"):
        with pytest.raises(FileExistsError, match=r"inside the source pack|never overwrites"):
            escha_from_exl3(src, out)
    assert sorted(p.name for p in src.iterdir()) == before
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "linked").symlink_to(tmp_path / "empty", target_is_directory=True)
    (tmp_path / "empty").mkdir()
    for link in ("dangling", "linked"):
        with pytest.raises(FileExistsError, match="is a symbolic link"):
            escha_from_exl3(src, tmp_path / link)
    assert not (tmp_path / "nowhere").exists() and not any((tmp_path / "empty").iterdir())


def test_a_failed_write_leaves_no_partial_pack(fixtures_dir, tmp_path, monkeypatch):
    """A write that fails (a full disk, simulated) leaves neither OUT nor a hidden partial folder beside it, so the
    same command can run again."""
    import errno

    from quantpack_escha import convert

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(convert, "save_file", full)
    with pytest.raises(OSError, match="No space left"):
        escha_from_exl3(fixtures_dir / SOURCE, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    report = escha_from_exl3(fixtures_dir / SOURCE, tmp_path / "out")
    assert (report.out_dir / "config.json").exists() and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_written_files_have_default_modes_and_no_source_logits(converted):
    """The converted pack's files get the umask's default mode (not a private 0600), and the source's exllamav3
    reference logits, which describe the EXL3 pack and not this one, are not copied."""
    import os

    _, out, _ = converted
    umask = os.umask(0)
    os.umask(umask)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask
    assert not (out / "reference_logits.pt").exists()


def test_the_quantpack_cli_runs_the_converter(fixtures_dir, tmp_path):
    from quantpack_core.cli import main

    res = CliRunner().invoke(main, ["escha-from-exl3", str(fixtures_dir / SOURCE), "--out", str(tmp_path / "p")])
    assert res.exit_code == 0, res.output
    assert "28 coded modules (K 4)" in res.output and (tmp_path / "p" / "config.json").exists()
    assert "random" not in res.output
    res = CliRunner().invoke(
        main, ["escha-from-exl3", str(fixtures_dir / SOURCE), "--out", str(tmp_path / "r"), "--random-split"]
    )
    assert res.exit_code == 0 and "random scale split" in res.output, res.output
    assert digest(tmp_path / "r")["model.safetensors"] != digest(tmp_path / "p")["model.safetensors"]
    res = CliRunner().invoke(main, ["escha-from-exl3", str(fixtures_dir / "llama-tiny-exl3-4.0bpw-mul1"),
                                    "--out", str(tmp_path / "q")])  # fmt: skip
    assert res.exit_code == 2 and "error:" in res.output and "mcg" in res.output
    for seed in ("99999999999999999999", "-1"):  # torch's generator takes 0 .. 2**63 - 1
        res = CliRunner().invoke(main, ["escha-from-exl3", str(fixtures_dir / SOURCE), "--out", str(tmp_path / "s"),
                                        "--seed", seed])  # fmt: skip
        assert res.exit_code == 2 and "--seed" in res.output and not (tmp_path / "s").exists(), res.output
    res = CliRunner().invoke(main, ["escha-from-exl3", str(fixtures_dir / SOURCE), "--out", ""])
    assert res.exit_code == 2 and "'--out': is empty" in res.output, res.output


def test_inspect_names_escha_modules_and_their_tensor_parallel_cuts(converted):
    """``quantpack inspect`` opens an escha pack (its config says escha, not exl3): every coded module as ``escha``
    with the K its code's width holds, the mcg codebook and the padded shape; the int8 tables as int8 rows; the K
    histogram; and with ``--tp 2`` the modules whose shares are not whole 128-feature blocks, refused (escha has no
    block fallback), exit status 1."""
    from quantpack_core.cli import main

    _, out, report = converted
    res = CliRunner().invoke(main, ["inspect", str(out)])
    assert res.exit_code == 0, res.output
    rows = {line.split()[0]: line.split() for line in res.output.splitlines() if line.startswith(("model.", "lm_"))}
    for key in report.coded:
        assert rows[key][1:4] == ["escha", "4", "mcg"], rows[key]
    assert rows["model.layers.0.mlp.down_proj"][4] == "640x256"
    assert rows["model.embed_tokens"][1] == rows["lm_head"][1] == "int8-rows"
    assert "escha modules K=4: 28" in res.output and "int8-rows 0.5 MiB" in res.output
    res = CliRunner().invoke(main, ["inspect", str(out), "--tp", "2"])
    assert res.exit_code == 1, res.output
    assert "model.layers.0.mlp.down_proj" in res.output and "20 refused" in res.output
    assert "not whole 128-feature blocks" in res.output


def _as_mcg(src, dst):
    """A copy of a mul1 EXL3 pack with every ``.mul1`` marker replaced by an mcg one and the configs saying mcg: a
    pack the converter takes as mcg-coded (the decoded values are not the source's; only the layout matters here)."""
    import json

    from safetensors.torch import load_file, save_file

    from quantpack_core.codec import Codebook

    dst.mkdir()
    m = Codebook.MCG.multiplier
    marker = torch.tensor(m - (1 << 32) if m >= 1 << 31 else m, dtype=torch.int32)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            t = load_file(str(f))
            for name in [n for n in t if n.endswith(".mul1")]:
                del t[name]
                t[name.removesuffix(".mul1") + ".mcg"] = marker.clone()
            save_file(t, str(dst / f.name), {"format": "pt"})
        elif f.name in ("config.json", "quantization_config.json"):
            text = f.read_text().replace('"mul1"', '"mcg"').replace(".mul1", ".mcg")
            (dst / f.name).write_text(text)
            json.loads(text)
        elif f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_moe_packs_and_int8_tables_are_refused_before_anything_is_written(fixtures_dir, tmp_path):
    """Coded experts: the escha config refuses expert banks at load, so the converter refuses them first, naming an
    expert; a table that ``quantpack embed-int8`` already turned into int8 rows is named as such, with the fix."""
    from quantpack_core.embedding import convert_embedding_int8

    moe = _as_mcg(fixtures_dir / "qwen3moe-tiny-exl3-4.0bpw-mul1", tmp_path / "moe")
    with pytest.raises(ConversionError, match=r"layers\.\d+\.mlp\.experts\.\d+\.\w+: an expert of an MoE bank"):
        escha_from_exl3(moe, tmp_path / "out-moe")
    assert not (tmp_path / "out-moe").exists()
    int8 = tmp_path / "int8"
    convert_embedding_int8(fixtures_dir / SOURCE, int8)
    with pytest.raises(ConversionError, match=r"embed_tokens: already int8 rows \(quantpack embed-int8\); convert"):
        escha_from_exl3(int8, tmp_path / "out-int8")
    assert not (tmp_path / "out-int8").exists()


@pytest.mark.parametrize("options", [[], ["--random-split", "--biases"]], ids=["plain", "random-split-biases"])
def test_quantpack_verify_accepts_the_converted_pack(fixtures_dir, tmp_path, options):
    """``quantpack verify`` takes the escha pack the converter writes (decoded by this plugin's dense decoder, its
    biases not applied as escha serves it) against the source EXL3 pack's exllamav3 logits: within verify's bounds
    for logits (KL <= 1e-2, top-1 >= 95%); the escha pack carries no reference of its own, so without --against verify
    runs it on Python source and holds its NLL against a uniform guess (within 0.6 of it)."""
    pytest.importorskip("transformers")
    from quantpack_core.cli import main

    out = tmp_path / "escha"
    res = CliRunner().invoke(main, ["escha-from-exl3", str(fixtures_dir / SOURCE), "--out", str(out), *options])
    assert res.exit_code == 0, res.output
    reference = fixtures_dir / SOURCE / "reference_logits.pt"
    res = CliRunner().invoke(main, ["verify", str(out), "--against", str(reference)])
    assert res.exit_code == 0 and "within the bounds" in res.output, res.output
    res = CliRunner().invoke(main, ["verify", str(out)])
    assert res.exit_code == 0 and "no reference: mean NLL" in res.output, res.output
    assert "within the bound (NLL <= " in res.output, res.output
