"""Exl3MoEMethod on one expert layer, in process on CPU: loading a pack's experts by name, the bank it builds, the
reference backend's forward against the core's float64 oracle, and every refusal with its message.

The layer here is a plain ``torch.nn.Module`` carrying what vLLM's ``RoutedExperts`` hands the method (its name, the
checkpoint projection names); the method, the bank, the codec and the op are the real ones. End to end through
vLLM's own MoE layer: test_exl3_moe_e2e.py."""

from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from quantpack_core import CodecError, GeometryError
from quantpack_core.codec import Exl3Tensors
from quantpack_core.moe import PROJ_MODULES, Exl3MoeBank, bank_from_tensors, reference_moe_forward

pytest.importorskip("vllm")

LAYER = "model.layers.1.mlp.experts"
HIGH, LOW, MIXED = "qwen3moe-tiny-exl3-4.0bpw-mul1", "qwen3moe-tiny-exl3-3.0bpw-mul1-hq", "qwen3moe-tiny-exl3-mixed-k"
E, H, INTER = 8, 256, 256


def moe_config(**over):
    cfg = dict(
        activation=SimpleNamespace(value="silu"),
        is_act_and_mul=True,
        has_bias=False,
        tp_size=1,
        moe_parallel_config=SimpleNamespace(use_ep=False),
    )
    cfg.update(over)
    return SimpleNamespace(**cfg)


def expert_tensors(pack_dir, layer=LAYER) -> dict[str, torch.Tensor]:
    """The layer's expert tensors of a pack, named as vLLM hands them to the layer (``7.gate_proj.trellis``)."""
    out = {}
    with safe_open(pack_dir / "model.safetensors", "pt") as f:
        for key in f.keys():
            if key.startswith(layer + "."):
                out[key.removeprefix(layer + ".")] = f.get_tensor(key)
    return out


def exl3_config():
    """An EXL3 config on this (CPU) platform: its expert kernel is the reference one."""
    from quantpack_exl3.config import Exl3Config

    return Exl3Config.from_config({"quant_method": "exl3"})


def make_layer(**over):
    from quantpack_exl3.methods import Exl3MoEMethod

    method = Exl3MoEMethod(moe_config(**over), exl3_config(), LAYER)
    layer = torch.nn.Module()
    layer.layer_name = LAYER
    method.create_weights(layer, E, H, INTER, torch.float32)
    return method, layer


def load(layer, tensors: dict[str, torch.Tensor]) -> list[str]:
    return list(layer.load_weights(tensors.items()))


def grouped(tensors: dict[str, torch.Tensor]) -> dict[tuple[int, str], Exl3Tensors]:
    """``7.gate_proj.trellis``-named tensors -> ``{(7, "w1"): Exl3Tensors}`` (the core's bank input)."""
    proj = {v: k for k, v in PROJ_MODULES.items()}
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        e, p, kind = name.split(".")
        parts.setdefault((int(e), proj[p]), {})[kind] = t
    return {key: Exl3Tensors.from_tensors(ts) for key, ts in parts.items()}


def oracle_bank(tensors: dict[str, torch.Tensor]) -> Exl3MoeBank:
    """A second bank built straight from the pack tensors by the core (no vLLM method involved)."""
    return bank_from_tensors(LAYER, grouped(tensors), "cpu")


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
def test_grouped_path_views_are_the_banks_slots(fixtures_dir, gated):
    """The CUDA op's per-expert path rebuilds each slot's views from the group list; they must be the bank's (an
    ungated bank's slots hold w1 alone)."""
    from quantpack_exl3.backends.exllamav3.moe import _slot_tensors

    if gated:
        bank = oracle_bank(expert_tensors(fixtures_dir / MIXED))
    else:
        bank = ungated_oracle(ungated_tensors(fixtures_dir / MIXED))
    groups = [(g.lo, g.hi, g.k_gu, g.k_d) for g in bank.plan.groups]
    for slot, (gate, up, down, k_gu, k_d) in enumerate(_slot_tensors(bank.tensors, groups, H, INTER, gated)):
        want = bank.slot_views(slot)
        assert (up is None) == (not gated)
        for got, view in ((gate, want.w1), (up, want.w3), (down, want.w2)):
            if view is None:
                continue
            for a, b in zip(got, (view.trellis, view.suh, view.svh), strict=True):
                assert a.data_ptr() == b.data_ptr() and a.shape == b.shape
        assert (k_gu, k_d) == (want.w1.k, want.w2.k)


