"""Tier 2, layer level: vLLM's own linear layers built with the escha method, loaded through vLLM's weight-loading
paths with its shard ids, against the escha codec's fp64 reference: a merged ``gate_up_proj`` whose gate is coded at
K=2 and up at K=3 (two shards, two K, one output), a ``qkv_proj``, and the layer bias vLLM hands ``apply`` left out;
plus the isolation of the package from quantpack-exl3."""

import math
import subprocess
import sys
import tempfile

import pytest
import torch

from quantpack_core.compare import relative_error
from quantpack_core.synthetic import random_exl3_layer
from quantpack_escha.codec import EschaTensors, reference_linear
from quantpack_escha.convert import split_scale

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def world():
    """A one-rank world and a current vLLM config (as vLLM's layer tests set up); the plugin registered."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import cleanup_dist_env_and_memory, init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    from quantpack_escha.plugin import register

    register()
    if model_parallel_is_initialized():  # another package's tests in this process set the world up already
        yield
        return
    with tempfile.TemporaryDirectory() as tmp, set_current_vllm_config(VllmConfig(device_config=DeviceConfig("cpu"))):
        init_distributed_environment(
            world_size=1, rank=0, distributed_init_method=f"file://{tmp}/dist", local_rank=0, backend="gloo"
        )
        initialize_model_parallel(1, 1)
        yield
        cleanup_dist_env_and_memory()


def random_escha(in_f: int, out_f: int, k: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = random_exl3_layer(in_f, out_f, k, "mcg", generator=g)
    rin, s_in = split_scale(t["suh"].float() / math.sqrt(128), g)
    rout, s_out = split_scale(t["svh"].float() / math.sqrt(128), g)
    return {"escha_code": t["trellis"], "escha_rin": rin, "escha_s_in": s_in, "escha_rout": rout,
            "escha_s_out": s_out}  # fmt: skip


def feed(layer, tensors, shard_id=None):
    for suffix, w in tensors.items():
        param = getattr(layer, suffix)
        param.weight_loader(param, w) if shard_id is None else param.weight_loader(param, w, shard_id)


def config(meta):
    from quantpack_escha.config import EschaConfig

    return EschaConfig.from_config({"quant_method": "escha", "layer_meta": meta})


def test_merged_gate_up_with_two_k_and_qkv(world):
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    p = "model.layers.0"
    meta = {f"{p}.mlp.gate_proj": {"K": 2}, f"{p}.mlp.up_proj": {"K": 3}}
    meta.update({f"{p}.self_attn.{n}_proj": {"K": 4} for n in "qkv"})
    cfg = config(meta)
    gate, up = random_escha(256, 384, 2, 1), random_escha(256, 384, 3, 2)
    gate_up = MergedColumnParallelLinear(
        256, [384, 384], bias=True, quant_config=cfg, prefix=f"{p}.mlp.gate_up_proj", params_dtype=torch.float32
    )
    feed(gate_up, gate, 0)
    feed(gate_up, up, 1)
    gate_up.quant_method.process_weights_after_loading(gate_up)
    x = torch.randn(5, 256)
    bias = torch.randn(768)
    y = gate_up.quant_method.apply(gate_up, x, bias)  # the bias vLLM passes is not applied
    ref = torch.cat([reference_linear(x.double(), EschaTensors.from_tensors(t), torch.float64) for t in (gate, up)], 1)
    assert relative_error(y, ref) < 1e-5
    assert [r.kernel for r in gate_up.quant_state.runs] == ["reference"]  # one fused GEMM over both K

    shards = {n: random_escha(256, o, 4, 10 + i) for i, (n, o) in enumerate((("q", 256), ("k", 128), ("v", 128)))}
    qkv = QKVParallelLinear(
        256, 64, 4, 2, bias=False, quant_config=cfg, prefix=f"{p}.self_attn.qkv_proj", params_dtype=torch.float32
    )
    for sid, t in shards.items():
        feed(qkv, t, sid)
    qkv.quant_method.process_weights_after_loading(qkv)
    y = qkv.quant_method.apply(qkv, x)
    refs = [reference_linear(x.double(), EschaTensors.from_tensors(t), torch.float64) for t in shards.values()]
    ref = torch.cat(refs, 1)
    assert relative_error(y, ref) < 1e-5


def test_uncoded_linear_is_vllms_unquantized_and_partly_coded_merge_raises(world):
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear, UnquantizedLinearMethod

    from quantpack_core.errors import LayerLoadError

    cfg = config({"model.layers.0.mlp.gate_proj": {"K": 2}})
    down = RowParallelLinear(256, 256, bias=False, quant_config=cfg, prefix="model.layers.0.mlp.down_proj")
    assert isinstance(down.quant_method, UnquantizedLinearMethod)
    with pytest.raises(LayerLoadError, match=r"codes model\.layers\.0\.mlp\.gate_proj but not .*up_proj"):
        MergedColumnParallelLinear(
            256, [384, 384], bias=False, quant_config=cfg, prefix="model.layers.0.mlp.gate_up_proj"
        )


def test_the_package_imports_and_registers_without_quantpack_exl3():
    """With quantpack_exl3 and exllamav3 made unimportable, every escha module imports and the plugin registers."""
    code = (
        "import sys; sys.modules['quantpack_exl3'] = None; sys.modules['exllamav3'] = None\n"
        "import quantpack_escha.codec, quantpack_escha.convert, quantpack_escha.cli, quantpack_escha.config\n"
        "from quantpack_escha.plugin import register; register()\n"
        "from vllm.model_executor.layers.quantization import get_quantization_config\n"
        "assert get_quantization_config('escha').__name__ == 'EschaConfig'\n"
        "assert not [m for m in sys.modules if m.startswith(('quantpack_exl3', 'exllamav3')) and sys.modules[m]]\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_package_declares_no_dependency_on_exl3():
    import tomllib
    from pathlib import Path

    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    deps = " ".join(meta["dependencies"] + [d for ds in meta.get("optional-dependencies", {}).values() for d in ds])
    assert "quantpack-exl3" not in deps and "exllamav3" not in deps


def test_coded_expert_banks_are_refused_naming_the_layer(world, monkeypatch):
    """An eschamoe pack (experts in layer_meta) fails at the MoE layer with the reason and what to serve instead;
    a layer whose experts are not coded gets vLLM's own method."""
    from quantpack_core.errors import LayerLoadError
    from quantpack_core.vllm import compat

    class Experts:  # stands in for vLLM's routed-experts class of this version
        pass

    monkeypatch.setattr(compat, "routed_experts_class", lambda: Experts)
    cfg = config({"model.layers.0.mlp.experts.0.gate_proj": {"K": 2}, "model.layers.0.mlp.experts.0.up_proj": {"K": 2}})
    with pytest.raises(LayerLoadError, match=r"layers\.0\.mlp\.experts: layer_meta codes its experts .*not supported"):
        cfg.get_quant_method(Experts(), "model.layers.0.mlp.experts")
    assert cfg.get_quant_method(Experts(), "model.layers.1.mlp.experts") is None


