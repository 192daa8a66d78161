"""The pack reader's inventory and every validation error, on small packs built here.

Each bad pack must be reported with the module, the tensor and a fix, and must come out of the check unmodified.
"""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from quantpack_core import Codebook, Pack, PackError
from quantpack_core.check import values
from quantpack_core.inventory import INT8_ROW_NAMES
from quantpack_core.synthetic import random_exl3_layer, write_pack

#: the synthetic packs here hold a few modules of a layer, so their config names a model class whose layer the
#: project does not state (a real class's layer rule, quantpack_core.check.architectures.architecture_layer, would
#: name every module they lack; its own tests are in test_layout.py)
CONFIG = {"architectures": ["SyntheticForCausalLM"], "model_type": "llama", "hidden_size": 256}


def layer_tensors(prefix, in_f, out_f, k, codebook="mul1", seed=0):
    g = torch.Generator().manual_seed(seed)
    return {f"{prefix}.{s}": t for s, t in random_exl3_layer(in_f, out_f, k, codebook, generator=g).items()}


def base_tensors():
    t = {}
    t.update(layer_tensors("model.layers.0.self_attn.q_proj", 256, 256, 4, seed=1))
    t.update(layer_tensors("model.layers.0.mlp.down_proj", 640, 256, 2.5, seed=2))
    t.update(layer_tensors("lm_head", 256, 1024, 6, "mcg", seed=3))
    t["model.embed_tokens.weight"] = torch.randn(1024, 256).to(torch.bfloat16)
    t["model.norm.weight"] = torch.ones(256, dtype=torch.bfloat16)
    return t


def snapshot(path: Path) -> dict:
    """Every entry of the pack folder: a file's hash, a link's target, or "dir"."""

    def state(p: Path) -> str:
        if p.is_symlink():
            return f"-> {p.readlink()}"
        return hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"

    return {p.name: state(p) for p in sorted(path.iterdir())}


def expect_problem(path: Path, *needles, **open_kw):
    before = snapshot(path)
    with pytest.raises(PackError) as ei:
        Pack.open(path, **open_kw)
    msg = str(ei.value)
    for n in needles:
        assert n in msg, f"{n!r} not in:\n{msg}"
    assert "->" in msg  # every problem carries its fix
    assert snapshot(path) == before, "the check modified the pack"
    return ei.value


def test_inventory_of_a_sound_pack(tmp_path):
    path = write_pack(tmp_path / "p", base_tensors(), CONFIG)
    pack = Pack.open(path)
    m = pack.modules
    assert m["model.layers.0.mlp.down_proj"].k_bits == 2.5
    assert m["model.layers.0.mlp.down_proj"].padded_shape == (640, 256)
    assert m["lm_head"].codebook is Codebook.MCG and m["lm_head"].k_bits == 6
    assert m["model.embed_tokens"].format == "dense"
    assert m["model.embed_tokens"].logical_shape == (256, 1024)
    assert pack.bits_histogram() == {2.5: 1, 4.0: 1, 6.0: 1}
    t = pack.exl3_tensors("model.layers.0.self_attn.q_proj")
    assert t.codebook is Codebook.MUL1 and t.k_bits == 4


def test_sharded_pack_with_index(tmp_path):
    path = write_pack(tmp_path / "p", base_tensors(), CONFIG, shards=3)
    pack = Pack.open(path)
    assert len(pack.files) == 3
    assert torch.equal(pack.get_tensor("model.norm.weight"), torch.ones(256, dtype=torch.bfloat16))
    assert sum(1 for _ in pack.iter_tensors()) == len(base_tensors())


def test_fixture_packs_are_sound(fixtures_dir):
    for d in sorted(fixtures_dir.glob("*-exl3-*")):
        pack = Pack.open(d)
        assert pack.bits_histogram(), d


def test_illegal_trellis_width(tmp_path):
    t = base_tensors()
    t["model.layers.0.self_attn.q_proj.trellis"] = t["model.layers.0.self_attn.q_proj.trellis"][..., :60].clone()
    expect_problem(
        write_pack(tmp_path / "p", t, CONFIG), "model.layers.0.self_attn.q_proj.trellis", "width 60", "re-quantize"
    )


def test_suh_svh_length_against_trellis(tmp_path):
    t = base_tensors()
    t["model.layers.0.mlp.down_proj.suh"] = t["model.layers.0.mlp.down_proj.suh"][:512].clone()
    t["lm_head.svh"] = torch.ones(1000, dtype=torch.float16)
    err = expect_problem(
        write_pack(tmp_path / "p", t, CONFIG),
        "model.layers.0.mlp.down_proj.suh",
        "needs [640]",
        "lm_head.svh",
        "needs [1024]",
    )
    assert len(err.problems) == 2


def test_both_markers(tmp_path):
    t = base_tensors()
    t["lm_head.mul1"] = torch.tensor(0x83DCD12D - (1 << 32), dtype=torch.int32)
    expect_problem(write_pack(tmp_path / "p", t, CONFIG), "lm_head.mul1", "both .mcg and .mul1")


def test_unknown_marker_value(tmp_path):
    t = base_tensors()
    t["lm_head.mcg"] = torch.tensor(7, dtype=torch.int32)
    expect_problem(write_pack(tmp_path / "p", t, CONFIG), "lm_head.mcg", "0x00000007", "re-quantize")


def test_missing_tensor_of_a_group(tmp_path):
    t = base_tensors()
    del t["model.layers.0.self_attn.q_proj.svh"]
    del t["model.layers.0.mlp.down_proj.trellis"]
    expect_problem(
        write_pack(tmp_path / "p", t, CONFIG, manifest=False),
        "model.layers.0.self_attn.q_proj.svh",
        "missing (the trellis is there)",
        "model.layers.0.mlp.down_proj.trellis",
        "no trellis",
    )


def test_shard_listed_in_index_but_absent(tmp_path):
    path = write_pack(tmp_path / "p", base_tensors(), CONFIG, shards=2)
    (path / "model-00002-of-00002.safetensors").unlink()
    expect_problem(path, "model-00002-of-00002.safetensors", "the file is absent", "download")


