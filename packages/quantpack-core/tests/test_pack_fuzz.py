"""Fuzzing the pack check: random corruptions of a small two-shard pack (truncations, header bytes, header fields,
deleted / duplicated / renamed tensors, NaN / Inf in vectors, malformed or emptied JSON files, shards replaced by
directories or links, links out of the pack, a model class whose layer the check states, with random settings, a
module stored in another kind)
must each end in either a sound pack or a :class:`PackError` - never another exception, never a hang (hypothesis'
deadline), never a change to the pack's files. A second test corrupts the values and sizes of a trained pack (the
bundled llama) and runs every pack the check accepts through the core's reference forward against exllamav3's
logits: an accepted pack above the bound that verify's no-reference mode also passes is silent garbage, a failure.

A corruption that leaves a pack vLLM can serve (a trellis byte changed: every bit pattern is a legal trellis) may
pass; the ones that cannot be right are asserted to fail (:data:`MUST_FAIL`, and the config fields whose new value
cannot be right). CI runs :data:`EXAMPLES` cases and :data:`REAL_EXAMPLES` of the trained pack
(``QUANTPACK_FUZZ_EXAMPLES`` overrides; ``nox -s fuzz`` runs 10,000 and 1,000 and prints the counts per corruption
and outcome).
"""

import json
import os
import shutil
import struct
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_pack import CONFIG, base_tensors, snapshot

from quantpack_core import Pack, PackError
from quantpack_core.check.architectures import KNOWN_LAYERS
from quantpack_core.synthetic import write_pack

EXAMPLES = int(os.environ.get("QUANTPACK_FUZZ_EXAMPLES", "300"))
#: corruptions after which the pack cannot be right: the check must report them
MUST_FAIL = {
    "truncate", "drop-tensor", "dup-tensor", "dtype", "shape", "offsets", "nan-vector", "json-garbage",
    "json-empty", "shard-dir", "shard-link-nowhere", "empty-shard", "rename-tensor",
}  # fmt: skip
#: outcome counts per corruption, printed by the nox session
TALLY: Counter = Counter()

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
CONFIG_KEYS = ("architectures", "hidden_size", "num_hidden_layers", "vocab_size", "text_config", "quantization_config")
#: the settings the layer rule of a known class reads (quantpack_core.check.architectures.architecture_layer), and
#: those the check reads of the config vLLM builds (activation, RoPE); not Mistral's ada_rms_norm_t_cond, which takes
#: the layer out of the rule (test_layout.py covers it)
LAYER_KEYS = (
    "attention_bias", "bias", "qkv_bias", "mlp_bias", "qk_norm", "num_experts", "num_local_experts",
    "decoder_sparse_step", "mlp_only_layers", "shared_expert_intermediate_size", "hidden_act", "hidden_activation",
    "rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor",
)  # fmt: skip


@pytest.fixture(scope="module")
def sound_pack(tmp_path_factory) -> Path:
    """A sound two-shard pack (index, manifest, config with its sizes); copied for every example."""
    config = {**CONFIG, "num_hidden_layers": 1, "vocab_size": 1024}
    path = write_pack(tmp_path_factory.mktemp("fuzz") / "pack", base_tensors(), config, shards=2)
    Pack.open(path)  # the baseline is sound
    return path


def _header(f: Path) -> tuple[dict, bytes]:
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write(f: Path, header: dict, body: bytes) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    f.write_bytes(struct.pack("<Q", len(text)) + text + body)


