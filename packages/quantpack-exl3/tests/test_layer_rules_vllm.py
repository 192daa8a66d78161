"""The decoder layers the pack check expects (quantpack_core.check.architectures.architecture_layer) against the
layers vLLM itself builds for the same config.json: each model class of KNOWN_LAYERS is built by the installed vLLM
(on the meta device: no weights), and the modules it loads into, mapped back to the checkpoint's names (vLLM's
qkv_proj is the pack's q/k/v_proj, gate_up_proj its gate/up_proj, a FusedMoE's parameters its experts), and the
projections that carry a bias, must be exactly the rule's, layer by layer. A vLLM release that changes a layer fails
here."""

from __future__ import annotations

import json

import pytest
import torch

from quantpack_core.check.architectures import (
    KNOWN_LAYERS,
    MLP_ACTIVATIONS,
    OWN_TENSORS,
    activation_rule,
    architecture_layer,
    layer_sizes,
    unquantized_layer_modules,
)

BASE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
}
MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
NEXT = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "num_experts": 4,
    "shared_expert_intermediate_size": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "partial_rotary_factor": 0.25,
    **MOE,
}
#: config.json of each case: every class of KNOWN_LAYERS, with the settings its layer reads
CASES = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    "llama-attention-bias": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": True,
        "mlp_bias": True,
    },
    "llama-o-bias-only": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": True,
        "qkv_bias": False,
    },
    "llama-legacy-bias": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "bias": True},
    # flags vLLM reads for truth whatever their JSON type (transformers declares neither)
    "llama-qkv-bias-1": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "qkv_bias": 1},
    "llama-qkv-bias-string": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "qkv_bias": "false"},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"},
    "qwen2-qk-norm": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "qk_norm": True},
    "qwen2-qk-norm-1": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "qk_norm": 1},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": True},
    "qwen3-moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": 4,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [0],
        **MOE,
    },
    # the expert count as transformers 5 writes it (num_local_experts alone), and a gated shared expert
    "qwen3-moe-local-experts": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_local_experts": 4,
        "shared_expert_intermediate_size": 32,
        **MOE,
    },
    "mixtral": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4, **MOE},
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral"},
    "mistral-bias": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "bias": True, "mlp_bias": True},
    "ministral3": {"architectures": ["Ministral3ForCausalLM"], "model_type": "ministral3"},
    # dense layer 0 and odd layers sparse; a shared expert, and without one (its gate is built all the same)
    "qwen2-moe": {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "num_experts": 4,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [0],
        "shared_expert_intermediate_size": 32,
        **MOE,
    },
    "qwen2-moe-no-shared-expert": {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "num_experts": 4,
        "shared_expert_intermediate_size": 0,
        **MOE,
    },
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"},
    "gemma2-attention-bias": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attention_bias": True},
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": True},
    # Gated DeltaNet and attention layers as layer_types gives them, a dense layer; then without layer_types (every
    # fourth layer full attention, as each release's config class derives it), every layer sparse, q/k/v biased
    "qwen3-next": {**NEXT, "layer_types": ["linear_attention", "full_attention"] * 2, "mlp_only_layers": [2]},
    "qwen3-next-interval": {**NEXT, "full_attention_interval": 4, "qkv_bias": True},
}


def test_every_known_class_has_a_case():
    assert {c["architectures"][0] for c in CASES.values()} == set(KNOWN_LAYERS)


def checkpoint_modules(names: list[str]) -> tuple[set[str], set[str]]:
    """vLLM's parameter names inside one layer -> (the checkpoint's module paths they load, those with a bias)."""
    modules: set[str] = set()
    biased: set[str] = set()
    for name in names:
        path, _, leaf = name.rpartition(".")
        if ".experts." in f".{path}.":  # a FusedMoE's w13 / w2: the pack's experts
            path = path[: f".{path}.".index(".experts.") + len("experts")].lstrip(".")
        parent, _, last = path.rpartition(".")
        unpacked = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
        paths = [f"{parent}.{p}" for p in unpacked[last]] if last in unpacked else [path]
        modules.update(paths)
        if leaf == "bias":
            biased.update(paths)
    return modules, biased


def recording_config():
    """A vLLM quantization config that records the prefix of every layer vLLM builds with it (the layers a
    quantization method can take) and leaves each unquantized: vLLM's own methods, so the layers hold the parameters
    of an unquantized build."""
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

    class Recording(QuantizationConfig):
        def __init__(self):
            super().__init__()
            self.asked: set[str] = set()

        def get_name(self):
            return "recording"

        def get_supported_act_dtypes(self):
            return [torch.float32]

        @classmethod
        def get_min_capability(cls):
            return 0

        @staticmethod
        def get_config_filenames():
            return []

        @classmethod
        def from_config(cls, config):
            return cls()

        def get_quant_method(self, layer, prefix):
            self.asked.add(prefix)
            return UnquantizedLinearMethod() if isinstance(layer, LinearBase) else None

    return Recording()