def test_tensor_in_shard_but_not_in_index(tmp_path):
    path = write_pack(tmp_path / "p", base_tensors(), CONFIG, shards=2)
    idx = json.loads((path / "model.safetensors.index.json").read_text())
    del idx["weight_map"]["model.norm.weight"]
    (path / "model.safetensors.index.json").write_text(json.dumps(idx))
    expect_problem(path, "model.norm.weight", "not listed in model.safetensors.index.json")


def test_tensor_in_index_but_not_in_shard(tmp_path):
    path = write_pack(tmp_path / "p", base_tensors(), CONFIG, shards=2)
    idx = json.loads((path / "model.safetensors.index.json").read_text())
    idx["weight_map"]["model.layers.0.ghost.weight"] = "model-00001-of-00002.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(idx))
    expect_problem(path, "model.layers.0.ghost.weight", "absent from that file")


def test_truncated_file(tmp_path):
    path = write_pack(tmp_path / "p", base_tensors(), CONFIG)
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    err = expect_problem(path, "model.safetensors", "truncated", "re-download model.safetensors")
    assert len(err.problems) == 1, err  # no knock-on reports for the tensors inside it


def test_file_truncated_inside_its_header(tmp_path):
    path = write_pack(tmp_path / "p", base_tensors(), CONFIG)
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    err = expect_problem(path, "model.safetensors", "header length")
    assert len(err.problems) == 1, err


def test_nan_in_vectors(tmp_path):
    t = base_tensors()
    t["model.layers.0.self_attn.q_proj.svh"][3] = float("nan")
    t["lm_head.suh"][0] = float("inf")
    expect_problem(
        write_pack(tmp_path / "p", t, CONFIG),
        "model.layers.0.self_attn.q_proj.svh",
        "1 of 256 values are NaN or infinite",
        "lm_head.suh",
    )


def test_dense_weight_beside_trellis(tmp_path):
    t = base_tensors()
    t["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(256, 256, dtype=torch.bfloat16)
    expect_problem(
        write_pack(tmp_path / "p", t, CONFIG), "model.layers.0.self_attn.q_proj.weight", "two versions of this layer"
    )


def test_method_only_in_quantization_config_json(tmp_path):
    path = write_pack(tmp_path / "p", base_tensors(), CONFIG)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]
    (path / "config.json").write_text(json.dumps(cfg))
    expect_problem(path, "config.json", "has no quantization_config.quant_method", "copy the quantization_config")


def test_corrupt_header(tmp_path):
    path = write_pack(tmp_path / "p", base_tensors(), CONFIG)
    f = path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:20] = b"\xff" * 12
    f.write_bytes(bytes(data))
    expect_problem(path, "model.safetensors", "corrupt")


def test_manifest_disagrees_with_file(tmp_path):
    path = write_pack(tmp_path / "p", base_tensors(), CONFIG)
    mf = json.loads((path / "quantization_config.json").read_text())
    mf["tensor_storage"]["lm_head"]["stored_tensors"]["lm_head.trellis"]["shape"] = [16, 64, 64]
    mf["tensor_storage"]["model.extra"] = {"stored_tensors": {"model.extra.weight": {"shape": [2], "dtype": "x"}}}
    (path / "quantization_config.json").write_text(json.dumps(mf))
    expect_problem(path, "lm_head.trellis", "[16, 64, 64]", "model.extra.weight", "absent")


def test_not_exl3_and_not_a_pack(tmp_path, fixtures_dir):
    expect_problem(fixtures_dir / "llama-tiny-bf16", "has no quantization_config.quant_method, not 'exl3'")
    assert Pack.open(fixtures_dir / "llama-tiny-bf16", require_exl3=False).modules["lm_head"].format == "dense"
    (tmp_path / "empty").mkdir()
    expect_problem(tmp_path / "empty", "config.json", "missing", "no safetensors file")
    with pytest.raises(PackError, match="does not exist"):
        Pack.open(tmp_path / "nowhere")


def test_lookup_errors_and_handles(fixtures_dir):
    with Pack.open(fixtures_dir / "llama-tiny-exl3-4.0bpw-mul1") as pack:
        assert "exl3=29" in repr(pack)
        with pytest.raises(KeyError, match="a dense module, not an EXL3 one"):
            pack.exl3_tensors("model.embed_tokens")
        with pytest.raises(KeyError, match=r"no such module; EXL3 modules beside it: \['model.layers.0.mlp.down_proj'"):
            pack.exl3_tensors("model.layers.0.mlp.nope")
        with pytest.raises(KeyError, match=r"has \['model.norm.weight'\]"):
            pack.get_tensor("model.norm.bias")
    assert not pack._handles


def test_two_files_without_index(tmp_path):
    path = write_pack(tmp_path / "p", base_tensors(), CONFIG)
    save_file({"x.weight": torch.zeros(2)}, str(path / "extra.safetensors"))
    expect_problem(path, "model.safetensors.index.json", "missing while the pack has 2")


def test_half_k_without_mul1(tmp_path):
    t = base_tensors()
    del t["model.layers.0.mlp.down_proj.mul1"]
    expect_problem(
        write_pack(tmp_path / "p", t, CONFIG),
        "model.layers.0.mlp.down_proj.trellis",
        "half-integer K=2.5 needs the mul1",
    )


def test_write_pack_never_overwrites(tmp_path, fixtures_dir):
    dst = tmp_path / "copy"
    shutil.copytree(fixtures_dir / "llama-tiny-exl3-4.0bpw-mul1", dst)
    with pytest.raises(FileExistsError):
        write_pack(dst, base_tensors(), CONFIG)