def corrupt(pack: Path, kind: str, draw) -> bool:
    """Apply one corruption of ``kind`` to the copy ``pack``, its parameters drawn by ``draw``. Returns whether the
    corrupted pack cannot be right (the check must report it)."""
    shards = sorted(pack.glob("*.safetensors"))
    shard = shards[draw(st.integers(0, len(shards) - 1))]
    header, body = _header(shard)
    names = sorted(k for k in header if k != "__metadata__")
    name = names[draw(st.integers(0, len(names) - 1))]
    if kind == "truncate":
        size = shard.stat().st_size
        shard.write_bytes(shard.read_bytes()[: draw(st.integers(0, size - 1))])
    elif kind == "header-bytes":
        raw = bytearray(shard.read_bytes())
        (n,) = struct.unpack("<Q", raw[:8])
        for _ in range(draw(st.integers(1, 4))):
            raw[draw(st.integers(0, 8 + n - 1))] = draw(st.integers(0, 255))
        shard.write_bytes(bytes(raw))
    elif kind == "drop-tensor":
        del header[name]
        _write(shard, header, body)
    elif kind == "dup-tensor":
        header[name + "_copy" if draw(st.booleans()) else name.replace(".", "._", 1)] = dict(header[name])
        _write(shard, header, body)
    elif kind == "rename-tensor":
        header[name.replace(".", ".x", 1)] = header.pop(name)
        _write(shard, header, body)
    elif kind == "dtype":
        header[name]["dtype"] = draw(st.sampled_from(["F32", "I8", "U8", "BOOL", "F64", "X9", "", "I16"]).filter(
            lambda d: d != header[name]["dtype"]
        ))  # fmt: skip
        _write(shard, header, body)
    elif kind == "shape":
        shape = header[name]["shape"]
        header[name]["shape"] = draw(
            st.lists(st.integers(-3, 1 << 20), min_size=0, max_size=4).filter(lambda s: s != shape)
        )
        _write(shard, header, body)
    elif kind == "offsets":
        a, b = header[name]["data_offsets"]
        header[name]["data_offsets"] = draw(
            st.tuples(st.integers(-8, len(body) + 64), st.integers(-8, len(body) + 64)).filter(lambda o: o != (a, b))
        )
        _write(shard, header, body)
    elif kind == "nan-vector":
        vectors = [k for k in names if k.endswith((".suh", ".svh", "norm.weight"))]
        if not vectors:  # this shard has none: put it on a shard that has
            shard = next(s for s in shards if any(k.endswith((".suh", ".svh")) for k in _header(s)[0]))
            header, body = _header(shard)
            vectors = [k for k in header if k.endswith((".suh", ".svh", "norm.weight"))]
        name = vectors[draw(st.integers(0, len(vectors) - 1))]
        a, b = header[name]["data_offsets"]
        i = a + 2 * draw(st.integers(0, (b - a) // 2 - 1))
        body = bytearray(body)
        bad = {"F16": b"\x00\x7e", "BF16": b"\xc0\x7f"}.get(header[name]["dtype"], b"\x00\x7c")
        body[i : i + 2] = (
            bad if draw(st.booleans()) else {"F16": b"\x00\x7c", "BF16": b"\x80\x7f"}.get(header[name]["dtype"], bad)
        )  # NaN or +Inf
        _write(shard, header, bytes(body))
    elif kind in ("json-garbage", "json-empty", "config-field"):
        file = pack / draw(st.sampled_from(["config.json", "quantization_config.json", "model.safetensors.index.json"]))
        if kind == "json-empty":
            file.write_text("")
        elif kind == "json-garbage":
            file.write_bytes(draw(st.binary(min_size=1, max_size=40)).replace(b"{", b"[") + b"\x00")
        else:
            file = pack / "config.json"
            config = json.loads(file.read_text())
            key = draw(st.sampled_from(CONFIG_KEYS))
            value = draw(JSON_VALUES.filter(lambda v: v != config.get(key) and v not in ([], {}, None)))
            if key == "quantization_config":  # a broken method, not merely another valid dict
                value = {"quant_method": value} if isinstance(value, str | int) and value != "exl3" else value
            config[key] = value
            file.write_text(json.dumps(config))
            # what vLLM itself checks in the user's process (an unknown class name) or ignores (a text_config object
            # a text-only model does not read) may pass; every other change of these fields cannot be right
            if key == "architectures":
                return not (isinstance(value, list) and all(isinstance(a, str) and a for a in value))
            if key == "text_config":
                return not isinstance(value, dict)
            if key == "vocab_size":  # the table's 1,024 rows may pad a vocabulary by less than a 128-row block
                return not (isinstance(value, int) and not isinstance(value, bool) and 1024 - 128 < value <= 1024)
            return True
    elif kind == "layer-class":
        # a class whose layer the check states (the pack's one layer holds a q_proj and a down_proj: none of those
        # layers), with random values for the settings its rule reads
        file = pack / "config.json"
        config = json.loads(file.read_text())
        config["architectures"] = [draw(st.sampled_from(KNOWN_LAYERS))]
        for key in draw(st.lists(st.sampled_from(LAYER_KEYS), max_size=4, unique=True)):
            config[key] = draw(JSON_VALUES)
        file.write_text(json.dumps(config))
        return True
    elif kind == "shard-dir":
        shard.unlink()
        shard.mkdir()
    elif kind == "shard-link-nowhere":
        shard.unlink()
        shard.symlink_to(pack / "gone.safetensors")
    elif kind == "link-out":
        # a shard that is a link to a sound copy outside the pack: readable; the check must not follow it to write
        outside = pack.parent / f"outside-{shard.name}"
        shutil.copy(shard, outside)
        shard.unlink()
        shard.symlink_to(outside)
    elif kind == "empty-shard":
        shard.write_bytes(b"")
    elif kind == "trellis-bytes":
        trellis = [k for k in names if k.endswith(".trellis")]
        if trellis:
            a, b = header[trellis[0]]["data_offsets"]
            body = bytearray(body)
            body[draw(st.integers(a, b - 1))] ^= 0xFF
            _write(shard, header, bytes(body))
    elif kind == "storage-swap":
        return swap_storage(pack, draw)
    else:
        raise AssertionError(kind)
    return kind in MUST_FAIL


#: the storage kinds a module is swapped to, and the modules of the fuzzed pack
STORAGES = ("dense", "trellis", "int8-rows", "escha")
SWAPPED = (
    "model.layers.0.self_attn.q_proj",
    "model.layers.0.mlp.down_proj",
    "lm_head",
    "model.embed_tokens",
    "model.norm",
)


def swap_storage(pack: Path, draw) -> bool:
    """Store one module of ``pack`` in another kind (a dense weight, a random EXL3 trellis, int8 rows with scales, an
    escha code), its shard, index and manifest entry rewritten alike (quantpack_core.synthetic.replace_module), at
    the module's size or a random one. Returns whether vLLM cannot load the result: a norm stored other than dense,
    the token embedding as a trellis or escha code, int8 rows inside a decoder layer (the other swaps may serve)."""
    import torch

    from quantpack_core.synthetic import random_exl3_layer, replace_module

    key = draw(st.sampled_from(SWAPPED))
    target = draw(st.sampled_from(STORAGES))
    sizes = {"model.norm": (256, 1), "model.embed_tokens": (1024, 256), "lm_head": (1024, 256)}
    out_f, in_f = sizes.get(key, (256, 640 if key.endswith("down_proj") else 256))
    if draw(st.booleans()):
        out_f, in_f = draw(st.integers(1, 300)), draw(st.integers(1, 300))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    if target == "dense":
        tensors = {"weight": torch.randn(out_f, in_f, generator=g).to(torch.float16)}
    elif target == "int8-rows":
        rows = torch.randint(-127, 128, (out_f, in_f), generator=g, dtype=torch.int8)
        tensors = {"qweight": rows, "scales": torch.rand(out_f, generator=g) + 0.01}
    else:
        layer = random_exl3_layer(in_f, out_f, draw(st.sampled_from([2, 3, 4])), "mcg", generator=g)
        if target == "trellis":
            tensors = layer
        else:
            ones_in, ones_out = torch.ones_like(layer["suh"]), torch.ones_like(layer["svh"])
            tensors = {"escha_code": layer["trellis"], "escha_rin": layer["suh"], "escha_rout": layer["svh"],
                       "escha_s_in": ones_in, "escha_s_out": ones_out}  # fmt: skip
    swapped = pack.with_name("swapped")
    replace_module(pack, swapped, key, tensors)
    shutil.rmtree(pack)
    swapped.rename(pack)
    if key == "model.norm":
        return target != "dense"
    if key == "model.embed_tokens":
        return target in ("trellis", "escha")
    return key.startswith("model.layers.") and target == "int8-rows"


KINDS = sorted(MUST_FAIL | {"config-field", "header-bytes", "layer-class", "link-out", "storage-swap", "trellis-bytes"})


@settings(
    max_examples=EXAMPLES,
    deadline=5000,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)
@given(kind=st.sampled_from(KINDS), data=st.data())
def test_corrupted_packs_fail_cleanly(sound_pack, tmp_path_factory, kind, data):
    work = tmp_path_factory.mktemp("case")
    pack = work / "pack"
    shutil.copytree(sound_pack, pack)
    must_fail = corrupt(pack, kind, data.draw)
    before = snapshot(pack)
    try:
        Pack.open(pack)
    except PackError as e:
        text = str(e)
        assert "->" in text and "Nothing in the pack directory was modified" in text, text
        outcome = "error"
    else:
        outcome = "accepted"
        assert not must_fail, f"{kind}: the corrupted pack was accepted"
    assert snapshot(pack) == before, "the check modified the pack"
    TALLY[(kind, outcome)] += 1
    shutil.rmtree(work)


# --- values and sizes of a real pack, and the silent-garbage stage -------------------------------------------------

#: the pack of the value / size fuzz: a trained model whose logits exllamav3 computed (reference_logits.pt)
REAL = "llama-tiny-exl3-4.0bpw-mul1"
#: its cases: a tenth of :data:`EXAMPLES` (30 in each CI session, 1,000 in ``nox -s fuzz``)
REAL_EXAMPLES = max(1, EXAMPLES // 10)
#: the corruptions of the real pack; those of :data:`REAL_MUST_FAIL` cannot be right
REAL_KINDS = ("value-huge", "scale-zero", "marker-drop", "stray-tensor", "size", "trellis-bytes")
REAL_MUST_FAIL = {"value-huge", "scale-zero", "marker-drop", "stray-tensor"}
#: config.json's sizes the ``size`` kind changes (one to three of them, or the head split: heads and key-value heads
#: times f, head_dim over f, which keeps every stored shape)
SIZE_KEYS = (
    "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size", "hidden_size",
    "num_hidden_layers",
)  # fmt: skip
#: an accepted pack's KL against its reference above this is garbage: verify's bound against stored logits (the sound
#: pack: 5.5e-6)
GARBAGE_KL = 1e-2
#: the silent-garbage stage's outcomes per kind: ``within`` the bound, ``caught`` above it but beyond verify's bound
#: on text (verify's no-reference mode, the documented net for what no tensor proves), ``silent`` (a failure),
#: ``unbuilt`` (transformers builds no model of the config)
GARBAGE: Counter = Counter()
#: the largest KL per kind among accepted packs within the bound
GARBAGE_KL_MAX: dict[str, float] = {}


def _near(value: int):
    """Sizes near ``value``: halved, doubled, one or 64 off, or any in 1 .. 2 x value."""
    close = [v for v in (value // 2, value * 2, value - 1, value + 1, value - 64, value + 64) if v >= 1]
    return (st.sampled_from(close) | st.integers(1, 2 * value)).filter(lambda v: v != value)


def _size_edit(config: dict, draw) -> None:
    if draw(st.booleans()):
        f = draw(st.sampled_from([2, 0.5]))
        config["head_dim"] = int(config["head_dim"] / f)
        for key in ("num_attention_heads", "num_key_value_heads"):
            config[key] = int(config[key] * f)
        return
    for key in draw(st.lists(st.sampled_from(SIZE_KEYS), min_size=1, max_size=3, unique=True)):
        config[key] = draw(_near(config[key]))


def mutate_real(pack: Path, kind: str, draw) -> bool:
    """Apply one corruption of ``kind`` (:data:`REAL_KINDS`) to a copy of the real pack. Returns whether it cannot
    be right."""
    import math

    import torch
    from safetensors.torch import load_file, save_file

    from quantpack_core.check.values import VALUE_LIMIT

    t = load_file(str(pack / "model.safetensors"))
    config = json.loads((pack / "config.json").read_text())
    manifest = json.loads((pack / "quantization_config.json").read_text())
    names = sorted(t)
    if kind == "value-huge":  # one value of a norm, a scale vector or the embedding past the limit
        name = draw(
            st.sampled_from([n for n in names if n.endswith((".suh", ".svh", "norm.weight", "embed_tokens.weight"))])
        )
        flat = t[name].reshape(-1).clone()
        top = math.log10(float(torch.finfo(flat.dtype).max))
        flat[draw(st.integers(0, flat.numel() - 1))] = draw(st.sampled_from([-1, 1])) * 10 ** draw(
            st.floats(math.log10(VALUE_LIMIT) + 0.01, top - 0.01)
        )
        t[name] = flat.reshape(t[name].shape)
    elif kind == "scale-zero":
        name = draw(st.sampled_from([n for n in names if n.endswith((".suh", ".svh"))]))
        t[name] = torch.zeros_like(t[name])
    elif kind == "marker-drop":  # one module's .mul1 gone, no codebook named anywhere
        name = draw(st.sampled_from([n for n in names if n.endswith(".mul1")]))
        del t[name]
        config["quantization_config"].pop("codebook", None)
        manifest.pop("codebook", None)
        manifest["tensor_storage"][name.rsplit(".", 1)[0]]["stored_tensors"].pop(name, None)
    elif kind == "stray-tensor":
        module = draw(st.sampled_from(sorted({n.rsplit(".", 1)[0] for n in names})))
        t[f"{module}.{draw(st.sampled_from(['weird', 'bias0', 'scale2', 'g_idx', 'qzeros', 'weight_']))}"] = (
            torch.zeros(3)
        )
    elif kind == "size":
        _size_edit(config, draw)
    elif kind == "trellis-bytes":
        name = draw(st.sampled_from([n for n in names if n.endswith(".trellis")]))
        flat = t[name].reshape(-1).clone()
        flat[draw(st.integers(0, flat.numel() - 1))] ^= 1 << draw(st.integers(0, 15))
        t[name] = flat.reshape(t[name].shape)
    else:
        raise AssertionError(kind)
    (pack / "model.safetensors").unlink()
    save_file(t, str(pack / "model.safetensors"))
    (pack / "config.json").write_text(json.dumps(config))
    (pack / "quantization_config.json").write_text(json.dumps(manifest))
    return kind in REAL_MUST_FAIL


@pytest.fixture(scope="module")
def memo_dequantize():
    """The core codec's dequantize, each module's result kept by its tensors' bytes: a corrupted copy decodes only
    the module that changed (the same function, its results reused)."""
    import hashlib

    import torch

    from quantpack_core import codec

    cache: dict = {}
    real = codec.dequantize

    def dequantize(t, dtype=torch.float32, **kw):
        h = hashlib.blake2b(str(dtype).encode() + t.codebook.value.encode())
        for v in (t.trellis, t.suh, t.svh, t.bias):
            h.update(b"-" if v is None else v.contiguous().numpy().tobytes())
        key = h.hexdigest()
        if key not in cache:
            cache[key] = real(t, dtype, **kw)
        return cache[key].clone()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(codec, "dequantize", dequantize)
        yield


def garbage_stage(pack: Path, reference: dict) -> tuple[str, float]:
    """An accepted pack through the core's reference forward (the pack decoded into transformers' model, float32)
    against the pack's reference logits (exllamav3's), over the vocabulary both give: ``("within", kl)``, or above
    :data:`GARBAGE_KL` ``"caught"`` where verify's no-reference mode refuses it (its NLL on text beyond
    ``TEXT_BOUND`` of a uniform guess) and ``"silent"`` where it does not; ``("unbuilt", nan)`` where transformers
    builds no model of the config."""
    import math

    import torch

    from quantpack_core.compare import agreement, mean_nll
    from quantpack_core.reference import dense_transformers_model
    from quantpack_core.verify import TEXT_BOUND, TEXT_TOKENS, text_ids

    try:
        model = dense_transformers_model(pack)
    except Exception:  # a config transformers cannot build a model of (heads that do not divide the width ...)
        return "unbuilt", float("nan")
    with torch.no_grad():
        got = model(reference["input_ids"]).logits
    width = min(got.shape[-1], reference["logits"].shape[-1])
    kl = agreement(reference["logits"][..., :width], got[..., :width]).kl
    if kl <= GARBAGE_KL:
        return "within", kl
    ids = text_ids(pack, TEXT_TOKENS)
    with torch.no_grad():
        nll = mean_nll(model(ids).logits, ids)
    return ("caught" if nll > TEXT_BOUND * math.log(got.shape[-1]) else "silent"), kl


@settings(
    max_examples=REAL_EXAMPLES,
    deadline=60_000,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)
@given(kind=st.sampled_from(REAL_KINDS), data=st.data())
def test_values_and_sizes_of_a_real_pack_fail_cleanly_or_compute_the_same(
    fixtures_dir, memo_dequantize, tmp_path_factory, kind, data
):
    """Value and size corruptions of a trained pack (a value past VALUE_LIMIT, an all-zero scale, a lost codebook
    marker, a stray tensor, config.json's sizes, a flipped trellis bit): a :class:`PackError` or an accepted pack -
    never another exception, never a change to the files - and each accepted pack goes through the reference
    forward: above :data:`GARBAGE_KL` it must be refused by verify on text, else it is silent garbage (a failure)."""
    import torch

    pytest.importorskip("transformers")
    work = tmp_path_factory.mktemp("real")
    pack = work / "pack"
    shutil.copytree(fixtures_dir / REAL, pack)
    (pack / "reference_logits.pt").unlink()  # (verify's text mode runs with no reference)
    must_fail = mutate_real(pack, kind, data.draw)
    before = snapshot(pack)
    try:
        Pack.open(pack)
    except PackError as e:
        assert "->" in str(e), str(e)
        outcome = "error"
    else:
        assert not must_fail, f"{kind}: the corrupted pack was accepted"
        outcome = "accepted"
        stage, kl = garbage_stage(pack, torch.load(fixtures_dir / REAL / "reference_logits.pt"))
        GARBAGE[(kind, stage)] += 1
        if stage == "within":
            GARBAGE_KL_MAX[kind] = max(GARBAGE_KL_MAX.get(kind, 0.0), kl)
        assert stage != "silent", f"{kind}: accepted, KL {kl:.3g} against the reference, and verify passes it"
    assert snapshot(pack) == before, "the check modified the pack"
    TALLY[(f"real {kind}", outcome)] += 1
    shutil.rmtree(work)


def test_print_tally():
    """Prints the fuzz run's counts (kind, outcome) -> cases and the silent-garbage stage's (kind, stage) -> cases with
    the largest KL within the bound, for the nox session's report."""
    for (kind, outcome), n in sorted(TALLY.items()):
        print(f"fuzz {kind:20s} {outcome:9s} {n}")
    for (kind, stage), n in sorted(GARBAGE.items()):
        print(f"garbage {kind:17s} {stage:9s} {n}")
    for kind, kl in sorted(GARBAGE_KL_MAX.items()):
        print(f"garbage {kind:17s} largest KL within the bound {kl:.3g}")
    assert sum(TALLY.values()) > 0 or EXAMPLES == 0