@pytest.mark.parametrize("pack", [HIGH, MIXED])
def test_forward_matches_the_float64_oracle(fixtures_dir, pack):
    """Every token routed to two experts (chosen to cover every K group of the mixed pack); the method's output
    equals the core's float64 per-expert loop over the same pack tensors."""
    method, layer = make_layer()
    tensors = expert_tensors(fixtures_dir / pack)
    names = load(layer, tensors)
    assert set(names) == {f"{f}_{s}" for f in ("w13", "w2") for s in ("trellis", "suh", "svh", "mul1")}
    method.process_weights_after_loading(layer)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(24)])
    w = torch.rand(24, 2, generator=g).softmax(-1)
    got = method.apply(layer, x, w, ids.to(torch.int32))
    want = reference_moe_forward(oracle_bank(tensors), x, ids, w)
    rel = ((got.double() - want).norm() / want.norm()).item()
    assert rel < 1e-5, rel
    assert got.dtype == torch.float32 and got.shape == x.shape


def test_mixed_pack_plans_four_k_groups(fixtures_dir):
    method, layer = make_layer()
    load(layer, expert_tensors(fixtures_dir / MIXED))
    method.process_weights_after_loading(layer)
    from quantpack_core.vllm.cpu_moe import cpu_fused_moe_

    # dense [W1 | W3] per expert: (E, H, 2I) for the project's loop, (E, 2I, H) prepacked for vLLM's CPU MoE kernel
    cpu_kernel = layer.quant_state.fn is cpu_fused_moe_
    assert layer.bank_w13.shape == ((E, 2 * INTER, H) if cpu_kernel else (E, H, 2 * INTER))
    assert not hasattr(layer, "w13_trellis")  # placeholders dropped after the bank is built


def test_missing_expert_is_named(fixtures_dir):
    from quantpack_core.errors import LayerLoadError

    method, layer = make_layer()
    tensors = {k: v for k, v in expert_tensors(fixtures_dir / HIGH).items() if not k.startswith("5.up_proj.")}
    load(layer, tensors)
    with pytest.raises(LayerLoadError, match=r"layers\.1\.mlp\.experts: no EXL3 trellis for experts 5\.up_proj"):
        method.process_weights_after_loading(layer)


def test_gate_and_up_of_one_expert_at_different_k_refused(fixtures_dir):
    """Expert 2 with gate_proj at K=3 and up_proj at K=4: the bank runs w1 and w3 of a slot with one K."""
    method, layer = make_layer()
    tensors = expert_tensors(fixtures_dir / HIGH)
    low = expert_tensors(fixtures_dir / LOW)
    tensors.update({k: v for k, v in low.items() if k.startswith("2.gate_proj.")})
    load(layer, tensors)
    with pytest.raises(GeometryError, match=r"expert 2: w1 \(gate_proj\) has K=3 but w3 \(up_proj\) has K=4"):
        method.process_weights_after_loading(layer)


def test_two_codebooks_in_one_layer_refused(fixtures_dir):
    method, layer = make_layer()
    tensors = expert_tensors(fixtures_dir / HIGH)
    del tensors["6.down_proj.mul1"]
    tensors["6.down_proj.mcg"] = torch.tensor(0xCBAC1FED - 2**32, dtype=torch.int32)  # a well-formed mcg marker
    load(layer, tensors)
    with pytest.raises(CodecError, match=r"several codebooks: .*mcg \(e\.g\. expert 6 down_proj\)"):
        method.process_weights_after_loading(layer)