@pytest.mark.parametrize(
    "file,edit,needle",
    [
        ("config.json", lambda d: [], "config.json: is list"),
        ("config.json", lambda d: {**d, "quantization_config": "exl3"}, "quantization_config: is str"),
        ("quantization_config.json", lambda d: {**d, "tensor_storage": [1, 2]}, "tensor_storage: is list"),
        (
            "quantization_config.json",
            lambda d: {**d, "tensor_storage": {**d["tensor_storage"], "lm_head": "x"}},
            "tensor_storage.lm_head: is str",
        ),
        (
            "quantization_config.json",
            lambda d: {
                **d,
                "tensor_storage": {
                    **d["tensor_storage"],
                    "lm_head": {"stored_tensors": {"lm_head.suh": {"shape": None, "dtype": "float16"}}},
                },
            },
            "gives the shape None",
        ),
    ],
    ids=["config-list", "qc-string", "storage-list", "entry-string", "shape-null"],
)
def test_json_of_the_wrong_structure(tmp_path, file, edit, needle):
    """Valid JSON of the wrong shape is a listed problem, never a TypeError from deep inside."""
    path = write_pack(tmp_path / "p", base_tensors(), CONFIG)
    f = path / file
    f.write_text(json.dumps(edit(json.loads(f.read_text()))))
    expect_problem(path, file, needle)


def moe_copy(fixtures_dir, tmp_path, edit, config_edit=None) -> Path:
    """A copy of the mixed-K Qwen3-MoE pack without its manifest, tensors changed by ``edit(tensors)``."""
    from safetensors.torch import load_file

    src = fixtures_dir / "qwen3moe-tiny-exl3-mixed-k"
    dst = tmp_path / "moe"
    shutil.copytree(src, dst)
    (dst / "quantization_config.json").unlink()
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    (dst / "model.safetensors").unlink()
    save_file(tensors, str(dst / "model.safetensors"))
    if config_edit:
        cfg = json.loads((dst / "config.json").read_text())
        config_edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_moe_expert_missing_a_projection(fixtures_dir, tmp_path):
    def drop(t):
        for k in [k for k in t if k.startswith("model.layers.1.mlp.experts.5.up_proj.")]:
            del t[k]

    path = moe_copy(fixtures_dir, tmp_path, drop)
    expect_problem(path, "model.layers.1.mlp.experts.5.up_proj", "expert 5 has no EXL3 up_proj")


def test_moe_gate_and_up_at_different_k(fixtures_dir, tmp_path):
    def swap(t):  # expert 0's gate is K=4; expert 1's (K=3) takes its place
        for s in ("trellis", "suh", "svh", "mul1"):
            t[f"model.layers.0.mlp.experts.0.gate_proj.{s}"] = t[f"model.layers.0.mlp.experts.1.gate_proj.{s}"].clone()

    expect_problem(moe_copy(fixtures_dir, tmp_path, swap), "experts.0.up_proj", "gate K=3 but up K=4")


def test_moe_expert_count_against_config(fixtures_dir, tmp_path):
    path = moe_copy(fixtures_dir, tmp_path, lambda t: None, lambda c: c.update(num_experts=16))
    expect_problem(path, "model.layers.0.mlp.experts", "experts 0..7 in this layer, config.json says 16")


def test_moe_layer_with_two_codebooks(fixtures_dir, tmp_path):
    def to_3inst(t):
        del t["model.layers.1.mlp.experts.3.down_proj.mul1"]

    path = moe_copy(fixtures_dir, tmp_path, to_3inst)
    expect_problem(path, "model.layers.1.mlp.experts", "several codebooks (3inst, mul1)")


@pytest.mark.parametrize(
    "damage,needles",
    [
        (lambda p: (p / "config.json").write_text("[" * 100_000 + "]" * 100_000), ["config.json", "RecursionError"]),
        (
            lambda p: (p / "config.json").write_text(json.dumps({**CONFIG, "text_config": [1, 2]})),
            ["config.json: text_config", "is list"],
        ),
        (lambda p: (p / "model-extra.safetensors").mkdir(), ["model-extra.safetensors", "not a regular file"]),
        (
            lambda p: (p / "model-extra.safetensors").symlink_to(p / "gone.safetensors"),
            ["model-extra.safetensors", "a symbolic link to nothing"],
        ),
    ],
    ids=["deep-json", "text-config-list", "shard-directory", "dangling-symlink"],
)
def test_hostile_files_are_problems_not_crashes(tmp_path, damage, needles):
    """What a fuzz run of corrupted packs found crashing the validator (RecursionError, AttributeError,
    IsADirectoryError, FileNotFoundError) is a listed problem with its fix, and the pack is left as it was."""
    path = write_pack(tmp_path / "p", base_tensors(), CONFIG)
    damage(path)
    expect_problem(path, *needles)


def test_a_lost_codebook_marker_is_named(fixtures_dir, tmp_path):
    """Without its manifest, a layer whose .mul1 marker is gone would decode as 3INST: the pack's own codebook
    (quantization_config) names the mismatch instead."""
    from safetensors.torch import load_file

    dst = tmp_path / "p"
    shutil.copytree(fixtures_dir / "llama-tiny-exl3-4.0bpw-mul1", dst)
    (dst / "quantization_config.json").unlink()
    tensors = load_file(str(dst / "model.safetensors"))
    del tensors["model.layers.0.mlp.down_proj.mul1"]
    (dst / "model.safetensors").unlink()
    save_file(tensors, str(dst / "model.safetensors"))
    expect_problem(dst, "model.layers.0.mlp.down_proj.mul1", "its .mul1 marker is missing", "would decode as 3inst",
                   "re-download the pack's file that holds this layer")  # fmt: skip


def test_a_codebook_the_config_misstates_names_the_marker_the_layers_have(fixtures_dir, tmp_path):
    """quantization_config saying mcg for a mul1 pack: each coded module names its .mul1 marker (a tensor that
    exists) and the fix is the config's codebook, not a download; nothing in the pack is written."""
    dst = tmp_path / "p"
    shutil.copytree(fixtures_dir / "llama-tiny-exl3-4.0bpw-mul1", dst)
    (dst / "quantization_config.json").unlink()
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"]["codebook"] = "mcg"
    (dst / "config.json").write_text(json.dumps(config))
    err = expect_problem(
        dst,
        "lm_head.mul1: has a .mul1 marker, but quantization_config says codebook mcg",
        'where every coded layer has that marker, set quantization_config\'s codebook to "mul1"',
    )
    assert "lm_head.mcg" not in str(err)