@pytest.fixture(scope="module")
def built(vllm_layers, tmp_path_factory):
    """``{case: ([parameter names of each decoder layer], {prefixes vLLM built with the quantization config},
    [{parameter name: shape} of each decoder layer])}`` from the installed vLLM's model classes."""
    out = {}
    for case, cfg in CASES.items():
        recording = recording_config()
        model = build(tmp_path_factory.mktemp(case), {**BASE, **cfg}, recording)
        shapes = [{n: tuple(t.shape) for n, t in layer.named_parameters()} for layer in model.model.layers]
        out[case] = [list(layer) for layer in shapes], recording.asked, shapes
    return out


def build(folder, config: dict, quant_config=None):
    """The model vLLM builds for ``config`` (written to ``folder``/config.json), on the meta device (no weights), with
    ``quant_config`` (default: a :func:`recording_config`); vLLM's own errors propagate."""
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    model_config = ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype="float32", max_model_len=128)
    vc = VllmConfig(
        model_config=model_config,
        device_config=DeviceConfig("cpu"),
        load_config=LoadConfig(),
        quant_config=quant_config or recording_config(),
    )
    with set_current_vllm_config(vc), torch.device("meta"):
        return initialize_model(vllm_config=vc)


@pytest.mark.parametrize("case", sorted(c for c in CASES if CASES[c]["architectures"][0] in MLP_ACTIVATIONS))
def test_the_activations_stated_are_those_vllm_builds(vllm_layers, tmp_path, case):
    """quantpack_core.check.architectures.MLP_ACTIVATIONS against vLLM's classes: each value the rule takes builds the
    class, and a value it refuses (one of another class's, and one no class takes) stops vLLM's build, as it did in
    the worker; where activation_rule states none (no dense MLP, no shared expert), any value builds."""
    config = {**BASE, **CASES[case]}
    arch = config["architectures"][0]
    key, allowed = MLP_ACTIVATIONS[arch].key, MLP_ACTIVATIONS[arch].allowed
    if activation_rule(arch, config) is None:  # no layer builds a module that takes it: any value builds
        build(tmp_path / "relu2", {**config, key: "relu2"})
        return
    for value in sorted(allowed):
        build(tmp_path / value, {**config, key: value})
    for value in sorted({"gelu_pytorch_tanh", "silu", "relu2"} - allowed):
        with pytest.raises(ValueError):
            build(tmp_path / value, {**config, key: value})


def test_the_rope_settings_refused_are_those_vllm_stops_on(vllm_layers):
    """The pack check's RoPE rules (quantpack_core.check.config.ROPE_TYPES and the rotated fraction) against vLLM's
    get_rope: every type the installed vLLM builds is among those the check takes (it refuses none vLLM knows); an
    unknown type, a base that is a string, a fraction outside (0, 1] stop get_rope; a fraction that rotates an odd
    number of features builds tables of another width than it rotates, so rotating fails."""
    import inspect
    import re

    from vllm.model_executor.layers import rotary_embedding
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from quantpack_core.check.config import ROPE_TYPES

    source = inspect.getsource(rotary_embedding.get_rope)
    known = set(re.findall(r'scaling_type == "([\w-]+)"', source))
    for group in re.findall(r"scaling_type in \[([^\]]*)\]", source):
        known |= set(re.findall(r'"([\w-]+)"', group))
    assert "default" in known and known <= ROPE_TYPES, sorted(known - ROPE_TYPES)

    def rope(**params):
        return get_rope(64, 128, True, {"rope_type": "default", "rope_theta": 10000.0, **params}, dtype=torch.float32)

    with pytest.raises(ValueError, match="Unknown RoPE scaling type"):
        rope(rope_type="bogus")
    with pytest.raises(TypeError):
        rope(rope_theta="10000")
    for fraction in (0.0, 1.5):
        with pytest.raises(ValueError):
            rope(partial_rotary_factor=fraction)
    positions, q, k = torch.arange(4), torch.randn(4, 128), torch.randn(4, 64)
    rope(partial_rotary_factor=0.25).forward_native(positions, q, k)  # 16 features: rotated
    with pytest.raises(RuntimeError):
        rope(partial_rotary_factor=0.3).forward_native(positions, q, k)  # 19 features


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_rule_states_the_layer_vllm_builds(built, case):
    config = {**BASE, **CASES[case]}
    arch = config["architectures"][0]
    layers, _, _ = built[case]
    assert len(layers) == BASE["num_hidden_layers"]
    for i, names in enumerate(layers):
        modules, biased = checkpoint_modules(names)
        required, absent, bias = architecture_layer(arch, config, i)
        assert set(required) == modules, (case, i, sorted(modules))
        assert not set(absent) & modules, (case, i)
        assert {p for p, has in bias.items() if has} == biased, (case, i, sorted(biased))
        assert set(bias) <= modules, (case, i)  # the rule states the bias of modules the layer has
        for path, own in OWN_TENSORS.items():  # a module's parameters of its own beside its modules
            held = {name.rpartition(".")[2] for name in names if name.rpartition(".")[0] == path}
            assert held == (set(own) if path in required else set()), (case, i, path, held)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_modules_stated_dense_are_those_vllm_builds_without_the_quantization_config(built, case):
    """Each module of a layer is either one vLLM builds with the quantization config (so quantpack's method may take
    a trellis there) or one quantpack_core.check.architectures.unquantized_layer_modules states dense (a trellis there
    is refused at the pack check): never both, never neither. Qwen3-MoE's router is built with it, the other classes'
    not."""
    config = {**BASE, **CASES[case]}
    arch = config["architectures"][0]
    layers, asked, _ = built[case]
    for i in range(len(layers)):
        required, _, _ = architecture_layer(arch, config, i)
        quantizable, _ = checkpoint_modules(
            [f"{p.removeprefix(f'model.layers.{i}.')}.weight" for p in asked if p.startswith(f"model.layers.{i}.")]
        )
        dense = set(unquantized_layer_modules(arch, config, i))
        assert dense <= set(required), (case, i)
        assert set(required) - dense == quantizable & set(required), (case, i, sorted(quantizable))
        assert not dense & quantizable, (case, i)
    if arch in ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3MoeForCausalLM"):
        router = "block_sparse_moe.gate" if arch == "MixtralForCausalLM" else "mlp.gate"
        routed = [i for i in range(len(layers)) if router in architecture_layer(arch, config, i)[0]]
        assert routed, case
        assert (router in unquantized_layer_modules(arch, config, routed[0])) == (arch != "Qwen3MoeForCausalLM")