def test_tensor_parallel_share_off_the_blocks_is_refused_naming_layer_and_sizes(world, monkeypatch):
    """escha cuts whole 128-feature blocks per rank: gate_up of 2 x 384 over 2 ranks (192 each) must fail at load,
    naming the layer, the shard and the sizes; 2 x 256 over 2 ranks (128 each) loads and computes its rank's part."""
    import vllm.model_executor.layers.linear as lin
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    from quantpack_core.errors import GeometryError

    p = "model.layers.0"
    cfg = config({f"{p}.mlp.gate_proj": {"K": 2}, f"{p}.mlp.up_proj": {"K": 3}})
    monkeypatch.setattr(lin, "get_tensor_model_parallel_rank", lambda: 1)
    monkeypatch.setattr(lin, "get_tensor_model_parallel_world_size", lambda: 2)

    def build(out):
        layer = MergedColumnParallelLinear(
            256, [out, out], bias=False, quant_config=cfg, prefix=f"{p}.mlp.gate_up_proj", params_dtype=torch.float32
        )
        shards = [random_escha(256, out, 2, 1), random_escha(256, out, 3, 2)]
        for i, t in enumerate(shards):
            feed(layer, t, i)
        return layer, shards

    layer, _ = build(384)
    with pytest.raises(GeometryError) as e:
        layer.quant_method.process_weights_after_loading(layer)
    for fragment in (f"{p}.mlp.gate_up_proj", "gate_proj", "[(192, 384)] of 384", "whole 128-feature blocks"):
        assert fragment in str(e.value), (fragment, str(e.value))

    layer, shards = build(256)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(3, 256)
    y = layer.quant_method.apply(layer, x)
    refs = [reference_linear(x.double(), EschaTensors.from_tensors(t), torch.float64)[:, 128:] for t in shards]
    assert relative_error(y, torch.cat(refs, 1)) < 1e-5