def test_nan_in_a_norm_weight_is_named(tmp_path):
    """A norm weight (a dense 1-D tensor every token passes through) holding NaN / Inf is a problem, read at open."""
    tensors = base_tensors()
    tensors["model.norm.weight"][3] = float("nan")
    tensors["model.norm.weight"][5] = float("inf")
    path = write_pack(tmp_path / "p", tensors, CONFIG)
    expect_problem(path, "model.norm.weight", "2 of 256 values are NaN or infinite")


def test_nan_rows_in_the_embedding_table_are_named(tmp_path, monkeypatch):
    """A dense vocabulary table is scanned whole, in chunks of rows (made small here so that the bad rows fall in
    different chunks): the count of non-finite rows and the first one are named; a clean table passes."""
    monkeypatch.setattr(values, "TABLE_CHUNK_ELEMENTS", 256 * 100)
    tensors = base_tensors()
    rows = tensors["model.embed_tokens.weight"].shape[0]
    tensors["model.embed_tokens.weight"][rows - 1, 7] = float("-inf")
    tensors["model.embed_tokens.weight"][517, 0] = float("nan")
    tensors["model.embed_tokens.weight"][518, 3] = float("nan")
    path = write_pack(tmp_path / "p", tensors, CONFIG)
    expect_problem(path, "model.embed_tokens.weight", f"3 of {rows} rows hold NaN", "first: row 517")
    tensors = base_tensors()
    Pack.open(write_pack(tmp_path / "q", tensors, CONFIG)).close()


@pytest.mark.parametrize(
    "edit,needles",
    [
        ({"hidden_size": 512}, ["model.embed_tokens.weight", "is 1024 x 256", "hidden_size 512"]),
        ({"vocab_size": "1024"}, ["config.json", "vocab_size is '1024' (str)"]),
        ({"vocab_size": 2048}, ["model.embed_tokens.weight", "1024 rows, fewer than", "vocab_size 2048"]),
        ({"vocab_size": 1}, ["model.embed_tokens.weight", "1024 rows, 1023 more than", "vocab_size 1:"]),
        ({"vocab_size": 896}, ["model.embed_tokens.weight", "1024 rows, 128 more than", "vocab_size 896"]),
        ({"intermediate_size": 768}, ["mlp.down_proj.trellis: has 640 inputs", "intermediate_size 768"]),
        ({"num_hidden_layers": 10**9}, ["num_hidden_layers is 1000000000", "layer(s) 1, 2, 3", "999999999 in all"]),
        ({"num_hidden_layers": 2}, ["num_hidden_layers is 2", "no tensor of layer(s) 1 ->"]),
        ({"num_attention_heads": True}, ["num_attention_heads is True (bool)"]),
        ({"architectures": None}, ["architectures is None"]),
        ({"architectures": []}, ["architectures is []"]),
    ],
    ids=[
        "hidden",
        "vocab-string",
        "vocab-rows",
        "vocab-below-rows",
        "vocab-a-block-below-rows",
        "intermediate",
        "huge-layer-count",
        "missing-layer",
        "bool-heads",
        "no-arch",
        "empty-arch",
    ],
)
def test_config_that_contradicts_itself_or_the_tensors(tmp_path, edit, needles):
    """config.json values vLLM builds the model from are checked at open, against their own types and against the
    tensors: a layer the config counts but the pack lacks (absent from files and manifest alike) would otherwise fail
    only in vLLM's worker. A config whose counts fit (1 layer, 1024 rows) passes; a huge layer count is reported
    without being enumerated."""
    sound = {**CONFIG, "num_hidden_layers": 1, "vocab_size": 1024}
    Pack.open(write_pack(tmp_path / "ok", base_tensors(), sound))
    path = write_pack(tmp_path / "p", base_tensors(), {**sound, **edit})
    expect_problem(path, *needles)


def test_a_layer_past_the_configured_count_is_refused(tmp_path):
    """A tensor of a layer config.json does not count (here layer 9 of a 1-layer config) would stop vLLM's loader
    in the worker ("no module or parameter named 'layers.9'"): the pack check names the layer and a tensor of it at
    open. DeepSeek's multi-token-prediction layer (index num_hidden_layers, counted by num_nextn_predict_layers)
    is accepted."""
    sound = {**CONFIG, "num_hidden_layers": 1, "vocab_size": 1024}
    tensors = base_tensors()
    tensors["model.layers.9.foo.weight"] = torch.ones(4, 4, dtype=torch.float16)
    path = write_pack(tmp_path / "p", tensors, sound)
    expect_problem(path, "layer(s) 9 (model.layers.9.foo", "past config.json's num_hidden_layers 1")
    tensors = base_tensors()
    tensors["model.layers.1.foo.weight"] = torch.ones(4, 4, dtype=torch.float16)
    Pack.open(write_pack(tmp_path / "mtp", tensors, {**sound, "num_nextn_predict_layers": 1})).close()
    expect_problem(write_pack(tmp_path / "q", tensors, sound), "layer(s) 1 (")


def test_a_layer_without_the_norm_the_others_hold_is_refused(tmp_path):
    """vLLM checks that every weight was loaded only for unquantized models: a layer lacking the norm its stack's
    other layers hold (from the files and the manifest alike) would serve with the norm's initial ones. The check
    names the layer and the tensor; a norm only some layers hold (at most half: MTP-style extras, layer kinds of a
    hybrid) passes, and so does a DeciLM config, whose no-op blocks store no norms."""
    sound = {**CONFIG, "num_hidden_layers": 4, "vocab_size": 1024}

    def tensors(norms):
        t = base_tensors()
        for i in range(4):
            t[f"model.layers.{i}.mlp.up.weight"] = torch.ones(4, 4, dtype=torch.bfloat16)
            for norm in norms.get(i, ("input_layernorm", "post_attention_layernorm")):
                t[f"model.layers.{i}.{norm}.weight"] = torch.ones(256, dtype=torch.bfloat16)
        return t

    Pack.open(write_pack(tmp_path / "ok", tensors({}), sound)).close()
    lacking = tensors({2: ("input_layernorm",)})
    path = write_pack(tmp_path / "p", lacking, sound)
    tensor = "model.layers.2.post_attention_layernorm.weight"
    expect_problem(path, tensor, "layer(s) 2 hold no post_attention_layernorm")
    # held by two of four layers (half): not evidence that the others lost it
    half = tensors({0: ("input_layernorm", "extra_norm"), 1: ("input_layernorm", "extra_norm")})
    Pack.open(write_pack(tmp_path / "half", half, sound)).close()
    deci = {**sound, "block_configs": [{"attention": {"no_op": False}, "ffn": {"no_op": False}}] * 4}
    Pack.open(write_pack(tmp_path / "deci", lacking, deci)).close()