def test_wrong_hidden_size_refused(fixtures_dir):
    """A config that says hidden 384 for a pack made at 256: named with both sizes, before any forward."""
    from quantpack_exl3.methods import Exl3MoEMethod

    method = Exl3MoEMethod(moe_config(), exl3_config(), LAYER)
    layer = torch.nn.Module()
    method.create_weights(layer, E, 384, INTER, torch.float32)
    load(layer, expert_tensors(fixtures_dir / HIGH))
    with pytest.raises(GeometryError, match=r"expert 0 gate_proj stores a 256x256 .*needs 384x256 \(hidden 384"):
        method.process_weights_after_loading(layer)


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("0.gate_up_proj.trellis", r"not a per-expert EXL3 tensor"),
        ("3.gate_proj.weight", r"not a per-expert EXL3 tensor"),
        ("8.gate_proj.trellis", r"names expert 8, but the layer has 8 experts"),
    ],
)
def test_foreign_checkpoint_names_refused(name, match):
    from quantpack_core.errors import LayerLoadError

    _, layer = make_layer()
    with pytest.raises(LayerLoadError, match=match):
        load(layer, {name: torch.zeros(16, 16, 64, dtype=torch.int16)})


def test_tensor_arriving_twice_refused(fixtures_dir):
    from quantpack_core.errors import LayerLoadError

    _, layer = make_layer()
    t = expert_tensors(fixtures_dir / HIGH)["0.gate_proj.suh"]
    with pytest.raises(LayerLoadError, match=r"expert 0 gate_proj\.suh arrived twice"):
        load(layer, {"0.gate_proj.suh": t, "model.layers.1.mlp.experts.0.gate_proj.suh": t})


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"activation": SimpleNamespace(value="gelu")}, r"activation 'gelu'"),
        ({"is_act_and_mul": False}, r"not gated"),
        ({"has_bias": True}, r"expert biases"),
        ({"moe_parallel_config": SimpleNamespace(use_ep=True)}, r"expert parallelism .*--enable-expert-parallel"),
        ({"swiglu_limit": 7.0}, r"clamped SwiGLU"),
    ],
)
def test_unsupported_layer_kinds_refused_at_create(over, match):
    from quantpack_core.errors import UnsupportedMoeError

    with pytest.raises(UnsupportedMoeError, match=match):
        make_layer(**over)


def test_expert_loader_called_directly_refuses_unknown_experts(fixtures_dir):
    """Model files with their own loops call the parameter's weight_loader with an expert id (vLLM's signature); an
    id outside the layer is named there, not deep in the bank."""
    from quantpack_core.errors import LayerLoadError

    _, layer = make_layer()
    t = expert_tensors(fixtures_dir / HIGH)["0.gate_proj.trellis"]
    with pytest.raises(LayerLoadError, match=r"names expert 9, but the layer has 8 experts"):
        layer.w13_trellis.weight_loader(layer.w13_trellis, t, "experts.9.gate_proj.trellis", "w1", 9, True)
    assert layer.w13_trellis.weight_loader(layer.w13_trellis, t, "experts.0.gate_proj.trellis", "w1", 0, True)


# ------------------------------------------------------------------------------------------------ ungated experts

UNGATED = {"activation": SimpleNamespace(value="relu2_no_mul"), "is_act_and_mul": False}


def ungated_tensors(pack_dir) -> dict[str, torch.Tensor]:
    """Ungated experts (Nemotron-H's layout: ``up_proj`` and ``down_proj`` only) from a pack's experts: each
    expert's gate_proj tensors stored as its up_proj."""
    out = {}
    for name, t in expert_tensors(pack_dir).items():
        e, proj, kind = name.split(".")
        if proj != "up_proj":
            out[f"{e}.{'up_proj' if proj == 'gate_proj' else proj}.{kind}"] = t
    return out