def test_layer_meta_must_match_the_coded_tensors(fixtures_dir, tmp_path):
    """Before any worker loads (``maybe_update_config``, in the user's process): a module storing ``.escha_code``
    that ``layer_meta`` leaves out (vLLM would build it dense and fail deep in its loader), and a ``layer_meta``
    entry with no code in the pack (a layer the model does not have), are refused naming the module and the fix;
    the pack as converted passes."""
    import json

    from quantpack_core.errors import LayerLoadError
    from quantpack_escha.config import EschaConfig
    from quantpack_escha.convert import escha_from_exl3

    pack = escha_from_exl3(fixtures_dir / "llama-tiny-exl3-4.0bpw-mcg", tmp_path / "escha").out_dir
    qc = json.loads((pack / "config.json").read_text())["quantization_config"]
    EschaConfig.from_config(qc).maybe_update_config(str(pack))
    without = {k: v for k, v in qc["layer_meta"].items() if not k.startswith("model.layers.1.self_attn.")}
    with pytest.raises(
        LayerLoadError,
        match=r"model\.layers\.1\.self_attn\.\w_proj: the pack stores \.escha_code for it \(and 3 more modules\) but "
        r"quantization_config\.layer_meta does not list it.*add it to layer_meta with its K",
    ):
        EschaConfig.from_config(dict(qc, layer_meta=without)).maybe_update_config(str(pack))
    extra = dict(qc["layer_meta"], **{"model.layers.9.self_attn.q_proj": {"K": 4}})
    with pytest.raises(
        LayerLoadError,
        match=r"model\.layers\.9\.self_attn\.q_proj: quantization_config\.layer_meta lists it but the pack stores no "
        r"model\.layers\.9\.self_attn\.q_proj\.escha_code",
    ):
        EschaConfig.from_config(dict(qc, layer_meta=extra)).maybe_update_config(str(pack))
    wrong_k = dict(qc["layer_meta"], **{"model.layers.0.mlp.up_proj": {"K": 3}})
    with pytest.raises(
        LayerLoadError,
        match=r"model\.layers\.0\.mlp\.up_proj: \.escha_code holds K=4 \(16\*K words per tile\), layer_meta says K=3",
    ):
        EschaConfig.from_config(dict(qc, layer_meta=wrong_k)).maybe_update_config(str(pack))


def _damaged(src, dst, config=None, tensors=None):
    """A copy of an escha pack with its quantization config edited (``config(qc)``) or its tensor dict edited in
    place (``tensors(t)``)."""
    import json

    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    if config is not None:
        config(cfg["quantization_config"])
    (dst / "config.json").write_text(json.dumps(cfg))
    t = load_file(str(src / "model.safetensors"))
    if tensors is not None:
        tensors(t)
    save_file(t, str(dst / "model.safetensors"), {"format": "pt"})
    return dst