def test_a_bias_must_pad_to_its_layers_outputs(tmp_path):
    """An EXL3 layer's bias is its logical output width: within the last 128-feature block of the stored outputs (a
    bias of 7 for 256 stored outputs would otherwise pass, and show as the layer's logical width)."""
    for n in (256, 200, 129):
        tensors = base_tensors()
        tensors["model.layers.0.mlp.down_proj.bias"] = torch.zeros(n, dtype=torch.float16)
        Pack.open(write_pack(tmp_path / f"ok{n}", tensors, CONFIG)).close()
    for n in (7, 128, 300):
        tensors = base_tensors()
        tensors["model.layers.0.mlp.down_proj.bias"] = torch.zeros(n, dtype=torch.float16)
        path = write_pack(tmp_path / f"bad{n}", tensors, CONFIG)
        expect_problem(path, "model.layers.0.mlp.down_proj.bias", f"shape [{n}] does not fit the 256 output features")


@pytest.mark.parametrize("rows,scales", INT8_ROW_NAMES)
def test_int8_table_rows_of_another_dtype_are_refused(tmp_path, rows, scales):
    """An int8 table's rows (either naming) stored as another dtype beside their per-row scales are named: read as
    'other', the table would otherwise pass with its scales ignored."""
    tensors = base_tensors()
    table = tensors.pop("model.embed_tokens.weight")
    tensors[f"model.embed_tokens.{rows}"] = table.float()
    tensors[f"model.embed_tokens.{scales}"] = torch.ones(table.shape[0], dtype=torch.float16)
    path = write_pack(tmp_path / "p", tensors, CONFIG)
    expect_problem(path, f"model.embed_tokens.{rows}", "float32 [1024, 256], not int8")


def test_a_header_naming_a_tensor_twice_is_corrupt(tmp_path):
    """JSON readers keep one of two equal keys without a word; the header is refused, naming the tensor."""
    path = write_pack(tmp_path / "p", base_tensors(), CONFIG)
    f = path / "model.safetensors"
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    text = raw[8 : 8 + n].decode().rstrip()
    twice = text[:-1] + ', "model.norm.weight": ' + json.dumps(header["model.norm.weight"]) + "}"
    body = twice.encode() + b" " * (-len(twice) % 8)
    f.write_bytes(len(body).to_bytes(8, "little") + body + raw[8 + n :])
    expect_problem(path, "model.safetensors", "names 'model.norm.weight' twice")


@pytest.mark.parametrize(
    "edit",
    [
        {"num_experts": 0, "num_experts_per_tok": 0},  # Granite 4.0's dense variants
        {"intermediate_size": [640], "moe_intermediate_size": [640, 256]},  # Gemma 3n, ERNIE-4.5-VL: per layer / kind
        {"vocab_size": 1016, "architectures": ["MllamaForConditionalGeneration"]},  # 8 image-token rows past vocab
        {"vocab_size": 1000},  # a vocabulary the model padded: 1,024 rows for 1,000 tokens
        {"num_hidden_layers": 2, "block_configs": [{}, {"attention": {"no_op": True}, "ffn": {"no_op": True}}]},
    ],
    ids=["dense-moe-fields", "per-layer-sizes", "extra-embedding-rows", "padded-vocabulary", "decilm-no-op-blocks"],
)
def test_real_config_shapes_that_are_sound(tmp_path, edit):
    """What real checkpoints' configs do and the config check must accept: 0 experts per token, sizes given per
    layer, embedding rows past vocab_size (an architecture's own, or a vocabulary padded by under one block), DeciLM
    blocks that store no tensor (layer 1 here)."""
    Pack.open(write_pack(tmp_path / "p", base_tensors(), {**CONFIG, "num_hidden_layers": 1, **edit}))


@pytest.mark.parametrize(
    "edit,needle",
    [
        ({"num_key_value_heads": 4}, "k_proj.trellis: has 128 outputs, but config.json gives num_key_value_heads 4"),
        ({"head_dim": 32}, "o_proj.trellis: has 256 inputs, but config.json gives num_attention_heads 4 x head_dim 32"),
        ({"num_attention_heads": 8}, "o_proj.trellis: has 256 inputs, but config.json gives num_attention_heads 8"),
    ],
)
def test_attention_heads_against_the_projections(fixtures_dir, tmp_path, edit, needle):
    """A hand-edited head count or head width that no longer matches the stored k / v / o projections is named at
    open (vLLM would build layers of other shapes and fail, or mis-shape the KV cache). EXL3 pads to 128, so a
    change hidden by that padding (2 -> 1 key-value heads of 64 here) is not visible in the shapes."""
    path = tmp_path / "p"
    shutil.copytree(fixtures_dir / "llama-tiny-exl3-4.0bpw-mul1", path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **edit}))
    expect_problem(path, needle)