def ungated_oracle(tensors: dict[str, torch.Tensor]) -> Exl3MoeBank:
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        e, proj, kind = name.split(".")
        parts.setdefault((int(e), "w1" if proj == "up_proj" else "w2"), {})[kind] = t
    return bank_from_tensors(LAYER, {k: Exl3Tensors.from_tensors(v) for k, v in parts.items()}, "cpu")


@pytest.mark.parametrize("pack", [HIGH, MIXED])
@pytest.mark.parametrize("route", ["layer loader", "parameter loader"])
def test_ungated_relu2_experts_match_the_float64_oracle(fixtures_dir, pack, route):
    """Ungated relu2 experts (vLLM's ``relu2_no_mul``, ``is_act_and_mul=False``): loaded by name through the layer
    (vLLM 0.32's ``ckpt_names`` route) or through the parameters' loader with shard id w1 (0.25's Nemotron-H
    loop), served by the reference kernel, equal to the float64 ``relu(x W1)^2 W2`` oracle; the gated pack's SiLU
    form of the same experts is far from it."""
    method, layer = make_layer(**UNGATED)
    assert layer.quant_state.gated is False
    tensors = ungated_tensors(fixtures_dir / pack)
    if route == "layer loader":
        names = load(layer, tensors)
        assert set(names) == {f"{f}_{s}" for f in ("w13", "w2") for s in ("trellis", "suh", "svh", "mul1")}
    else:
        for name, t in tensors.items():
            e, proj, kind = name.split(".")
            param = getattr(layer, f"{'w13' if proj == 'up_proj' else 'w2'}_{kind}")
            shard = "w1" if proj == "up_proj" else "w2"
            param.weight_loader(param, t, f"experts.{name}", shard, int(e), True)
    method.process_weights_after_loading(layer)
    assert layer.bank_w13.shape == (E, H, INTER)  # W1 alone per expert
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(20)])
    w = torch.rand(20, 2, generator=g).softmax(-1)
    got = method.apply(layer, x, w, ids.to(torch.int32))
    oracle = ungated_oracle(tensors)
    want = reference_moe_forward(oracle, x, ids, w)
    rel = ((got.double() - want).norm() / want.norm()).item()
    assert rel < 1e-5, rel
    silu = reference_moe_forward(oracle, x, ids, w, activation="silu")
    assert (silu - want).norm() > 0.1 * want.norm()


def test_ungated_layer_refuses_gated_tensors_and_names_missing_ones(fixtures_dir):
    from quantpack_core.errors import LayerLoadError, UnsupportedMoeError

    _, layer = make_layer(**UNGATED)
    with pytest.raises(LayerLoadError, match=r"'0\.gate_proj\.trellis' is not a per-expert EXL3 tensor"):
        load(layer, {"0.gate_proj.trellis": expert_tensors(fixtures_dir / HIGH)["0.gate_proj.trellis"]})
    method, layer = make_layer(**UNGATED)
    tensors = ungated_tensors(fixtures_dir / HIGH)
    load(layer, {k: v for k, v in tensors.items() if not k.startswith("5.up_proj.")})
    with pytest.raises(LayerLoadError, match=r"no EXL3 trellis for experts 5\.up_proj .*up/down \(ungated\)"):
        method.process_weights_after_loading(layer)
    method, layer = make_layer(**UNGATED)
    load(layer, tensors)
    t = expert_tensors(fixtures_dir / HIGH)["3.up_proj.trellis"]
    layer.w13_trellis.weight_loader(layer.w13_trellis, t, "experts.3.up_proj.trellis", "w3", 3, True)
    with pytest.raises(LayerLoadError, match=r"expert 3 has a w3 .* ungated experts"):
        method.process_weights_after_loading(layer)
    for over in ({"activation": SimpleNamespace(value="relu2_no_mul")}, {**UNGATED, "activation": "gelu_no_mul"}):
        with pytest.raises(UnsupportedMoeError, match="ungated relu2 experts"):
            make_layer(**over)