def fits(want: tuple, have: tuple) -> bool:
    """Whether shape ``have`` is ``want`` where ``want`` gives a size (None: any)."""
    return len(want) == len(have) and all(w is None or w == h for w, h in zip(want, have, strict=True))


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_sizes_stated_are_those_vllm_builds(built, case):
    """quantpack_core.check.architectures.layer_sizes against the parameters vLLM builds for the same config.json,
    layer by layer: a linear module's (in, out) in vLLM's (out, in) weight, q / k / v inside qkv_proj, gate / up inside
    gate_up_proj, an expert bank's projections inside w13_weight / w2_weight (experts, 2 x out, in), a norm's
    size, the Gated DeltaNet's own A_log / dt_bias. Every size the rule gives is checked, and every module of the
    layer has one."""
    config = {**BASE, **CASES[case]}
    arch = config["architectures"][0]
    _, _, shapes = built[case]
    for i, params in enumerate(shapes):
        sizes = layer_sizes(arch, config, i)
        own = {f"{m}.{n}" for m, names in OWN_TENSORS.items() for n in names} & set(sizes)  # a block's own
        stated = {p.rsplit(".", 1)[0] if ".experts." in f".{p}." or p in own else p for p in sizes}
        required = set(architecture_layer(arch, config, i)[0])
        assert required == stated, (case, i, sorted(required ^ stated))
        qkv: list[int | None] = []
        for path, size in sizes.items():
            parent, _, last = path.rpartition(".")
            if len(size) != 2:  # the tensor's own shape: a norm's, the Gated DeltaNet's conv1d, A_log, dt_bias
                have = params[path if path in own else f"{path}.weight"]
                assert fits(size, have), (case, i, path, have)
                continue
            n_in, n_out = size
            if parent.endswith("experts"):
                fused = last in ("gate_proj", "up_proj", "w1", "w3")
                suffix = "w13_weight" if fused else "w2_weight"  # under the bank (0.32: its routed_experts)
                have = next(v for k, v in params.items() if k.startswith(f"{parent}.") and k.endswith(suffix))
                want = (None, None if n_out is None else (2 * n_out if fused else n_out), n_in)
                assert fits(want, have), (case, i, path, have)
            elif last in ("q_proj", "k_proj", "v_proj"):
                have = params[f"{parent}.qkv_proj.weight"]
                assert n_in == have[1], (case, i, path, have)
                qkv.append(n_out)
            elif last in ("gate_proj", "up_proj"):
                have = params[f"{parent}.gate_up_proj.weight"]
                assert fits((None if n_out is None else 2 * n_out, n_in), have), (case, i, path, have)
            else:
                have = params[f"{path}.weight"]
                assert fits((n_out, n_in), have), (case, i, path, have)
        if qkv and None not in qkv:
            assert sum(qkv) == params["self_attn.qkv_proj.weight"][0], (case, i, qkv)