def test_logical_shapes_come_from_the_config_where_its_sizes_fix_them(fixtures_dir):
    """The summary's logical column for trellis-coded modules without a bias: config.json's sizes (heads x head
    width, intermediate, expert widths, vocabulary) when they pad to the stored shape; a module those sizes do not
    describe (Qwen3.5's gated q_proj, twice the heads' width) or a config that contradicts the stored shape, "-"."""
    p = Pack.open(fixtures_dir / "llama-tiny-exl3-4.0bpw-mcg")
    rows = {r[0]: r for r in p.summary_rows()}
    cfg = p.config
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * (cfg.get("head_dim") or hidden // cfg["num_attention_heads"])
    assert rows["model.layers.0.mlp.down_proj"][5] == f"{inter}x{hidden}"
    assert rows["model.layers.0.self_attn.k_proj"][5] == f"{hidden}x{kv}"
    assert rows["lm_head"][5] == f"{hidden}x{vocab}"
    assert rows["model.embed_tokens"][4] == rows["model.embed_tokens"][5] == f"{vocab}x{hidden}"  # a token in
    # a width inside the last 128-feature block is the logical one; one that pads elsewhere is not believed
    p.config = dict(cfg, intermediate_size=inter - 40)
    assert p.config_logical_shape(p.modules["model.layers.0.mlp.gate_proj"]) == (hidden, inter - 40)
    p.config = dict(cfg, intermediate_size=inter + 200)
    assert p.config_logical_shape(p.modules["model.layers.0.mlp.gate_proj"]) is None
    q = Pack.open(fixtures_dir / "qwen3_5-tiny-exl3-4.0bpw-mcg")
    rows = {r[0]: r for r in q.summary_rows()}
    assert rows["model.language_model.layers.3.self_attn.q_proj"][5] == "-"
    assert rows["model.language_model.layers.3.self_attn.o_proj"][5] != "-"
    nxt = Pack.open(fixtures_dir / "qwen3next-tiny-exl3-4.0bpw-mul1")  # the gated delta net's projections
    c, rows = nxt.config, {r[0]: r for r in nxt.summary_rows()}
    kd, vd = (
        c["linear_num_key_heads"] * c["linear_key_head_dim"],
        c["linear_num_value_heads"] * c["linear_value_head_dim"],
    )
    assert rows["model.layers.0.linear_attn.in_proj_qkvz"][5] == f"{c['hidden_size']}x{2 * kd + 2 * vd}"
    assert rows["model.layers.0.linear_attn.out_proj"][5] == f"{vd}x{c['hidden_size']}"
    moe = Pack.open(fixtures_dir / "qwen3moe-tiny-exl3-4.0bpw-mul1")
    width = moe.config["moe_intermediate_size"]
    assert {r[0]: r for r in moe.summary_rows()}["model.layers.0.mlp.experts.0.down_proj"][5].startswith(f"{width}x")


def test_one_missing_file_is_one_line_of_the_error_not_one_per_tensor(fixtures_dir, tmp_path):
    """A pack whose only safetensors file is gone: every tensor the manifest lists is absent, which the error says in
    one line (the first tensor, the next three and how many more), beside the file-level line; the problem list
    itself keeps every one."""
    import shutil

    pack = tmp_path / "p"
    shutil.copytree(fixtures_dir / "llama-tiny-exl3-4.0bpw-mul1", pack)
    (pack / "model.safetensors").unlink()
    with pytest.raises(PackError) as e:
        Pack.open(pack)
    lines = [line for line in str(e.value).splitlines() if line.startswith("  - ")]
    assert len(e.value.problems) == 127 and len(lines) == 2, str(e.value)[:2000]
    assert "no safetensors file" in lines[0]
    assert "listed in quantization_config.json but absent" in lines[1] and "(the same for 125 more: " in lines[1]
    assert "127 problems found in this pack (2 lines: alike ones folded):" in str(e.value)  # the count says so


LLAMA = "llama-tiny-exl3-4.0bpw-mul1"


def fixture_copy(fixtures_dir, dst, tensors=None, config=None, name=LLAMA, manifest=True):
    """A copy of bundled pack ``name`` at ``dst``: ``tensors(dict)`` edits its tensors in place (the manifest, kept
    unless ``manifest`` is False, is rewritten alike by write_pack), ``config(dict)`` its config.json and
    quantization_config.json's settings."""
    from safetensors.torch import load_file

    shutil.copytree(fixtures_dir / name, dst)
    if tensors is not None:
        t = load_file(str(dst / "model.safetensors"))
        tensors(t)
        (dst / "model.safetensors").unlink()
        save_file(t, str(dst / "model.safetensors"))
        if manifest:
            from quantpack_core.synthetic import _manifest_entry

            mf = json.loads((dst / "quantization_config.json").read_text())
            modules = {}
            for n, v in t.items():
                modules.setdefault(n.rpartition(".")[0], {})[n] = v
            mf["tensor_storage"] = {m: _manifest_entry(m, ts) for m, ts in modules.items()}
            for entry in mf["tensor_storage"].values():  # as the bundled manifests: no codebook multipliers
                entry.pop("mul1_multiplier", None)
                entry.pop("mcg_multiplier", None)
            (dst / "quantization_config.json").write_text(json.dumps(mf))
    if not manifest:
        (dst / "quantization_config.json").unlink()
    if config is not None:
        c = json.loads((dst / "config.json").read_text())
        config(c)
        (dst / "config.json").write_text(json.dumps(c))
        if manifest:
            mf = json.loads((dst / "quantization_config.json").read_text())
            qc = {k: v for k, v in mf.items() if k != "tensor_storage"}
            config({"quantization_config": qc})
            (dst / "quantization_config.json").write_text(json.dumps({**qc, "tensor_storage": mf["tensor_storage"]}))
    return dst


def test_a_marker_lost_where_no_config_names_the_codebook_is_named(fixtures_dir, tmp_path):
    """One layer's .mul1 deleted, no codebook in the configs, no multiplier in the manifest (the other 28 coded
    modules keeping theirs): that layer would decode as 3INST (served before: KL 5.50 nats, top-1 2.4%). One
    codebook per pack: the module that differs is named."""

    def drop_marker(t):
        del t["model.layers.2.mlp.down_proj.mul1"]

    path = fixture_copy(
        fixtures_dir, tmp_path / "p", drop_marker, lambda c: c["quantization_config"].pop("codebook", None)
    )
    err = expect_problem(
        path,
        "model.layers.2.mlp.down_proj: model.layers.2.mlp.down_proj.mul1: has no codebook marker (3INST) while the "
        "pack's other coded modules are mul1 (28 mul1, 1 3inst",
        "mul1_multiplier",
    )
    assert len(err.problems) == 1


def test_codebooks_mixed_on_purpose_are_stated_by_the_manifest(tmp_path):
    """The synthetic pack mixes mul1 and mcg modules with no codebook in its config: its manifest records each
    marker's multiplier (as exllamav3 writes them), which states the mixture; without the manifest the module of the
    fewer codebook is named, and a marker the manifest does not record is named too."""
    Pack.open(write_pack(tmp_path / "stated", base_tensors(), CONFIG))
    expect_problem(
        write_pack(tmp_path / "unstated", base_tensors(), CONFIG, manifest=False),
        "lm_head.mcg: has a .mcg marker while the pack's other coded modules are mul1 (2 mul1, 1 mcg",
    )
    path = write_pack(tmp_path / "added", base_tensors(), CONFIG)
    mf = json.loads((path / "quantization_config.json").read_text())
    del mf["tensor_storage"]["lm_head"]["mcg_multiplier"]
    (path / "quantization_config.json").write_text(json.dumps(mf))
    expect_problem(path, "lm_head.mcg: has a .mcg marker, but quantization_config.json", "records none")


@pytest.mark.parametrize(
    "module,extra,needles",
    [
        ("model.layers.0.self_attn.q_proj", {"weird": torch.zeros(3)}, ["q_proj.weird: holds .weird beside"]),
        (
            "model.layers.1.mlp.gate_proj",
            {f"bias{i}": torch.zeros(640, dtype=torch.float16) for i in range(10)},
            ["gate_proj.bias0: holds .bias0, .bias1", "(10 in all)", "an EXL3 layer has no parameter for"],
        ),
        ("model.layers.3.input_layernorm", {"scale": torch.ones(256)}, ["input_layernorm.scale: holds .scale"]),
        ("model.embed_tokens", {"bias": torch.zeros(1024)}, ["model.embed_tokens.bias: holds .bias"]),
    ],
    ids=["exl3-weird", "exl3-bias0-9", "norm-stray", "embedding-bias"],
)
def test_stray_tensors_on_real_modules_are_named(fixtures_dir, tmp_path, module, extra, needles):
    """A tensor beside a module's weight that its vLLM layer has no parameter for: vLLM's loader stopped on it in
    the worker without naming it (``AttributeError: 'QKVParallelLinear' object has no attribute 'data'``)."""

    def add(t):
        t.update({f"{module}.{s}": v for s, v in extra.items()})

    expect_problem(fixture_copy(fixtures_dir, tmp_path / "p", add), *needles, "remove the stray tensor")


def test_an_index_whose_weight_map_is_a_list_is_named(tmp_path):
    path = write_pack(tmp_path / "p", base_tensors(), CONFIG, shards=2)
    index = path / "model.safetensors.index.json"
    j = json.loads(index.read_text())
    j["weight_map"] = [[n, f] for n, f in j["weight_map"].items()]
    index.write_text(json.dumps(j))
    expect_problem(path, "model.safetensors.index.json", "weight_map is a JSON list, not an object")


@pytest.mark.parametrize(
    "text,needle",
    [
        ('{"version": "1.0", "model": {"type": "BPE", "vocab": ', "tokenizer.json: not valid JSON"),
        ("[1, 2]", "tokenizer.json: is a JSON list, not an object"),
        ('{"version": "1.0"}', "has no tokenizer model"),
        ('{"version": "1.0", "model": {"type": "Nonsense"}}', "the tokenizers library cannot read it"),
    ],
    ids=["truncated", "list", "no-model", "unknown-model"],
)
def test_a_broken_tokenizer_is_named(fixtures_dir, tmp_path, text, needle):
    """vLLM reads the tokenizer after the pack's check and stopped on a broken one with a parse error naming no
    file."""
    path = fixture_copy(fixtures_dir, tmp_path / "p")
    (path / "tokenizer.json").write_text(text)
    if "library" in needle:
        pytest.importorskip("tokenizers")
    expect_problem(path, needle, "re-download the pack's tokenizer files")


def _scale(module, suffix, factor):
    def edit(t):
        t[f"{module}.{suffix}"] = (t[f"{module}.{suffix}"].float() * factor).to(t[f"{module}.{suffix}"].dtype)

    return edit


def _norm_value(t):
    t["model.layers.1.input_layernorm.weight"] = t["model.layers.1.input_layernorm.weight"].float()
    t["model.layers.1.input_layernorm.weight"][5] = 3.0e38


def _embedding_row(t):
    t["model.embed_tokens.weight"][17] *= 1e6


@pytest.mark.parametrize(
    "edit,needles",
    [
        (_norm_value, ["input_layernorm.weight: 1 of 256 values lie beyond 10000", "index 5, 3e+38", "norm weight"]),
        (_scale("model.layers.1.mlp.up_proj", "suh", 0), ["up_proj.suh: all 256 values are 0"]),
        (_scale("model.layers.0.self_attn.o_proj", "svh", 0), ["o_proj.svh: all 256 values are 0"]),
        (_scale("model.layers.3.mlp.down_proj", "svh", 2e4), ["down_proj.svh:", "beyond 10000", "such a scale"]),
        (
            _embedding_row,
            ["model.embed_tokens.weight: 1 of 1024 rows hold values beyond 10000 in magnitude (first: row 17)"],
        ),
    ],
    ids=["norm-3e38", "suh-zero", "svh-zero", "svh-huge", "embedding-row"],
)
def test_finite_but_impossible_values_are_named(fixtures_dir, tmp_path, edit, needles):
    """Values no trained model holds, each served before without a word: a norm weight of 3.0e38 (every logprob
    NaN), an all-zero suh (KL 5.2 nats) or svh (the layer's weights all 0), scales and table rows far past any
    measured (quantpack_core.check.values.VALUE_LIMIT)."""
    expect_problem(fixture_copy(fixtures_dir, tmp_path / "p", edit), *needles, "re-download the pack")


def test_the_value_limit_lies_far_above_every_bundled_and_converted_pack(fixtures_dir, tmp_path):
    """The measurement behind VALUE_LIMIT (its comment gives these figures): the largest norm weight, suh / svh,
    escha scale and dense table value of the bundled packs and of escha / int8-table conversions of them; the limit
    stays over 3,000 times above every one."""
    from quantpack_core.check.layers import is_norm
    from quantpack_core.check.values import TABLE_MODULES, VALUE_LIMIT
    from quantpack_core.embedding import convert_embedding_int8
    from quantpack_core.format import pack_formats

    packs = sorted(fixtures_dir.glob("*-exl3-*")) + sorted(fixtures_dir.glob("*-bf16"))
    packs.append(convert_embedding_int8(fixtures_dir / LLAMA, tmp_path / "int8").out_dir)
    try:
        from quantpack_escha.convert import escha_from_exl3

        escha_from_exl3(fixtures_dir / "llama-tiny-exl3-4.0bpw-mcg", tmp_path / "escha")
        packs.append(tmp_path / "escha")
    except ImportError:  # quantpack-core alone (nox's core session)
        pass
    largest: dict[str, float] = {}
    for path in packs:
        p = Pack(path)
        for key, m in p.modules.items():
            for suffix, info in m.tensors.items():
                kind = None
                if m.format in pack_formats() and len(info.shape) == 1 and info.dtype.is_floating_point:
                    kind = suffix if suffix != "bias" else None
                elif m.format == "dense" and is_norm(key) and suffix == "weight":
                    kind = "norm"
                elif m.format == "dense" and key.rsplit(".", 1)[-1] in TABLE_MODULES and suffix == "weight":
                    kind = key.rsplit(".", 1)[-1]
                if kind is not None:
                    v = float(p.get_tensor(info.name).float().abs().max())
                    largest[kind] = max(largest.get(kind, 0.0), v)
    assert largest["norm"] == pytest.approx(1.71875)
    assert largest["svh"] == pytest.approx(2.671875) and largest["suh"] == pytest.approx(0.249023, rel=1e-4)
    assert largest["embed_tokens"] == pytest.approx(0.283203, rel=1e-4)
    assert largest["lm_head"] == pytest.approx(0.380859, rel=1e-4)
    assert max(largest.values()) * 3000 < VALUE_LIMIT, largest


@pytest.mark.parametrize(
    "edit,needles",
    [
        ({"num_key_value_heads": 1}, ["k_proj.svh: config.json gives it 64 outputs (num_key_value_heads x head_dim)"]),
        (
            {"intermediate_size": 600},
            ["gate_proj.svh: config.json gives it 600 outputs (intermediate_size) of the 640"],
        ),
        ({"intermediate_size": 520}, ["up_proj.svh", "520 outputs", "svh scales output 520 (and 119 more"]),
        (
            {"num_attention_heads": 8, "head_dim": 32},
            ["k_proj.svh: config.json gives it 64 outputs", "model.layers.0.self_attn.v_proj.svh"],
        ),
        (
            {"num_attention_heads": 3},
            ["num_attention_heads 3 is not a multiple of num_key_value_heads 2", "q_proj.svh"],
        ),
    ],
    ids=["kv-heads-1", "intermediate-600", "intermediate-520", "heads-8-of-32", "heads-3"],
)
def test_sizes_inside_the_padding_are_held_against_the_padded_scales(fixtures_dir, tmp_path, edit, needles):
    """Config sizes that end inside EXL3's 128-feature padding store the same shapes (2 -> 1 key-value heads of
    64: 128 stored either way), so vLLM served them as garbage (KL 3.98 nats for one key-value head, 0.077 / 0.29
    for intermediate_size 600 / 520, 4.41 for 8 heads of 32). exllamav3 writes 0 into the scales of its padded
    outputs, so outputs the config leaves out whose svh is not 0 are real features: named. 3 heads over 2 key-value
    heads (vLLM refuses it in the worker) is named from the config too."""

    def config(c):
        c.update(edit)

    expect_problem(fixture_copy(fixtures_dir, tmp_path / "p", config=config), *needles)


def test_real_padding_passes_the_padded_scales_check(tmp_path):
    """A pack whose sizes truly end inside the padding (intermediate 600 in 640 stored outputs, as exllamav3 writes
    it: svh 0 past 600) opens; named where config.json claims fewer features than the layer holds."""
    t = layer_tensors("model.layers.0.mlp.gate_proj", 256, 600, 4, seed=1)
    t.update(layer_tensors("model.layers.0.mlp.up_proj", 256, 600, 4, seed=2))
    t.update(layer_tensors("model.layers.0.mlp.down_proj", 600, 256, 4, seed=3))
    t.update({k: v for k, v in base_tensors().items() if not k.startswith("model.layers.")})
    assert float(t["model.layers.0.mlp.gate_proj.svh"][600:].abs().max()) == 0
    config = {**CONFIG, "num_hidden_layers": 1, "intermediate_size": 600}
    Pack.open(write_pack(tmp_path / "p", t, config))
    expect_problem(write_pack(tmp_path / "q", t, {**config, "intermediate_size": 590}), "svh scales output 590")


def test_a_header_number_too_large_for_a_float_is_a_malformed_entry(tmp_path):
    """A header whose data offsets read as infinity (JSON ``1e999``; one changed header byte made it, in the 10,000-case
    fuzz run) stopped the check with an OverflowError; it is a malformed entry, named."""
    import struct

    path = write_pack(tmp_path / "p", base_tensors(), CONFIG)
    f = path / "model.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    text = json.dumps({**header, "model.norm.weight": {**header["model.norm.weight"], "data_offsets": [0, "INF"]}})
    text = text.replace('"INF"', "1e999")
    text += " " * (-len(text) % 8)
    f.write_bytes(struct.pack("<Q", len(text)) + text.encode() + raw[8 + n :])
    expect_problem(path, "model.norm.weight", "header entry in model.safetensors is malformed")


def test_quantpack_core_alone_asks_for_the_format_s_package(fixtures_dir, monkeypatch):
    """With no format package installed (quantpack-core alone), a quantized pack gets one problem saying so, not a
    list of every coded module as lacking its weight."""
    from quantpack_core.check import runner

    monkeypatch.setattr(runner, "pack_formats", lambda: {})
    with pytest.raises(PackError) as caught:
        Pack.open(fixtures_dir / "llama-tiny-exl3-4.0bpw-mul1")
    text = str(caught.value)
    assert "quantization_config.quant_method is 'exl3', but no package that reads a quantized format" in text
    assert "1 problem" in text and "no weight" not in text, text