@pytest.mark.parametrize(
    "case, expect",
    [
        ("unlisted", "model.layers.0.self_attn.k_proj: config.json: the pack stores .escha_code for it"),
        ("no_meta", "the pack stores .escha_code for it (and 27 more modules)"),
        ("meta_not_dict", "layer_meta must map module names to entries, got str"),
        ("k_string", "has K='4'; escha codes need an integer K from 1 to 8"),
        ("k_absent", "model.layers.0.mlp.up_proj'] has no K; escha codes"),
        ("entry_int", "model.layers.0.mlp.up_proj'] is 4, not an entry with its K; escha codes"),
        ("extra_layer", "model.layers.9.mlp.up_proj: config.json: quantization_config.layer_meta lists it"),
        ("k_mismatch", "up_proj: config.json: .escha_code holds K=4 (16*K words per tile), layer_meta says K=3"),
        ("code_width", "model.layers.0.mlp.up_proj.escha_code: width 50"),
        ("rin_short", "model.layers.0.mlp.up_proj.escha_rin: float16 [100]"),
        (
            "code_rows",
            "up_proj.escha_code: shape [8, 40, 64] gives 128 input features, but .escha_rin and .escha_s_in both",
        ),
        ("s_out_gone", "model.layers.0.mlp.up_proj.escha_s_out: missing"),
        ("nan_scale", "model.layers.0.mlp.up_proj.escha_rout: "),
        ("unpaired_scale", "model.embed_tokens.weight_scale: missing: the module stores .weight_int8"),
        ("short_scale", "model.embed_tokens.weight_scale: float16 [10]; the int8 rows"),
    ],
)
def test_inspect_finds_what_the_escha_config_refuses(fixtures_dir, tmp_path_factory, case, expect):
    """``quantpack inspect``'s checks (``Pack.problems``) on an escha pack: the ``layer_meta`` checks the escha
    config makes when vLLM builds it (the same functions), and the layout of each coded module and int8 table;
    the pack as converted has no problem. Nothing is written into the pack."""
    from quantpack_core.pack import Pack
    from quantpack_escha.convert import escha_from_exl3

    root = tmp_path_factory.getbasetemp() / "escha_inspect"
    src = root / "escha"
    if not src.exists():
        escha_from_exl3(fixtures_dir / "llama-tiny-exl3-4.0bpw-mcg", src)
        assert Pack(src).problems(require_exl3=False) == []
    up, scale = "model.layers.0.mlp.up_proj", "model.embed_tokens.weight_scale"
    edits = {
        "unlisted": {"config": lambda qc: qc["layer_meta"].pop("model.layers.0.self_attn.k_proj")},
        "no_meta": {"config": lambda qc: qc.pop("layer_meta")},
        "meta_not_dict": {"config": lambda qc: qc.update(layer_meta="x")},
        "k_string": {"config": lambda qc: qc["layer_meta"][up].update(K="4")},
        "k_absent": {"config": lambda qc: qc["layer_meta"][up].pop("K")},
        "entry_int": {"config": lambda qc: qc["layer_meta"].update({up: 4})},
        "extra_layer": {"config": lambda qc: qc["layer_meta"].update({"model.layers.9.mlp.up_proj": {"K": 4}})},
        "k_mismatch": {"config": lambda qc: qc["layer_meta"][up].update(K=3)},
        "code_width": {"tensors": lambda t: t.update({f"{up}.escha_code": t[f"{up}.escha_code"][:, :, :50].clone()})},
        "rin_short": {"tensors": lambda t: t.update({f"{up}.escha_rin": t[f"{up}.escha_rin"][:100].clone()})},
        "code_rows": {"tensors": lambda t: t.update({f"{up}.escha_code": t[f"{up}.escha_code"][:8].clone()})},
        "s_out_gone": {"tensors": lambda t: t.pop(f"{up}.escha_s_out")},
        "nan_scale": {"tensors": lambda t: t[f"{up}.escha_rout"].__setitem__(3, float("nan"))},
        "unpaired_scale": {"tensors": lambda t: t.pop(scale)},
        "short_scale": {"tensors": lambda t: t.update({scale: t[scale][:10].clone()})},
    }
    pack = _damaged(src, root / case, **edits[case])
    before = {f.name: f.read_bytes() for f in pack.iterdir()}
    found = [str(p) for p in Pack(pack).problems(require_exl3=False)]
    assert any(expect in p for p in found), found
    assert {f.name: f.read_bytes() for f in pack.iterdir()} == before
