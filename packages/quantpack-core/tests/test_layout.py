"""Modules missing from a decoder layer (quantpack_core.layout): reported by the pack check in the user's process,
where vLLM would only fail in its worker; and the layouts of the architectures the project knows are never refused.
"""

import json
import math
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_pack import expect_problem

from quantpack_core import Pack, PackError
from quantpack_core.check.architectures.problems import architecture_problems
from quantpack_core.check.layers import (
    FIX_DENSE,
    OTHER_STACKS,
    decoder_layers,
    sibling_problems,
    stack_problems,
    sublayer_problems,
    tensor_problems,
)
from quantpack_core.inventory import MANIFEST_FILE
from quantpack_core.synthetic import random_exl3_layer, replace_module

PACK = "llama-tiny-exl3-4.0bpw-mul1"


def without(src, dst, prefix, manifest=False):
    """A copy of pack ``src`` without the tensors under ``prefix``; its manifest's tensor list dropped too unless
    ``manifest`` (a pack whose quantization_config.json does not list its tensors, as hand-made packs' do not)."""
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        save_file({k: v for k, v in load_file(f).items() if not k.startswith(prefix)}, f, metadata={"format": "pt"})
    index = dst / "model.safetensors.index.json"
    if index.exists():
        j = json.loads(index.read_text())
        j["weight_map"] = {k: v for k, v in j["weight_map"].items() if not k.startswith(prefix)}
        index.write_text(json.dumps(j))
    if not manifest:
        j = json.loads((dst / MANIFEST_FILE).read_text())
        j.pop("tensor_storage", None)
        (dst / MANIFEST_FILE).write_text(json.dumps(j))
    return dst


@pytest.mark.parametrize(
    ("drop", "needles"),
    [
        (
            "model.layers.1.self_attn.k_proj.",
            ["model.layers.1.self_attn.k_proj", "holds q_proj and v_proj but no k_proj"],
        ),
        (
            "model.layers.1.self_attn.q_proj.",
            ["model.layers.1.self_attn.q_proj", "holds k_proj and v_proj but no q_proj"],
        ),
        (
            "model.layers.1.self_attn.o_proj.",
            ["model.layers.1.self_attn.o_proj", "holds q_proj and k_proj but no o_proj"],
        ),
        (
            "model.layers.3.mlp.down_proj.",
            ["model.layers.3.mlp.down_proj", "holds gate_proj and up_proj but no down_proj"],
        ),
        ("model.layers.0.mlp.up_proj.", ["model.layers.0.mlp.up_proj", "holds gate_proj and down_proj but no up_proj"]),
        (
            "model.layers.1.mlp.gate_proj.",
            ["holds up_proj and down_proj but no gate_proj, which the other model.layers.#.mlp hold"],
        ),
        (
            "model.layers.2.self_attn.",
            ["model.layers.2.self_attn", "layer 2 holds no self_attn (its sublayers: mlp), while 3 of"],
        ),
        ("model.layers.0.mlp.", ["model.layers.0.mlp", "layer 0 holds no mlp"]),
        ("model.layers.2.self_attn.v_proj.", ["holds no v_proj, which the other 3 model.layers.#.self_attn hold"]),
        ("model.embed_tokens.", ["model.embed_tokens.weight: no token embedding for the decoder stack model.layers.*"]),
        ("model.norm.", ["model.norm.weight: no final norm after the decoder stack model.layers.*"]),
        ("lm_head.", ["lm_head.*: missing: config.json says tie_word_embeddings false"]),
    ],
)
def test_a_module_missing_from_a_layer_is_named(tmp_path, fixtures_dir, drop, needles):
    pack = without(fixtures_dir / PACK, tmp_path / "p", drop)
    error = expect_problem(pack, *needles, "re-download it")
    assert len(error.problems) == 1, error.problems


def test_the_manifest_names_it_first(tmp_path, fixtures_dir):
    """With a manifest that lists the tensors, its own problem names the module, and the layout adds no twin."""
    pack = without(fixtures_dir / PACK, tmp_path / "p", "model.layers.1.self_attn.k_proj.", manifest=True)
    error = expect_problem(pack, "model.layers.1.self_attn.k_proj.trellis", "listed in quantization_config.json")
    assert {p.module for p in error.problems} == {"model.layers.1.self_attn.k_proj"}
    assert not any("no k_proj" in p.what for p in error.problems)


def test_the_sound_pack_and_its_layers(fixtures_dir):
    pack = Pack.open(fixtures_dir / PACK)
    stacks = decoder_layers(pack.modules, OTHER_STACKS, 4)
    assert sorted(stacks) == ["model.layers."] and sorted(stacks["model.layers."]) == [0, 1, 2, 3]
    assert sorted(stacks["model.layers."][0]) == [
        "input_layernorm", "mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "post_attention_layernorm",
        "self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj",
    ]  # fmt: skip
    # layers past num_hidden_layers (DeepSeek's MTP layers) and other stacks are left out
    assert decoder_layers(pack.modules, OTHER_STACKS, 2)["model.layers."].keys() == {0, 1}
    assert decoder_layers(["model.visual.layers.0.attn.qkv", "x"], OTHER_STACKS, None) == {}


def keys(layers: dict[int, list[str]], stack: str = "model.layers.") -> list[str]:
    return [f"{stack}{i}.{p}" for i, paths in layers.items() for p in paths]


ATTN = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
NORMS = ["input_layernorm", "post_attention_layernorm"]


GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")
UP_DOWN = ("up_proj", "down_proj")
SHARED = ["mixer.shared_experts.up_proj", "mixer.shared_experts.down_proj"]


def experts(parent: str, n: int, projs=GATE_UP_DOWN) -> list[str]:
    return [f"{parent}.experts.{e}.{p}" for e in range(n) for p in projs]


#: decoder layouts of architectures the project serves or knows (docs/families.md, vLLM's model files): sound
SOUND = {
    # Qwen3-Next: three linear-attention layers to one full-attention layer, MoE with a gated shared expert
    "qwen3-next": {
        i: (["linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba", "linear_attn.out_proj"] if i % 4 != 3 else ATTN)
        + ["mlp.gate", "mlp.shared_expert_gate", "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"]
        + ["mlp.shared_expert.down_proj", *experts("mlp", 4), *NORMS]
        for i in range(8)
    },
    # Nemotron-H: one mixer per layer, Mamba2 / attention / relu^2 MLP / latent MoE with ungated experts
    "nemotron-h": {
        i: ["norm"]
        + [
            ["mixer.in_proj", "mixer.out_proj"],
            ["mixer.q_proj", "mixer.k_proj", "mixer.v_proj", "mixer.o_proj"],
            ["mixer.up_proj", "mixer.down_proj"],
            ["mixer.gate", "mixer.fc1_latent_proj", "mixer.fc2_latent_proj", *experts("mixer", 4, UP_DOWN), *SHARED],
        ][i % 4]
        for i in range(8)
    },
    # DeepSeek-V2-Lite: MLA without q LoRA (a lone q_proj), a dense first layer, then experts and shared experts
    "deepseek-v2-lite": {
        i: ["self_attn.q_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj", "self_attn.o_proj"]
        + ["self_attn.kv_a_layernorm", *NORMS]
        + (
            ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
            if i == 0
            else ["mlp.gate", *experts("mlp", 4), *(f"mlp.shared_experts.{p}" for p in GATE_UP_DOWN)]
        )
        for i in range(6)
    },
    # attention whose value is its key on the full layers (no v_proj), GELU MLP without gate
    "k-eq-v-gelu": {
        i: ["self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj"]
        + ([] if i % 6 == 5 else ["self_attn.v_proj"])
        + ["mlp.up_proj", "mlp.down_proj", *NORMS]
        for i in range(12)
    },
    # Jamba-like: Mamba or attention, dense or expert MLP under one name
    "jamba": {
        i: (["mamba.in_proj", "mamba.x_proj", "mamba.dt_proj", "mamba.out_proj"] if i % 8 != 4 else ATTN)
        + (["feed_forward.gate_proj", "feed_forward.up_proj", "feed_forward.down_proj"] if i % 2 == 0 else [])
        + (["feed_forward.router", *experts("feed_forward", 4)] if i % 2 else [])
        + NORMS
        for i in range(8)
    },
    # Phi-3: fused qkv_proj and gate_up_proj; GPT-J: q/k/v with out_proj, fc_in / fc_out
    "phi3": {
        i: ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj", *NORMS] for i in range(4)
    },
    "gpt-j": {
        i: ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj", "mlp.fc_in", "mlp.fc_out", "ln_1"]
        for i in range(4)
    },
    # Mixtral's experts (w1 gate, w3 up, w2 down)
    "mixtral": {
        i: [*ATTN, "block_sparse_moe.gate", *experts("block_sparse_moe", 4, ("w1", "w2", "w3"))] for i in range(4)
    },
}


@pytest.mark.parametrize("arch", sorted(SOUND))
def test_known_layouts_are_not_refused(arch):
    stacks = decoder_layers(keys(SOUND[arch]), OTHER_STACKS, None)
    assert sibling_problems(stacks) == [] and sublayer_problems(stacks) == []


@pytest.mark.parametrize("arch", sorted(SOUND))
def test_every_known_layout_loses_a_sublayer_visibly(arch):
    """The same layouts with one layer's first sublayer removed: reported, naming that sublayer (the rule is not
    silent on hybrids, where it could only see the layer's count)."""
    layers = {i: list(p) for i, p in SOUND[arch].items()}
    first = next(p for p in layers[1] if "." in p).split(".", 1)[0]
    layers[1] = [p for p in layers[1] if not p.startswith(first + ".")]
    problems = sublayer_problems(decoder_layers(keys(layers), OTHER_STACKS, None))
    assert [p.module for p in problems] == [f"model.layers.1.{first}"], problems
    assert re.search(rf"layer 1 holds no {first}\b", problems[0].what)


def test_expert_pieces_and_the_mamba_pair():
    layers = {i: ["mixer.in_proj", "mixer.out_proj", *experts("mlp", 3)] for i in range(4)}
    layers[2].remove("mixer.out_proj")
    layers[3].remove("mlp.experts.1.gate_proj")
    problems = sibling_problems(decoder_layers(keys(layers), OTHER_STACKS, None))
    # lone down_proj and in_proj, or up / down pairs, are no evidence on their own (a test pack's, a GELU MLP's)
    gelu = ["mlp.up_proj", "mlp.down_proj"]
    for lone in ({0: ["mlp.down_proj", "mixer.in_proj"], 1: ["mlp.down_proj"]}, {0: gelu, 1: gelu}):
        assert sibling_problems(decoder_layers(keys(lone), OTHER_STACKS, None)) == []
    assert [(p.module, p.what) for p in problems] == [
        ("model.layers.2.mixer.out_proj", "holds in_proj but no out_proj, which the other model.layers.#.mixer hold"),
        (
            "model.layers.3.mlp.experts.1.gate_proj",
            "holds up_proj and down_proj but no gate_proj, which the other model.layers.#.mlp.experts.# hold",
        ),
    ]


#: the modules besides the layers of some of :data:`SOUND`'s architectures, and of others with unusual places
BESIDE = {
    "qwen3-next": ["model.embed_tokens", "model.norm", "lm_head"],
    "nemotron-h": ["backbone.embeddings", "backbone.norm_f", "lm_head"],
    "gpt-j": ["transformer.wte", "transformer.ln_f", "lm_head"],
    # ChatGLM: the embedding below another parent than the layers
    "chatglm": [
        "transformer.embedding.word_embeddings",
        "transformer.encoder.final_layernorm",
        "transformer.output_layer",
    ],
}


@pytest.mark.parametrize("arch", sorted(BESIDE))
def test_a_stack_with_its_embedding_norm_and_head_is_sound(arch):
    layers = SOUND.get(arch, SOUND["phi3"])
    stack = {"nemotron-h": "backbone.layers.", "gpt-j": "transformer.layers.", "chatglm": "transformer.encoder.layers."}
    prefix = stack.get(arch, "model.layers.")
    if arch == "gpt-j":  # GPT-J's own transformer.h.N is no layers. stack: the rules see none and say nothing
        assert decoder_layers(keys(layers, "transformer.h."), OTHER_STACKS, None) == {}
    all_keys = keys(layers, prefix) + BESIDE[arch]
    stacks = decoder_layers(all_keys, OTHER_STACKS, None)
    config = {"architectures": ["XForCausalLM"], "tie_word_embeddings": False}
    assert stack_problems(stacks, all_keys, OTHER_STACKS, config) == []
    # without each of them
    for lost in BESIDE[arch][:2]:
        problems = stack_problems(stacks, [k for k in all_keys if k != lost], OTHER_STACKS, config)
        assert len(problems) == 1 and ("embedding" in problems[0].what) == (lost == BESIDE[arch][0]), problems


def test_what_the_stack_rule_leaves_alone():
    layers = keys({i: [*ATTN, *NORMS] for i in range(2)})
    stacks = decoder_layers(layers, OTHER_STACKS, None)
    llama = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2}
    vision = ["model.visual.patch_embed.proj", "model.visual.merger.norm"]
    # a vision tower's patch embedding and norm do not stand in for the decoder's
    problems = stack_problems(stacks, layers + vision, OTHER_STACKS, llama)
    assert [p.module for p in problems] == ["model.embed_tokens", "model.norm"]
    # drafts take all three from their target: by name, or (EAGLE-1 published as LlamaForCausalLM) by their fc
    for arch in ("EagleLlamaForCausalLM", "Eagle3LlamaForCausalLM", "DeepSeekMTPModel", "Qwen3DSparkModel"):
        assert stack_problems(stacks, layers, OTHER_STACKS, {**llama, "architectures": [arch]}) == [], arch
    assert stack_problems(stacks, [*layers, "fc", "embed_tokens"], OTHER_STACKS, llama) == []
    # ... but Eagle 2.5 VL is a whole vision-language model
    eagle_vl = {**llama, "architectures": ["Eagle2_5_VLForConditionalGeneration"]}
    assert len(stack_problems(stacks, layers, OTHER_STACKS, eagle_vl)) == 2
    # OPT without pre-norm has no final norm; a tied head needs no head
    text = {"text_config": {"do_layer_norm_before": False, "tie_word_embeddings": True}}
    assert stack_problems(stacks, [*layers, "model.embed_tokens"], OTHER_STACKS, {**llama, **text}) == []
    # text_config's word on tying wins over the top level's; pooling and reward models have no head
    text = {"tie_word_embeddings": True, "text_config": {"tie_word_embeddings": False}}
    sound = [*layers, "model.embed_tokens", "model.norm"]
    problems = stack_problems(stacks, sound, OTHER_STACKS, {**llama, **text})
    assert [p.module for p in problems] == ["lm_head"]
    for arch in ("Qwen3Model", "LlamaForSequenceClassification"):
        assert stack_problems(stacks, sound, OTHER_STACKS, {**llama, **text, "architectures": [arch]}) == []
    # Qwen3-Embedding: Qwen3ForCausalLM's config over Qwen3Model's weights (layers at the top, no head); encoders
    top = keys({i: [*ATTN, *NORMS] for i in range(2)}, "layers.")
    tops = decoder_layers(top, OTHER_STACKS, None)
    assert stack_problems(tops, [*top, "embed_tokens", "norm"], OTHER_STACKS, {**llama, **text}) == []
    encoder = keys(
        {i: ["attn.Wqkv", "attn.out_proj", "mlp.fc11", "mlp.fc2", "norm1", "norm2"] for i in range(2)},
        "encoder.layers.",
    )
    nomic = {"architectures": ["NomicBertModel"], "num_hidden_layers": 2}
    assert stack_problems(decoder_layers(encoder, OTHER_STACKS, None), encoder, OTHER_STACKS, nomic) == []
    # BART's layernorm_embedding is a norm, not the embedding
    problems = stack_problems(stacks, [*layers, "model.layernorm_embedding", "model.norm"], OTHER_STACKS, llama)
    assert [p.module for p in problems] == ["model.embed_tokens"]


def test_towers_and_nested_stacks():
    """Only the language model's stack: a tower of another depth (MiniCPM-V's vpm, whose embedding must not stand
    in for the language model's), or of the same depth but named as a tower, is left alone; PLaMo's final norm
    sits above its nested stack."""
    lm = keys({i: [*ATTN, *NORMS] for i in range(4)}, "llm.model.layers.")
    vpm = keys({i: ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "layer_norm1"]
                for i in range(3)}, "vpm.encoder.layers.")  # fmt: skip
    config = {"architectures": ["MiniCPMV"], "num_hidden_layers": 4}
    stacks = decoder_layers(lm + vpm, OTHER_STACKS, None)
    problems = stack_problems(
        stacks, [*lm, *vpm, "vpm.embeddings.patch_embedding", "llm.model.norm"], OTHER_STACKS, config
    )
    assert [p.module for p in problems] == ["llm.model.embed_tokens"]
    # a speech encoder of the language model's depth, without a final norm of its own
    speech = keys(
        {i: ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "norm1"] for i in range(4)}, "encoder.layers."
    )
    beside = ["llm.model.embed_tokens", "llm.model.norm", "encoder.input_linear"]
    stacks = decoder_layers(lm + speech, OTHER_STACKS, None)
    assert sorted(stacks) == ["encoder.layers.", "llm.model.layers."]
    assert stack_problems(stacks, [*lm, *speech, *beside], OTHER_STACKS, config) == []
    # PLaMo 2: model.layers.layers.N, the final norm model.norm
    plamo = keys({i: ["mixer.in_proj", "mixer.out_proj", "mlp.gate_up_proj", "mlp.down_proj", "pre_mixer_norm"]
                  for i in range(4)}, "model.layers.layers.")  # fmt: skip
    stacks = decoder_layers(plamo, OTHER_STACKS, None)
    config = {"architectures": ["Plamo2ForCausalLM"], "num_hidden_layers": 4}
    assert stack_problems(stacks, [*plamo, "model.embed_tokens", "model.norm"], OTHER_STACKS, config) == []


def test_a_layer_of_another_kind_is_not_a_layer_short():
    """Step3: its MoE layers hold self_attn, moe and share_expert, its dense layers self_attn and mlp."""
    step3 = {
        i: [*ATTN, *(["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"] if i < 4 or i == 60 else
                     ["moe.gate", *experts("moe", 4), "share_expert.gate_proj", "share_expert.up_proj",
                      "share_expert.down_proj"])]
        for i in range(61)
    }  # fmt: skip
    assert sublayer_problems(decoder_layers(keys(step3), OTHER_STACKS, None)) == []
    # a MoE layer that lost its shared expert still holds only what most layers hold: reported
    step3[10] = [p for p in step3[10] if not p.startswith("share_expert.")]
    problems = sublayer_problems(decoder_layers(keys(step3), OTHER_STACKS, None))
    assert [p.module for p in problems] == ["model.layers.10.share_expert"]


def test_the_eagle_draft_fixture_is_sound(fixtures_dir):
    """The bundled EAGLE draft holds layers and fc only (its target lends embedding, final norm and head)."""
    pack = Pack.open(fixtures_dir / "llama-tiny-eagle-draft", require_exl3=False)
    assert "model.embed_tokens" not in pack.modules and "lm_head" not in pack.modules


def test_every_module_of_the_bundled_pack_is_missed(tmp_path, fixtures_dir):
    """Each module of the dense bundled pack removed in turn (its manifest listing no tensors): every one is
    reported, by a problem naming that module or its layer's sublayer."""
    modules = sorted(Pack.open(fixtures_dir / PACK).modules)
    assert len(modules) == 39
    unseen = []
    for i, module in enumerate(modules):
        pack = without(fixtures_dir / PACK, tmp_path / str(i), module + ".")
        try:
            Pack.open(pack)
        except PackError as e:
            if not any(module.startswith(p.module) for p in e.problems):
                unseen.append((module, [p.module for p in e.problems]))
        else:
            unseen.append((module, "accepted"))
        shutil.rmtree(pack)
    assert unseen == []


def test_a_module_every_other_layer_holds(tmp_path, fixtures_dir):
    """Qwen3-Next's dense shared_expert_gate lost from one of its two layers (vLLM would serve its initial weights,
    without a word), or its router; a q_norm lost from one of six layers; not DeepSeek's dense first layer, whose mlp
    holds no router (in :data:`SOUND`)."""
    source = fixtures_dir / "qwen3next-tiny-exl3-4.0bpw-mul1"
    pack = without(source, tmp_path / "p", "model.layers.0.mlp.shared_expert_gate.")
    error = expect_problem(
        pack, "model.layers.0.mlp.shared_expert_gate", "holds shared_expert but no shared_expert_gate, which the other"
    )
    assert len(error.problems) == 1
    pack = without(source, tmp_path / "q", "model.layers.1.mlp.gate.")
    expect_problem(pack, "model.layers.1.mlp.gate", "holds experts but no gate / router, which the other")
    layers = {i: [*ATTN, "self_attn.q_norm", "mlp.gate", *experts("mlp", 2)] for i in range(6)}
    layers[4].remove("self_attn.q_norm")
    problems = sibling_problems(decoder_layers(keys(layers), OTHER_STACKS, None))
    assert [(p.module, p.what) for p in problems] == [
        ("model.layers.4.self_attn.q_norm", "holds no q_norm, which the other 5 model.layers.#.self_attn hold")
    ]


def test_an_unreadable_file_is_not_a_list_of_missing_modules(tmp_path, fixtures_dir):
    pack = tmp_path / "p"
    shutil.copytree(fixtures_dir / PACK, pack)
    (pack / "model.safetensors").write_bytes((pack / "model.safetensors").read_bytes()[:200])
    error = expect_problem(pack, "model.safetensors")
    assert not any("embedding" in p.what or "tie_word_embeddings" in p.what for p in error.problems), error


def test_an_expert_lost_from_one_bank_is_left_to_the_moe_rules():
    layers = {i: [*ATTN, "mlp.gate", *experts("mlp", 4)] for i in range(5)}
    layers[2] = [p for p in layers[2] if not p.startswith("mlp.experts.3.")]
    assert sibling_problems(decoder_layers(keys(layers), OTHER_STACKS, None)) == []


def test_a_plain_modules_tensor_every_other_layer_has():
    """The Gated DeltaNet's own A_log / dt_bias (beside its child projections) and a norm's bias, lost from one of six
    layers; a module whose own tensors are all gone still shows as its children's parent."""
    own, module_keys = {}, []
    for i in range(6):
        gdn, norm = f"model.layers.{i}.linear_attn", f"model.layers.{i}.input_layernorm"
        own[gdn], own[norm] = {"A_log", "dt_bias"}, {"weight", "bias"}
        module_keys += [gdn, f"{gdn}.in_proj_qkvz", f"{gdn}.out_proj", norm]
    assert tensor_problems(decoder_layers(module_keys, OTHER_STACKS, None), own, module_keys) == []
    own["model.layers.2.input_layernorm"] = {"weight"}
    del own["model.layers.4.linear_attn"]
    module_keys.remove("model.layers.4.linear_attn")
    problems = tensor_problems(decoder_layers(module_keys, OTHER_STACKS, None), own, module_keys)
    assert [(p.tensor, p.what) for p in problems] == [
        ("model.layers.2.input_layernorm.bias", "has no .bias, which the other 5 model.layers.#.input_layernorm have"),
        ("model.layers.4.linear_attn.A_log", "has no .A_log, which the other 5 model.layers.#.linear_attn have"),
        ("model.layers.4.linear_attn.dt_bias", "has no .dt_bias, which the other 5 model.layers.#.linear_attn have"),
    ]
    # two layers without it are a design; coded modules among the instances are left to their own checks
    own["model.layers.3.input_layernorm"] = {"weight"}
    assert all(
        "input_layernorm" not in p.tensor
        for p in tensor_problems(decoder_layers(module_keys, OTHER_STACKS, None), own, module_keys)
    )
    del own["model.layers.0.linear_attn"]  # now a coded module of that name, say
    assert (
        tensor_problems(
            decoder_layers(module_keys, OTHER_STACKS, None), own, [*module_keys, "model.layers.4.linear_attn"]
        )
        == []
    )


MOE_PACK = "qwen3moe-tiny-exl3-4.0bpw-mul1"
BUNDLED = sorted(
    p.name
    for p in (Path(__file__).resolve().parents[3] / "fixtures").iterdir()
    if (p / "config.json").is_file() and any(p.glob("*.safetensors"))
)


def with_config(src, dst, **changes):
    """A copy of pack ``src`` whose config.json has ``changes`` (a value of None removes the key)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return dst


def add_tensor(pack, name, tensor, beside=None):
    """Store ``tensor`` as ``name`` in pack ``pack`` (in the shard holding ``beside``, else the first) and its
    index."""
    shard = next(f for f in sorted(pack.glob("*.safetensors")) if beside is None or beside in load_file(f))
    tensors = load_file(shard)
    tensors[name] = tensor
    save_file(tensors, shard, metadata={"format": "pt"})
    index = pack / "model.safetensors.index.json"
    if index.exists():
        j = json.loads(index.read_text())
        j["weight_map"][name] = shard.name
        index.write_text(json.dumps(j))


@pytest.mark.parametrize("name", BUNDLED)
def test_every_bundled_pack_is_sound(fixtures_dir, name):
    """The layer rule of the bundled packs' classes (Llama, Qwen3-MoE) and the others' refuse none of them."""
    Pack.open(fixtures_dir / name, require_exl3=False)


def test_a_module_lost_from_one_of_two_layers(tmp_path, fixtures_dir):
    """The two-layer Qwen3-MoE pack without one layer's q_norm: too few layers for the layout rules to see it (it
    was accepted, and vLLM would serve the norm's initial ones); the layer vLLM builds for the class names it."""
    pack = without(fixtures_dir / MOE_PACK, tmp_path / "p", "model.layers.1.self_attn.q_norm.")
    error = expect_problem(
        pack,
        "model.layers.1.self_attn.q_norm",
        "layer 1 holds no self_attn.q_norm, which every layer of vLLM's Qwen3MoeForCausalLM has",
        "re-download it",
    )
    assert [p.module for p in error.problems] == ["model.layers.1.self_attn.q_norm"]


def test_a_class_of_another_family_than_the_tensors(tmp_path, fixtures_dir):
    """config.json naming a class whose layer differs from the tensors' family (same projection names): Llama
    tensors named Qwen3 (no q_norm / k_norm anywhere: vLLM would serve initial norms), Qwen3-MoE tensors named Llama
    (a q_norm vLLM's Llama has no place for: its loader stops in the worker; no dense MLP in any layer)."""
    pack = with_config(fixtures_dir / PACK, tmp_path / "q3", architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    error = expect_problem(
        pack,
        "no decoder layer holds self_attn.q_norm, which every layer of vLLM's Qwen3ForCausalLM has",
        "architectures names another model than the tensors are of",
    )
    assert [p.module for p in error.problems] == ["model.layers.0.self_attn.q_norm", "model.layers.0.self_attn.k_norm"]
    pack = with_config(fixtures_dir / MOE_PACK, tmp_path / "ll", architectures=["LlamaForCausalLM"], model_type="llama")
    error = expect_problem(
        pack,
        "layer(s) 0, 1 hold self_attn.q_norm, which vLLM's LlamaForCausalLM has no place for",
        "no decoder layer holds mlp.gate_proj, which every layer of vLLM's LlamaForCausalLM has",
    )
    assert {p.module for p in error.problems} >= {
        "model.layers.0.self_attn.q_norm",
        "model.layers.0.self_attn.k_norm",
        "model.layers.0.mlp.gate_proj",
        "model.layers.0.mlp.up_proj",
        "model.layers.0.mlp.down_proj",
    }
    # Mixtral's layer names its experts block_sparse_moe: Qwen3-MoE tensors under that class miss both its parts
    pack = with_config(fixtures_dir / MOE_PACK, tmp_path / "mx", architectures=["MixtralForCausalLM"])
    expect_problem(pack, "no decoder layer holds block_sparse_moe.experts", "has no place for")


def test_biases_against_the_config(tmp_path, fixtures_dir):
    """A config whose bias settings give the attention a bias the pack lacks (vLLM would serve an uninitialized
    one: the fix is the config), and a bias the config's class has no place for (vLLM would drop it without a word);
    Qwen2's q/k/v always carry one (the fix is not the config: no setting takes it away)."""
    pack = with_config(fixtures_dir / PACK, tmp_path / "b", attention_bias=True)
    error = expect_problem(
        pack, "layer(s) 0, 1, 2, 3: self_attn.q_proj holds no bias, but vLLM's LlamaForCausalLM gives it one"
    )
    assert [p.tensor for p in error.problems] == [
        f"model.layers.0.self_attn.{p}.bias" for p in ("q_proj", "k_proj", "v_proj", "o_proj")
    ]
    pack = with_config(fixtures_dir / PACK, tmp_path / "q2", architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    # no setting takes Qwen2's q/k/v bias away: the fix is not the config
    error = expect_problem(
        pack,
        "self_attn.v_proj holds no bias, but vLLM's Qwen2ForCausalLM always gives it one",
        "-> vLLM cannot serve this pack as it is",
    )
    assert len(error.problems) == 3  # q, k, v; o_proj has none in Qwen2 either
    # a bias stored on layer 2's v_proj, which the config's Llama has none for
    pack = without(fixtures_dir / PACK, tmp_path / "extra", "no tensor has this prefix")
    width = Pack(pack).modules["model.layers.2.self_attn.v_proj"].padded_shape[1]
    bias = torch.zeros(width, dtype=torch.float16)
    add_tensor(pack, "model.layers.2.self_attn.v_proj.bias", bias, beside="model.layers.2.self_attn.v_proj.trellis")
    error = expect_problem(
        pack,
        "model.layers.2.self_attn.v_proj.bias",
        "layer(s) 2: self_attn.v_proj holds a bias, but vLLM's LlamaForCausalLM gives it none",
        "vLLM would drop it without a word",
    )
    assert len(error.problems) == 1
    # the config that gives it one leaves that bias alone (and names the ones the other layers lack)
    config = json.loads((pack / "config.json").read_text())
    (pack / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    error = expect_problem(pack, "self_attn.v_proj holds no bias")
    assert "model.layers.2.self_attn.v_proj.bias" not in {p.tensor for p in error.problems}


def test_sound_layer_plans_of_every_known_class():
    """Layouts as vLLM builds them (test_layer_rules_vllm.py checks the plans against vLLM itself): Qwen3-MoE with
    dense layers among its sparse ones, Qwen2 with and without qk_norm, Mixtral; none refused."""
    qwen3 = [*ATTN, "self_attn.q_norm", "self_attn.k_norm", *NORMS]
    dense = [f"mlp.{p}" for p in GATE_UP_DOWN]
    sparse = ["mlp.gate", *experts("mlp", 4)]
    mixtral = ["block_sparse_moe.gate", *experts("block_sparse_moe", 4, ("w1", "w2", "w3"))]
    moe = {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "decoder_sparse_step": 2, "mlp_only_layers": [0]}
    cases = [
        (moe, {i: qwen3 + (sparse if i % 2 else dense) for i in range(4)}),
        ({"architectures": ["Qwen2ForCausalLM"]}, {i: [*ATTN, *NORMS, *dense] for i in range(2)}),
        ({"architectures": ["Qwen2ForCausalLM"], "qk_norm": True}, {i: qwen3 + dense for i in range(2)}),
        ({"architectures": ["MixtralForCausalLM"]}, {i: [*ATTN, *NORMS, *mixtral] for i in range(2)}),
    ]
    for config, layers in cases:
        module_keys = keys(layers)
        biased = {
            k: {"weight", "bias"} if k.endswith(("q_proj", "k_proj", "v_proj")) else {"weight"} for k in module_keys
        }
        qwen2 = config["architectures"] == ["Qwen2ForCausalLM"]
        tensors = biased if qwen2 else {k: {"weight"} for k in module_keys}
        stacks = decoder_layers(module_keys, OTHER_STACKS, None)
        assert architecture_problems(stacks, tensors, config) == [], config
    # an EAGLE-1 draft named LlamaForCausalLM (its fc outside the layers; no input_layernorm in its one layer)
    draft = keys({0: [*ATTN, "post_attention_layernorm", *(f"mlp.{p}" for p in GATE_UP_DOWN)]})
    llama = {"architectures": ["LlamaForCausalLM"]}
    stacks = decoder_layers(draft, OTHER_STACKS, None)
    assert architecture_problems(stacks, {key: {"weight"} for key in [*draft, "fc"]}, llama) == []
    assert [p.module for p in architecture_problems(stacks, {key: {"weight"} for key in draft}, llama)] == [
        "model.layers.0.input_layernorm"
    ]
    # a class the project states no layer for: nothing, whatever the layers hold
    stacks = decoder_layers(["model.layers.0.mlp.up_proj"], OTHER_STACKS, None)
    assert architecture_problems(stacks, {}, {"architectures": ["GPT2LMHeadModel"]}) == []
    assert architecture_problems(stacks, {}, {"architectures": "LlamaForCausalLM"}) == []


def test_moe_settings_as_transformers_writes_them_and_those_vllm_cannot_build(tmp_path, fixtures_dir):
    """The Qwen3-MoE pack's config with num_local_experts alone (transformers 5 writes no num_experts): its layers are
    still planned, so the lost q_norm is named; a sparse step of 0 (vLLM divides by it) and settings that leave no MoE
    layer (vLLM stops in the worker) are named as config problems; a gated shared expert the config gives, which the
    pack lacks, is named in every layer."""
    src = without(fixtures_dir / MOE_PACK, tmp_path / "src", "model.layers.1.self_attn.q_norm.")
    pack = with_config(src, tmp_path / "local", num_experts=None, num_local_experts=8)
    expect_problem(pack, "layer 1 holds no self_attn.q_norm, which every layer of vLLM's Qwen3MoeForCausalLM has")
    pack = with_config(fixtures_dir / MOE_PACK, tmp_path / "step0", decoder_sparse_step=0)
    error = expect_problem(pack, "decoder_sparse_step 0", "cannot plan its layers from them")
    assert [p.tensor for p in error.problems] == ["config.json"]
    pack = with_config(fixtures_dir / MOE_PACK, tmp_path / "dense", mlp_only_layers=[0, 1])
    expect_problem(pack, "no layer is an MoE layer", "stops in the worker without one")
    pack = with_config(fixtures_dir / MOE_PACK, tmp_path / "shared", shared_expert_intermediate_size=32)
    error = expect_problem(pack, "no decoder layer holds mlp.shared_expert.gate_proj", "mlp.shared_expert_gate")
    assert {p.module for p in error.problems} == {
        f"model.layers.0.mlp.shared_expert{s}" for s in (".gate_proj", ".up_proj", ".down_proj", "_gate")
    }


def test_flags_are_read_for_truth_as_vllm_reads_them(tmp_path, fixtures_dir):
    """vLLM reads qkv_bias / qk_norm with getattr for truth, whatever their JSON type: a string "false" gives the
    Llama layers' q/k/v a bias (which the pack lacks: named), and 1 counts as true."""
    pack = with_config(fixtures_dir / PACK, tmp_path / "s", qkv_bias="false")
    error = expect_problem(pack, "self_attn.q_proj holds no bias, but vLLM's LlamaForCausalLM gives it one")
    assert [p.tensor.rsplit(".", 2)[-2] for p in error.problems] == ["q_proj", "k_proj", "v_proj"]
    pack = with_config(fixtures_dir / PACK, tmp_path / "n", qkv_bias=0)
    Pack.open(pack)


def test_the_draft_exception_is_the_first_layers_input_norm_only(tmp_path, fixtures_dir):
    """A module named fc outside the layers (EAGLE-1's fusion) excuses only the first layer's input_layernorm: the
    Qwen3-MoE pack with an fc and a lost q_norm is still named."""
    pack = without(fixtures_dir / MOE_PACK, tmp_path / "p", "model.layers.1.self_attn.q_norm.")
    add_tensor(pack, "fc.weight", torch.zeros(8, 8, dtype=torch.float16))
    expect_problem(pack, "layer 1 holds no self_attn.q_norm")


def test_a_bias_no_config_can_give(tmp_path, fixtures_dir):
    """A Qwen3 o_proj bias (transformers' Qwen3 with attention_bias has one, vLLM's never): the fix says vLLM cannot
    serve it, not to change the config."""
    stacks = decoder_layers(keys({0: [*ATTN, "self_attn.q_norm", "self_attn.k_norm", *NORMS]}), OTHER_STACKS, 1)
    held = {k: {"weight", "bias"} for k in keys({0: ATTN})} | {k: {"weight"} for k in keys({0: NORMS})}
    held |= {f"model.layers.0.self_attn.{n}": {"weight"} for n in ("q_norm", "k_norm")}
    config = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": True}
    problems = [p for p in architecture_problems(stacks, held, config) if p.tensor.endswith(".bias")]
    assert [(p.tensor, p.fix.split(" (")[0]) for p in problems] == [
        ("model.layers.0.self_attn.o_proj.bias", "vLLM cannot serve this pack as it is")
    ]
    assert "has none there whatever config.json says" in problems[0].what


def test_a_layer_index_of_thousands_of_digits(tmp_path, fixtures_dir):
    """A tensor named with a 5,000-digit layer index: a named problem, not Python's int() limit error."""
    pack = without(fixtures_dir / PACK, tmp_path / "p", "no tensor has this prefix")
    add_tensor(pack, f"model.layers.{'7' * 5000}.mlp.up_proj.weight", torch.zeros(4, dtype=torch.float16))
    expect_problem(pack, "a layer index of 5000 digits: no model has that many layers")


def test_a_module_vllms_layer_does_not_have(tmp_path, fixtures_dir):
    """Modules vLLM's layer for the class has no place for (its loader stops in the worker): the Qwen3-MoE pack's
    layer 1 made dense by mlp_only_layers still holds a router and a bank (one problem each, not one per expert),
    and lacks the dense MLP; rotary tables, which vLLM skips, are no problem."""
    pack = with_config(fixtures_dir / MOE_PACK, tmp_path / "dense1", mlp_only_layers=[1])
    error = expect_problem(pack, "layer(s) 1 hold mlp.experts, which vLLM's Qwen3MoeForCausalLM layer has no module")
    assert {p.module for p in error.problems} == {
        "model.layers.1.mlp.gate",
        "model.layers.1.mlp.experts",
        "model.layers.1.mlp.gate_proj",
        "model.layers.1.mlp.up_proj",
        "model.layers.1.mlp.down_proj",
    }
    pack = without(fixtures_dir / PACK, tmp_path / "rope", "no tensor has this prefix")
    for i in range(4):
        add_tensor(pack, f"model.layers.{i}.self_attn.rotary_emb.inv_freq", torch.ones(8))
    Pack.open(pack)
    # nor scales vLLM maps or ignores, under any of their spellings; a rotary module's other tensors, and a parent's
    # own weight, are (vLLM's loader has no place for them)
    dense = [*ATTN, *NORMS, *(f"mlp.{p}" for p in GATE_UP_DOWN)]
    extra = {"self_attn.attn": {"k_scale"}, "self_attn.k_cache": {"scale"}, "self_attn.rotary_pos_emb": {"inv_freq"}}
    base = {k: {"weight"} for k in keys({0: dense})}
    stacks = decoder_layers(keys({0: [*dense, *extra]}), OTHER_STACKS, 1)
    llama = {"architectures": ["LlamaForCausalLM"]}
    assert architecture_problems(stacks, base | {f"model.layers.0.{k}": v for k, v in extra.items()}, llama) == []
    for path, own in (("self_attn.rotary_emb", {"cos_sin_cache"}), ("self_attn", {"weight"})):
        stacks = decoder_layers(keys({0: [*dense, path]}), OTHER_STACKS, 1)
        problems = architecture_problems(stacks, base | {f"model.layers.0.{path}": own}, llama)
        assert [p.module for p in problems] == [f"model.layers.0.{path}"], problems
    # nor a parent of the layer's modules holding tensors of its own (KV-cache scales of the attention block)
    stacks = decoder_layers(
        keys({0: [*ATTN, "self_attn", *NORMS, *(f"mlp.{p}" for p in GATE_UP_DOWN)]}), OTHER_STACKS, 1
    )
    held = {k: {"weight"} for k in keys({0: [*ATTN, *NORMS, *(f"mlp.{p}" for p in GATE_UP_DOWN)]})}
    held["model.layers.0.self_attn"] = {"k_scale", "v_scale"}
    assert architecture_problems(stacks, held, {"architectures": ["LlamaForCausalLM"]}) == []


def test_a_module_of_the_layer_holding_no_weight(tmp_path, fixtures_dir):
    """A module present with a tensor vLLM has no place for but no weight (layer 1's q_norm holding only a bias, in
    the two-layer Qwen3-MoE pack): it passed the presence test, and vLLM would serve the norm's initial ones. An
    expert of a bank holding no trellis is named the same way."""
    pack = without(fixtures_dir / MOE_PACK, tmp_path / "p", "model.layers.1.self_attn.q_norm.")
    add_tensor(
        pack, "model.layers.1.self_attn.q_norm.bias", torch.zeros(16), beside="model.layers.1.self_attn.q_proj.trellis"
    )
    error = expect_problem(
        pack,
        "model.layers.1.self_attn.q_norm.weight",
        "layer(s) 1: self_attn.q_norm holds bias but no weight (nor a trellis)",
        "re-download it",
    )
    assert [p.module for p in error.problems] == ["model.layers.1.self_attn.q_norm"]
    layer = [*ATTN, "self_attn.q_norm", "self_attn.k_norm", *NORMS, "mlp.gate", *experts("mlp", 2)]
    held = {k: {"weight"} for k in keys({0: layer})}
    held["model.layers.0.mlp.experts.1.up_proj"] = {"input_scale"}
    moe = {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 2}
    problems = architecture_problems(decoder_layers(held, OTHER_STACKS, 1), held, moe)
    assert [(p.tensor, p.what.split(": ")[1]) for p in problems] == [
        (
            "model.layers.0.mlp.experts.1.up_proj.weight",
            "mlp.experts.1.up_proj holds input_scale but no weight (nor a trellis)",
        )
    ]


def test_a_bias_on_a_norm_a_router_or_an_expert(tmp_path, fixtures_dir):
    """vLLM's loaders drop any bias its layer has no parameter for (AutoWeightsLoader ignores unexpected ``.bias``),
    and none of the known classes has one on a norm, a router or an expert: each is named, the expert's at the expert
    that holds it (one problem for the bank)."""
    pack = without(fixtures_dir / MOE_PACK, tmp_path / "p", "no tensor has this prefix")
    info = Pack(pack)
    experts_out = info.modules["model.layers.1.mlp.experts.3.gate_proj"].padded_shape[1]
    routes = info.modules["model.layers.0.mlp.gate"].tensors["weight"].shape[0]
    add_tensor(pack, "model.layers.0.mlp.gate.bias", torch.zeros(routes), beside="model.layers.0.mlp.gate.weight")
    for e in (3, 5):
        name = f"model.layers.1.mlp.experts.{e}.gate_proj"
        add_tensor(pack, f"{name}.bias", torch.zeros(experts_out, dtype=torch.float16), beside=f"{name}.trellis")
    add_tensor(
        pack, "model.layers.1.input_layernorm.bias", torch.zeros(64), beside="model.layers.1.input_layernorm.weight"
    )
    error = expect_problem(
        pack,
        "layer(s) 0: mlp.gate holds a bias, and vLLM's Qwen3MoeForCausalLM has none there whatever config.json says",
        "layer(s) 1: mlp.experts holds a bias",
        "layer(s) 1: input_layernorm holds a bias",
        "vLLM cannot serve this pack as it is",
    )
    assert sorted(p.tensor for p in error.problems) == [
        "model.layers.0.mlp.gate.bias",
        "model.layers.1.input_layernorm.bias",
        "model.layers.1.mlp.experts.3.gate_proj.bias",
    ]


def test_only_the_first_class_of_architectures_is_read(tmp_path, fixtures_dir):
    """vLLM builds the first class of ``architectures`` it has: the Llama pack named first as a class the project
    states no layer for (vLLM may build that one) is not held against Qwen3's layer named second; named first,
    Qwen3's layer is the one vLLM builds, and the q_norm / k_norm it lacks are named."""
    pack = with_config(fixtures_dir / PACK, tmp_path / "a", architectures=["SomeOtherForCausalLM", "Qwen3ForCausalLM"])
    Pack.open(pack)
    pack = with_config(fixtures_dir / PACK, tmp_path / "b", architectures=["LlamaForCausalLM", "Qwen3ForCausalLM"])
    Pack.open(pack)
    pack = with_config(fixtures_dir / PACK, tmp_path / "c", architectures=["Qwen3ForCausalLM", "LlamaForCausalLM"])
    expect_problem(pack, "no decoder layer holds self_attn.q_norm, which every layer of vLLM's Qwen3ForCausalLM has")


def dense_held(layers: dict[int, list[str]], config: dict) -> dict[str, set[str]]:
    """The tensors of ``layers``' modules stored dense: a weight each, and a bias on q / k / v where the class is a
    Qwen2 one (vLLM's Qwen2 layers always have those)."""
    qwen2 = "Qwen2" in config["architectures"][0]
    return {
        k: {"weight", "bias"} if qwen2 and k.endswith(("q_proj", "k_proj", "v_proj")) else {"weight"}
        for k in keys(layers)
    }


def test_the_layers_of_mistral_qwen2_moe_and_gemma():
    """Mistral (Llama's layer), Qwen2-MoE (a dense layer among sparse ones, its shared expert's gate built even
    without a shared expert) and Gemma 2 / 3 (pre- and post-feedforward norms; Gemma 3's q_norm / k_norm) as vLLM
    builds them are sound; each loses a module visibly from one of two layers; a Mistral config with a
    time-conditioned norm is not stated (no problem whatever its layers hold)."""
    dense = [f"mlp.{p}" for p in GATE_UP_DOWN]
    shared = [f"mlp.shared_expert.{p}" for p in GATE_UP_DOWN]
    gemma = [*ATTN, *dense, *NORMS, "pre_feedforward_layernorm", "post_feedforward_layernorm"]
    q2moe = {"architectures": ["Qwen2MoeForCausalLM"], "num_experts": 4, "shared_expert_intermediate_size": 32}
    cases = [
        ({"architectures": ["MistralForCausalLM"]}, [*ATTN, *NORMS, *dense], "mlp.up_proj"),
        ({**q2moe, "decoder_sparse_step": 2}, [*ATTN, *NORMS, "mlp.gate", "mlp.shared_expert_gate", *shared], None),
        (
            q2moe,
            [*ATTN, *NORMS, "mlp.gate", "mlp.shared_expert_gate", *shared, *experts("mlp", 4)],
            "mlp.shared_expert_gate",
        ),
        (
            {**q2moe, "shared_expert_intermediate_size": 0},
            [*ATTN, *NORMS, "mlp.gate", "mlp.shared_expert_gate", *experts("mlp", 2)],
            "mlp.gate",
        ),
        ({"architectures": ["Gemma2ForCausalLM"]}, gemma, "pre_feedforward_layernorm"),
        (
            {"architectures": ["Gemma3ForCausalLM"]},
            [*gemma, "self_attn.q_norm", "self_attn.k_norm"],
            "self_attn.k_norm",
        ),
    ]
    for config, layer, lost in cases:
        if lost is None:  # the sparse step of 2: layer 0 dense, layer 1 sparse
            layers = {0: [*ATTN, *NORMS, *dense], 1: [*layer, *experts("mlp", 4)]}
        else:
            layers = {0: layer, 1: layer}
        held = dense_held(layers, config)
        stacks = decoder_layers(held, OTHER_STACKS, 2)
        assert architecture_problems(stacks, held, config) == [], config
        if lost is None:
            continue
        short = {k: v for k, v in held.items() if k != f"model.layers.1.{lost}"}
        problems = architecture_problems(decoder_layers(short, OTHER_STACKS, 2), short, config)
        assert [p.module for p in problems] == [f"model.layers.1.{lost}"], (config, problems)
        assert f"which every layer of vLLM's {config['architectures'][0]} has" in problems[0].what
    # Gemma 2 has no q_norm, Gemma 3 one in every layer: Gemma 3's tensors under Gemma 2 are of another class
    layers = {i: [*gemma, "self_attn.q_norm", "self_attn.k_norm"] for i in range(2)}
    held = {k: {"weight"} for k in keys(layers)}
    problems = architecture_problems(
        decoder_layers(held, OTHER_STACKS, 2), held, {"architectures": ["Gemma2ForCausalLM"]}
    )
    assert {p.module for p in problems} == {"model.layers.0.self_attn.q_norm", "model.layers.0.self_attn.k_norm"}
    assert "which vLLM's Gemma2ForCausalLM has no place for" in problems[0].what
    ada = {"architectures": ["MistralForCausalLM"], "ada_rms_norm_t_cond": True}
    assert architecture_problems(decoder_layers(held, OTHER_STACKS, 2), held, ada) == []


NEXT_PACK = "qwen3next-tiny-exl3-4.0bpw-mul1"


def test_the_qwen3_next_layers(tmp_path, fixtures_dir):
    """The bundled two-layer Qwen3-Next pack (a Gated DeltaNet layer, then an attention layer): sound; without the
    DeltaNet's A_log (a tensor the block holds itself, which vLLM loads into a parameter of its own) or the attention
    layer's q_norm, named - too few layers for the layout rules; with its layer kinds swapped in config.json, each
    layer's block is one vLLM's layer has no place for; without layer_types, and with layer_types vLLM cannot build
    from."""
    Pack.open(fixtures_dir / NEXT_PACK)
    pack = without(fixtures_dir / NEXT_PACK, tmp_path / "a", "model.layers.0.linear_attn.A_log")
    error = expect_problem(
        pack,
        "model.layers.0.linear_attn.A_log",
        "layer(s) 0: linear_attn holds no A_log, which vLLM's Qwen3NextForCausalLM loads into a parameter of its own",
    )
    assert [p.module for p in error.problems] == ["model.layers.0.linear_attn"]
    pack = without(fixtures_dir / NEXT_PACK, tmp_path / "q", "model.layers.1.self_attn.q_norm.")
    expect_problem(pack, "layer 1 holds no self_attn.q_norm, which every layer of vLLM's Qwen3NextForCausalLM has")
    swapped = with_config(fixtures_dir / NEXT_PACK, tmp_path / "s", layer_types=["full_attention", "linear_attention"])
    error = expect_problem(
        swapped, "layer(s) 0 hold linear_attn, which vLLM's Qwen3NextForCausalLM layer has no module"
    )
    assert {p.module for p in error.problems} >= {"model.layers.0.linear_attn", "model.layers.1.self_attn"}
    # without layer_types, vLLM up to 0.31 makes every fourth layer full attention and 0.32 takes
    # full_attention_interval: an interval of 4 is read alike (the pack's layer 1 is no attention layer then), another
    # one is not stated
    pack = with_config(fixtures_dir / NEXT_PACK, tmp_path / "i", layer_types=None, full_attention_interval=4)
    expect_problem(pack, "layer(s) 1 hold self_attn, which vLLM's Qwen3NextForCausalLM layer has no module")
    for interval in (2, 1, True):
        pack = with_config(
            fixtures_dir / NEXT_PACK, tmp_path / f"i{interval}", layer_types=None, full_attention_interval=interval
        )
        Pack.open(pack)
    # a kind vLLM cannot build, or no list at all: the layer is not stated (vLLM stops on it by itself)
    stacks = decoder_layers(Pack(fixtures_dir / NEXT_PACK).modules, OTHER_STACKS, 2)
    held = {k: set(m.tensors) for k, m in Pack(fixtures_dir / NEXT_PACK).modules.items()}
    for types in (["mamba", "full_attention"], "full_attention", ["linear_attention"]):
        config = {"architectures": ["Qwen3NextForCausalLM"], "num_experts": 8, "layer_types": types}
        assert [p.module for p in architecture_problems(stacks, held, config)] == [], types


def test_qwen_moe_settings_the_config_classes_default(tmp_path, fixtures_dir):
    """config.json leaving a Qwen MoE setting to the config class: mlp_only_layers null (read as none) and no expert
    count (the class's default; nothing to plan from, nothing wrong) are accepted; Qwen3-Next without an MoE layer
    (vLLM raises "No Qwen3Next layer found") is named; a bias on the Gated DeltaNet's conv1d is named once, at
    conv1d."""
    for changes in ({"mlp_only_layers": None}, {"num_experts": None}):
        Pack.open(with_config(fixtures_dir / MOE_PACK, tmp_path / f"moe{len(list(tmp_path.iterdir()))}", **changes))
        Pack.open(with_config(fixtures_dir / NEXT_PACK, tmp_path / f"next{len(list(tmp_path.iterdir()))}", **changes))
    pack = with_config(fixtures_dir / NEXT_PACK, tmp_path / "dense", mlp_only_layers=[0, 1])
    expect_problem(pack, "no layer is an MoE layer", "vLLM's Qwen3NextForCausalLM stops in the worker without one")
    stacks = decoder_layers(Pack(fixtures_dir / NEXT_PACK).modules, OTHER_STACKS, 2)
    held = {k: set(m.tensors) for k, m in Pack(fixtures_dir / NEXT_PACK).modules.items()}
    held["model.layers.0.linear_attn.conv1d"] = {"weight", "bias"}
    config = json.loads((fixtures_dir / NEXT_PACK / "config.json").read_text())
    problems = architecture_problems(stacks, held, config)
    assert [(p.tensor, p.what.split(" holds")[0]) for p in problems] == [
        ("model.layers.0.linear_attn.conv1d.bias", "layer(s) 0: linear_attn.conv1d")
    ]


def random_trellis(pack, module):
    """Tensors of a random 4-bit mul1 EXL3 layer with as many outputs as dense module ``module`` of pack ``pack``
    (a norm's or a convolution's weight read as ``(out, rest)``)."""
    shape = Pack(pack).modules[module].tensors["weight"].shape
    out_features, in_features = shape[0], max(1, math.prod(shape[1:]))
    return random_exl3_layer(in_features, out_features, 4, "mul1", generator=torch.Generator().manual_seed(0))


def test_a_module_vllm_builds_dense_stored_quantized():
    """vLLM builds the routers of Mixtral, Qwen2-MoE and Qwen3-Next, every shared expert's gate and every norm
    without the quantization config (they load a dense weight only; on a trellis its loader stops in the worker,
    "There is no module or parameter named ...mlp.gate.mul1", as vLLM 0.32 did with the Qwen3-Next pack): stored
    quantized, each is named in the layers that hold it, with the fix; Qwen3-MoE's router, which vLLM builds with the
    quantization config, is not."""
    q2moe = {"architectures": ["Qwen2MoeForCausalLM"], "num_experts": 2, "shared_expert_intermediate_size": 32}
    q3moe = {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 2, "shared_expert_intermediate_size": 32}
    shared = [f"mlp.shared_expert.{p}" for p in GATE_UP_DOWN]
    qk = ["self_attn.q_norm", "self_attn.k_norm"]
    cases = [
        (
            {"architectures": ["MixtralForCausalLM"], "num_local_experts": 2},
            [*ATTN, *NORMS, "block_sparse_moe.gate", *experts("block_sparse_moe", 2, ("w1", "w2", "w3"))],
            {"block_sparse_moe.gate"},
        ),
        (
            q2moe,
            [*ATTN, *NORMS, "mlp.gate", "mlp.shared_expert_gate", *shared, *experts("mlp", 2)],
            {"mlp.gate", "mlp.shared_expert_gate"},
        ),
        (
            q3moe,
            [*ATTN, *qk, *NORMS, "mlp.gate", "mlp.shared_expert_gate", *shared, *experts("mlp", 2)],
            {"mlp.shared_expert_gate"},
        ),
        ({"architectures": ["LlamaForCausalLM"]}, [*ATTN, *NORMS, *(f"mlp.{p}" for p in GATE_UP_DOWN)], set()),
    ]
    trellis = {"trellis", "suh", "svh", "mul1"}
    for config, layer, dense in cases:
        layers = {0: layer, 1: layer}
        held = dense_held(layers, config)
        stacks = decoder_layers(held, OTHER_STACKS, 2)
        assert architecture_problems(stacks, held, config) == [], config
        # every module of layer 1 but its experts' stored as a trellis (biases kept): only the dense ones are named
        coded = {
            k: trellis | (v - {"weight"}) if ".experts." not in k and k.startswith("model.layers.1.") else v
            for k, v in held.items()
        }
        problems = architecture_problems(stacks, coded, config)
        named = {p.module.removeprefix("model.layers.1.") for p in problems}
        assert named == {p for p in layer if p in dense or "norm" in p}, (config, problems)
        for p in problems:
            assert p.tensor == f"{p.module}.trellis" and p.fix == FIX_DENSE
            assert "builds it without the quantization config" in p.what and "layer(s) 1:" in p.what


def test_a_trellis_router_in_the_bundled_packs(tmp_path, fixtures_dir):
    """The bundled packs with one router, shared expert gate, convolution or norm stored as a random EXL3 trellis:
    Qwen3-MoE's router is accepted (vLLM builds it with the quantization config; the vLLM tests serve it), the
    others are named with the fix, in the user's process; so is a norm stored quantized in a model of a class whose
    layer the project does not state (the final norm, a layer's norm as int8 rows)."""
    moe = fixtures_dir / MOE_PACK
    Pack.open(
        replace_module(moe, tmp_path / "moe", "model.layers.0.mlp.gate", random_trellis(moe, "model.layers.0.mlp.gate"))
    )
    for module in (
        "model.layers.0.mlp.gate",
        "model.layers.1.mlp.shared_expert_gate",
        "model.layers.0.linear_attn.conv1d",
    ):
        pack = replace_module(
            fixtures_dir / NEXT_PACK, tmp_path / module, module, random_trellis(fixtures_dir / NEXT_PACK, module)
        )
        error = expect_problem(
            pack,
            f"{module}.trellis",
            f"{module.split('.', 3)[3]} is stored quantized (trellis), but vLLM's Qwen3NextForCausalLM builds it "
            "without the quantization config",
            FIX_DENSE,
        )
        assert [p.module for p in error.problems] == [module]
    other = with_config(moe, tmp_path / "other", architectures=["SomeOtherMoeForCausalLM"])
    pack = replace_module(other, tmp_path / "norm", "model.norm", random_trellis(moe, "model.norm"))
    rows = {"qweight": torch.ones(256, dtype=torch.int8), "scales": torch.ones(256, dtype=torch.float16)}
    pack = replace_module(pack, tmp_path / "norms", "model.layers.1.post_attention_layernorm", rows)
    error = expect_problem(pack, "a norm stored as an EXL3 trellis", "a norm stored as int8 rows", FIX_DENSE)
    assert sorted(p.tensor for p in error.problems if p.fix == FIX_DENSE) == [
        "model.layers.1.post_attention_layernorm.qweight",
        "model.norm.trellis",
    ]


def test_a_token_embedding_stored_coded(tmp_path, fixtures_dir):
    """A token embedding stored as an EXL3 trellis or escha code (vLLM's embedding takes a dense table or int8 rows;
    its loader stopped in the worker on ``embed_tokens.mul1`` with vLLM 0.32) is named, with the way to a smaller
    table (``quantpack embed-int8``); the head stored as a trellis is not (the plugin serves it)."""
    src = fixtures_dir / PACK
    trellis = random_trellis(src, "model.embed_tokens")
    error = expect_problem(
        replace_module(src, tmp_path / "exl3", "model.embed_tokens", trellis),
        "model.embed_tokens.trellis: the token embedding stored as an EXL3 trellis",
        "quantpack embed-int8",
    )
    assert [p.module for p in error.problems] == ["model.embed_tokens"]
    escha = {"escha_code": trellis["trellis"], "escha_rin": trellis["suh"], "escha_rout": trellis["svh"]}
    error = expect_problem(
        replace_module(src, tmp_path / "escha", "model.embed_tokens", escha),
        "model.embed_tokens.escha_code: the token embedding stored as escha code",
        require_exl3=False,
    )
    assert "lm_head" in Pack(src).modules and Pack(src).modules["lm_head"].format == "exl3"


def test_int8_rows_inside_a_layer(tmp_path, fixtures_dir):
    """int8 rows at a module of a decoder layer (a projection, a router) are named: the plugins serve them through
    their embedding method only, which vLLM builds for token embeddings and heads; an o_proj so stored stopped vLLM's
    loader in the worker ("There is no module or parameter named ...o_proj.qweight", vLLM 0.32), a q_proj the
    plugin's fused-layer check there. The head as int8 rows stays accepted."""
    src = fixtures_dir / PACK
    out_features, in_features = Pack(src).modules["model.layers.0.self_attn.o_proj"].padded_shape[::-1]
    rows = {"qweight": torch.ones(out_features, in_features, dtype=torch.int8), "scales": torch.ones(out_features)}
    pack = replace_module(src, tmp_path / "o", "model.layers.0.self_attn.o_proj", rows)
    error = expect_problem(
        pack, "model.layers.0.self_attn.o_proj.qweight: stored as int8 rows", "for token embeddings and heads only"
    )
    assert [p.module for p in error.problems] == ["model.layers.0.self_attn.o_proj"]
    moe = fixtures_dir / MOE_PACK
    routes, hidden = Pack(moe).modules["model.layers.1.mlp.gate"].tensors["weight"].shape
    rows = {"weight_int8": torch.ones(routes, hidden, dtype=torch.int8), "weight_scale": torch.ones(routes)}
    error = expect_problem(
        replace_module(moe, tmp_path / "router", "model.layers.1.mlp.gate", rows),
        "model.layers.1.mlp.gate.weight_int8: stored as int8 rows",
    )
    head = Pack(src).modules["lm_head"].padded_shape
    rows = {"qweight": torch.ones(head[1], head[0], dtype=torch.int8), "scales": torch.ones(head[1])}
    Pack.open(replace_module(src, tmp_path / "head", "lm_head", rows))


def test_fused_modules_of_different_kinds(tmp_path, fixtures_dir):
    """A dense q_proj beside EXL3 k_proj / v_proj (vLLM fuses them into qkv_proj, which is all one kind): named by
    the pack check, as the plugin's config refuses it from the manifest when vLLM builds its config; a dense o_proj
    (a layer of its own) is accepted, as the plugins serve dense shards."""
    src = fixtures_dir / PACK
    i, o = Pack(src).modules["model.layers.0.self_attn.q_proj"].padded_shape
    pack = replace_module(
        src, tmp_path / "q", "model.layers.0.self_attn.q_proj", {"weight": torch.zeros(o, i, dtype=torch.float16)}
    )
    error = expect_problem(
        pack,
        "model.layers.0.self_attn.q_proj.weight: stored as dense while its fused siblings are not (k_proj exl3, "
        "q_proj dense, v_proj exl3)",
    )
    assert [p.module for p in error.problems] == ["model.layers.0.self_attn.q_proj"]
    i, o = Pack(src).modules["model.layers.0.self_attn.o_proj"].padded_shape
    Pack.open(
        replace_module(
            src, tmp_path / "o", "model.layers.0.self_attn.o_proj", {"weight": torch.zeros(o, i, dtype=torch.float16)}
        )
    )


def escha_tensors(in_features, out_features):
    """An escha-coded module's tensors (a random mcg trellis as its code, unit scales)."""
    layer = random_exl3_layer(in_features, out_features, 4, "mcg", generator=torch.Generator().manual_seed(0))
    ones_in, ones_out = torch.ones_like(layer["suh"]), torch.ones_like(layer["svh"])
    return {"escha_code": layer["trellis"], "escha_rin": layer["suh"], "escha_rout": layer["svh"],
            "escha_s_in": ones_in, "escha_s_out": ones_out}  # fmt: skip


@pytest.mark.parametrize(
    ("module", "tensors", "needle"),
    [
        (
            "lm_head",
            lambda: {"weight": torch.zeros(1000, 256, dtype=torch.float16)},
            "lm_head.weight: has 1000 outputs",
        ),
        ("lm_head", lambda: {"weight": torch.zeros(1024, 200, dtype=torch.float16)}, "lm_head.weight: has 200 inputs"),
        (
            "lm_head",
            lambda: random_exl3_layer(122, 37, 4, "mul1", generator=torch.Generator().manual_seed(0)),
            "lm_head.trellis: has 128 inputs, but config.json gives hidden_size 256",
        ),
        ("model.norm", lambda: {"weight": torch.ones(255, dtype=torch.float16)}, "weight is [255], but config.json"),
        (
            "model.layers.2.input_layernorm",
            lambda: {"weight": torch.ones(16, 16, dtype=torch.float16)},
            "input_layernorm.weight: weight is [16, 16], but config.json gives hidden_size 256",
        ),
        (
            "model.layers.0.self_attn.o_proj",
            lambda: escha_tensors(256, 256),
            "o_proj.escha_code: an escha-coded module in an EXL3 pack",
        ),
    ],
)
def test_a_head_a_norm_or_a_format_vllm_cannot_load(tmp_path, fixtures_dir, module, tensors, needle):
    """The head against vocab_size and hidden_size, the final and the layers' norms against hidden_size, an escha
    module in an EXL3 pack: each stopped vLLM 0.32's load in the worker (its head and norm loaders assert the
    sizes; the exl3 plugin has no parameter for escha_code) and is named by the check now."""
    error = expect_problem(replace_module(fixtures_dir / PACK, tmp_path / "p", module, tensors()), needle)
    assert module in {p.module for p in error.problems}


def resized(pack, module, change):
    """Tensors of ``module`` of ``pack`` resized: ``"in+128"`` / ``"out+128"`` (a random EXL3 layer of the module's
    K, codebook and padded size, one block wider on that side) or ``"rows-1"`` / ``"cols-1"`` (a dense weight one
    row or column short)."""
    info = Pack(pack)
    m = info.modules[module]
    if m.format == "dense":
        w = info.get_tensor(f"{module}.weight")
        return {"weight": w[:-1].clone() if change == "rows-1" else w[..., :-1].clone()}
    i, o = m.padded_shape
    i, o = (i + 128, o) if change == "in+128" else (i, o + 128)
    codebook = "mul1" if "mul1" in m.tensors else "mcg" if "mcg" in m.tensors else "3inst"
    return random_exl3_layer(i, o, m.k_bits, codebook, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    ("pack", "module", "change", "needle"),
    [
        (
            PACK,
            "model.layers.1.self_attn.q_proj",
            "in+128",
            "has 384 inputs, but config.json gives 256 for vLLM's LlamaForCausalLM",
        ),
        (PACK, "model.layers.2.mlp.down_proj", "out+128", "has 384 outputs, but config.json gives 256 for vLLM's"),
        (
            MOE_PACK,
            "model.layers.0.mlp.experts.3.down_proj",
            "in+128",
            "has 384 inputs, but config.json gives 256 for vLLM's Qwen3MoeForCausalLM",
        ),
        (MOE_PACK, "model.layers.1.mlp.gate", "cols-1", "has 255 inputs"),
        (MOE_PACK, "model.layers.1.mlp.gate", "rows-1", "has 7 outputs"),
        (MOE_PACK, "model.layers.0.self_attn.q_norm", "rows-1", "weight is [63], but vLLM's Qwen3MoeForCausalLM"),
        (NEXT_PACK, "model.layers.0.linear_attn.in_proj_qkvz", "out+128", "outputs"),
        (NEXT_PACK, "model.layers.0.linear_attn.in_proj_ba", "rows-1", "outputs"),
        (NEXT_PACK, "model.layers.0.linear_attn.conv1d", "cols-1", "builds linear_attn.conv1d as "),
        (NEXT_PACK, "model.layers.1.self_attn.q_proj", "out+128", "outputs"),
    ],
)
def test_sizes_vllm_builds_the_layer_with(tmp_path, fixtures_dir, pack, module, change, needle):
    """For the classes whose layer the check states, each module against the sizes vLLM builds it with
    (quantpack_core.check.architectures.layer_sizes: the hidden side of every projection, router and expert, the
    experts' intermediate side, Qwen3-Next's gated q_proj and Gated DeltaNet, q_norm per head): one block or one row
    off, the bundled packs are named (vLLM's loaders, or the plugin's geometry check, stopped on each in the worker)."""
    src = fixtures_dir / pack
    error = expect_problem(replace_module(src, tmp_path / "p", module, resized(src, module, change)), needle)
    assert module in {p.module for p in error.problems}


@pytest.mark.parametrize(("tensor", "cut"), [("A_log", slice(1, None)), ("dt_bias", None)])
def test_the_gated_deltanets_own_parameters_one_per_value_head(tmp_path, fixtures_dir, tensor, cut):
    """The Gated DeltaNet's A_log and dt_bias hold one value per value head (linear_num_value_heads); one value short
    or one too many stopped vLLM 0.32's loader in the worker (its parameter is built that long); the pack check
    names the tensor and the size vLLM builds."""
    src = fixtures_dir / NEXT_PACK
    key = "model.layers.0.linear_attn"
    tensors = load_file(src / "model.safetensors")
    own = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == key}
    heads = Pack(src).config["linear_num_value_heads"]
    assert own[tensor].shape == (heads,)
    own[tensor] = own[tensor][cut] if cut else torch.cat([own[tensor], own[tensor][:1]])
    error = expect_problem(
        replace_module(src, tmp_path / "p", key, own),
        f"{key}.{tensor}",
        f"is [{own[tensor].shape[0]}], but vLLM's Qwen3NextForCausalLM builds linear_attn.{tensor} as {heads}",
    )
    assert key in {p.module for p in error.problems}


def test_what_a_hostile_user_found(tmp_path, fixtures_dir):
    """Packs the check accepted (or crashed on) and vLLM 0.32 then failed on, or served NaN with: each is named now,
    and the check itself raises nothing but PackError. A float8 norm (the finite check crashed: isfinite takes no
    float8) is read as float32; a weight_map entry that is no file name (a TypeError) is named; a stray module
    outside the layers of a stated class (vLLM: "There is no module or parameter named 'foo'"); norm epsilons and
    RoPE bases vLLM serves NaN with; more experts per token than experts (vLLM's router stopped at the first request),
    or none (SIGFPE); NaN in the Gated DeltaNet's A_log."""
    src = fixtures_dir / PACK
    norm = load_file(src / "model.safetensors")["model.norm.weight"]
    Pack.open(replace_module(src, tmp_path / "f8", "model.norm", {"weight": norm.to(torch.float8_e4m3fn)}))
    sharded = tmp_path / "index"
    shutil.copytree(src, sharded)
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00001.safetensors")
    weight_map = dict.fromkeys(
        load_file(sharded / "model-00001-of-00001.safetensors"), "model-00001-of-00001.safetensors"
    )
    weight_map["model.norm.weight"] = 7
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    expect_problem(sharded, "weight_map gives model.norm.weight the file 7, not a file name")
    stray = tmp_path / "stray"
    shutil.copytree(src, stray)
    add_tensor(stray, "model.foo.weight", torch.ones(256, dtype=torch.bfloat16))
    expect_problem(stray, "vLLM's LlamaForCausalLM has no module model.foo")
    for change, needle in (
        ({"rms_norm_eps": -1.0}, "rms_norm_eps is -1.0, not a number between 0 and 1"),
        ({"rms_norm_eps": 1e30}, "rms_norm_eps is 1e+30"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, "rope_parameters.rope_theta is 0"),
    ):
        expect_problem(with_config(src, tmp_path / f"c{len(list(tmp_path.iterdir()))}", **change), needle)
    for topk, needle in ((9, "num_experts_per_tok is 9, but a token can pick 1 to 8"), (0, "num_experts_per_tok is 0")):
        expect_problem(with_config(fixtures_dir / MOE_PACK, tmp_path / f"k{topk}", num_experts_per_tok=topk), needle)
    a_log = load_file(fixtures_dir / NEXT_PACK / "model.safetensors")["model.layers.0.linear_attn.A_log"]
    nan = replace_module(
        fixtures_dir / NEXT_PACK, tmp_path / "alog", "model.layers.0.linear_attn",
        {"A_log": torch.full_like(a_log, float("nan")),
         "dt_bias": load_file(fixtures_dir / NEXT_PACK / "model.safetensors")["model.layers.0.linear_attn.dt_bias"]},
    )  # fmt: skip
    expect_problem(nan, "model.layers.0.linear_attn.A_log", "values are NaN or infinite")


@pytest.mark.parametrize(
    ("pack", "change", "needle"),
    [
        (
            PACK,
            {"hidden_act": "gelu"},
            "hidden_act is 'gelu', but vLLM's LlamaForCausalLM builds its MLP with silu only",
        ),
        (PACK, {"hidden_act": "SiLU"}, "hidden_act is 'SiLU'"),  # vLLM's Llama compares the name as written
        (MOE_PACK, {"hidden_act": None}, None),  # absent: transformers' default (silu)
        (
            PACK,
            {"rope_parameters": {"rope_type": "bogus", "rope_theta": 10000.0}},
            "rope_parameters.rope_type is 'bogus': vLLM builds no such RoPE",
        ),
        (PACK, {"rope_scaling": {"type": "yarn", "factor": 2.0}}, None),  # a legacy field of a known type
        (PACK, {"rope_scaling": {"type": "Yarn", "factor": 2.0}}, "rope_scaling.type is 'Yarn'"),
        (PACK, {"rope_parameters": {"rope_type": "default", "rope_theta": "10000"}}, "rope_theta is '10000', not a"),
        (PACK, {"rope_theta": "1e4"}, "rope_theta is '1e4', not a number"),
        (PACK, {"partial_rotary_factor": 0}, "partial_rotary_factor is 0, not a number in (0, 1]"),
        (PACK, {"partial_rotary_factor": "0.5"}, "partial_rotary_factor is '0.5', not a number in (0, 1]"),
        (PACK, {"partial_rotary_factor": 0.5}, None),  # 32 of 64 features
        # Step-3.5 gives one RoPE base per layer; TeleChat3's yarn variant is a type vLLM builds (0.29) or renames
        (PACK, {"rope_theta": [5e6, 1e4, 1e4, 5e6]}, None),
        (PACK, {"rope_scaling": {"type": "telechat3-yarn", "factor": 4.0}}, None),
        (PACK, {"rope_scaling": {"rope_type": None, "factor": 2.0}}, "rope_scaling.rope_type is None"),
        (PACK, {"rope_scaling": {"rope_type": ["linear"]}}, "rope_scaling.rope_type is ['linear']"),
        (PACK, {"rope_parameters": {"full": {"rope_type": "foo"}, "sliding": None}}, "rope_parameters.full.rope_type"),
        # a base past a float64: an OverflowError in vLLM's rotary embedding (was taken as a number here)
        (PACK, {"rope_theta": 10**400}, "rope_theta is 1000000000000000000000000000000000000000, above 1e+12"),
        (PACK, {"partial_rotary_factor": 10**400}, "partial_rotary_factor is 1000"),
        (PACK, {"partial_rotary_factor": 0.5, "head_dim": 10**400}, "head_dim"),  # refused by the size checks
        (
            NEXT_PACK,
            {"layer_types": None, "full_attention_interval": 2, "hidden_act": "gelu"},
            "hidden_act is 'gelu', but vLLM's Qwen3NextForCausalLM",
        ),
        (
            NEXT_PACK,
            {"partial_rotary_factor": 0.3, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.3}},
            "partial_rotary_factor is 0.3: it rotates 19 of a head's 64 features, and vLLM's Qwen3NextForCausalLM",
        ),
    ],
)
def test_settings_vllm_stops_on_in_the_worker(tmp_path, fixtures_dir, pack, change, needle):
    """config.json settings vLLM 0.32 took in the user's process and stopped on in the worker (or, on CPU, crashed
    the process with): an activation the class's MLP is not built with, a RoPE type get_rope does not know, a RoPE
    base or rotated fraction that is no number, a fraction outside (0, 1] or rotating an odd number of a head's
    features (Qwen3-Next at 0.3 of 64: 19; a segfault on CPU). Each is named once at config time; the settings vLLM
    takes pass."""
    dst = with_config(fixtures_dir / pack, tmp_path / "p", **change)
    if needle is None:
        Pack.open(dst)
        return
    error = expect_problem(dst, needle)
    assert sum(needle.split(":")[0] in str(p) for p in error.problems) == 1 or needle == "head_dim", error.problems


def with_raw_config(src, dst, **changes):
    """A copy of pack ``src`` whose config.json has ``changes`` (a value of None is written as null)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **changes}))
    return dst


SLIDING = ["sliding_attention", "full_attention", "full_attention", "full_attention"]


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"logit_scale": 0.1}, "logit_scale is 0.1: vLLM multiplies every logit by it"),
        ({"sliding_window": 4}, "sliding_window is 4: vLLM limits every layer's attention to that many tokens"),
        ({"layer_types": SLIDING}, "layer_types is ['sliding_attention'"),
        ({"logit_scale": 1.0, "sliding_window": None, "layer_types": ["full_attention"] * 4}, None),
        ({"logit_scale": 1}, None),
    ],
)
def test_settings_the_reference_ignores(tmp_path, fixtures_dir, change, needle):
    """config.json settings vLLM's LlamaForCausalLM reads and transformers' Llama (``quantpack verify``'s reference)
    has none of: logit_scale 0.1 passed inspect, the load-time check and verify (KL 5.5e-6) while vLLM served KL
    3.96; sliding_window 4 KL 0.86. Each is named with what vLLM does and the fix; their neutral values pass."""
    dst = with_raw_config(fixtures_dir / PACK, tmp_path / "p", **change)
    if needle is None:
        Pack.open(dst)
        return
    error = expect_problem(dst, needle, "while transformers' LlamaForCausalLM (the reference quantpack verify")
    key = next(iter(change))
    assert f"remove {key} from it" in str(error)
    assert len(error.problems) == 1, error.problems


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"logit_scale": "x"}, "logit_scale is 'x', not a finite number > 0"),
        ({"logit_scale": 0}, "logit_scale is 0, not a finite number > 0"),
        ({"logit_scale": 10**400}, "logit_scale is 1000000000"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 10**30}}, "rope_parameters.rope_theta is 1000"),
        ({"rope_theta": 10**30}, "rope_theta is 1000000000000000000000000000000, above 1e+12"),
        ({"rope_theta": 2e12}, "rope_theta is 2000000000000.0, above 1e+12"),
        ({"max_position_embeddings": 10**30}, "max_position_embeddings is 1000000000000000000000000000000, not an"),
        ({"max_position_embeddings": 1.5}, "max_position_embeddings is 1.5, not an integer in 1 .. 134,217,728"),
        ({"max_position_embeddings": "x"}, "max_position_embeddings is 'x'"),
        ({"sliding_window": 10**30}, "sliding_window is 1000000000000000000000000000000, neither null nor"),
        ({"hidden_size": None}, "hidden_size is null: vLLM's config parser refuses the model"),
        ({"vocab_size": None}, "vocab_size is null"),
        ({"num_hidden_layers": None}, "num_hidden_layers is null"),
        ({"hidden_act": None}, "hidden_act is null"),
        ({"rms_norm_eps": "x"}, "rms_norm_eps is 'x', not a number between 0 and 1"),
        ({"rms_norm_eps": True}, "rms_norm_eps is True, not a number between 0 and 1"),
        ({"rms_norm_eps": []}, "rms_norm_eps is [], not a number between 0 and 1"),
        ({"max_position_embeddings": 2**27, "rope_theta": 1e12}, None),
    ],
)
def test_settings_that_stop_vllm_at_start(tmp_path, fixtures_dir, change, needle):
    """config.json settings the check took and vLLM then crashed on: a RoPE base of 30 digits (an OverflowError in
    its rotary embedding), positions and windows past what it builds or holds, a logit scale that is no number, null
    sizes and epsilons that are no number (its config parser refuses them). Each is named, once."""
    dst = with_raw_config(fixtures_dir / PACK, tmp_path / "p", **change)
    if needle is None:
        Pack.open(dst)
        return
    error = expect_problem(dst, needle)
    assert sum(needle.split(",")[0] in str(p) for p in error.problems) == 1, error.problems


@pytest.mark.parametrize("module", ["model.layers.0.input_layernorm", "model.embed_tokens", "model.norm"])
def test_a_dense_weight_stored_as_integers(tmp_path, fixtures_dir, module):
    """A dense weight stored as its float16 bits in uint16 (or as any integer type): vLLM's loader converts each
    integer as a number into its floating parameter and serves without an error, wrongly. The check names the
    tensor and its dtype; safetensors' unsigned types are read, no longer reported as a malformed header."""
    src = fixtures_dir / PACK
    weight = load_file(src / "model.safetensors")[f"{module}.weight"]
    dst = replace_module(src, tmp_path / "p", module, {"weight": weight.view(torch.uint16)})
    error = expect_problem(dst, f"{module}.weight: dtype uint16: a dense weight is a floating tensor")
    assert "malformed" not in str(error)


def test_a_dtype_safetensors_does_not_store_here(tmp_path, fixtures_dir):
    """A header dtype outside the ones the reader knows is named as such (not as a malformed entry)."""
    src = fixtures_dir / PACK
    dst = tmp_path / "p"
    shutil.copytree(src, dst)
    shard = dst / "model.safetensors"
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header["model.norm.weight"]["dtype"] = "F4"
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(text) == n
    shard.write_bytes(data[:8] + text + data[8 + n :])
    expect_problem(dst, "model.norm.weight: dtype 'F4' in model.safetensors's header: not one this check reads")


def test_a_json_integer_past_pythons_digit_limit(tmp_path, fixtures_dir):
    """A config.json integer of 5,000 digits: json.loads raises ValueError (Python's int digit limit), not a
    JSONDecodeError; the check names the file instead of crashing."""
    dst = tmp_path / "p"
    shutil.copytree(fixtures_dir / PACK, dst)
    text = (dst / "config.json").read_text()
    (dst / "config.json").write_text(text.replace('"vocab_size": 1024', '"vocab_size": 1' + "0" * 5000, 1))
    assert "0" * 5000 in (dst / "config.json").read_text()
    expect_problem(dst, "config.json: not valid JSON (ValueError")


def test_a_marker_lost_where_the_config_names_no_codebook(tmp_path, fixtures_dir):
    """A module's .mul1 marker removed (from the files and the manifest's tensor list) where neither config names a
    codebook: it would decode as 3INST, silently (vLLM 0.32 served the pack with every marker so removed at KL
    11.9); the manifest's recorded multiplier names it."""
    src = fixtures_dir / PACK
    key = "model.layers.0.mlp.down_proj"
    tensors = {
        k.rsplit(".", 1)[1]: v for k, v in load_file(src / "model.safetensors").items() if k.startswith(key + ".")
    }
    del tensors["mul1"]
    pack = replace_module(src, tmp_path / "p", key, tensors)
    manifest = json.loads((pack / MANIFEST_FILE).read_text())
    manifest.pop("codebook", None)
    manifest["tensor_storage"][key]["mul1_multiplier"] = 2212286765  # as exllamav3 records it
    (pack / MANIFEST_FILE).write_text(json.dumps(manifest))
    config = json.loads((pack / "config.json").read_text())
    config["quantization_config"].pop("codebook", None)
    (pack / "config.json").write_text(json.dumps(config))
    error = expect_problem(pack, f"{key}.mul1: {MANIFEST_FILE} records a mul1 multiplier for this module")
    assert [p.module for p in error.problems] == [key]


@pytest.mark.parametrize(
    ("pack", "module", "shape"),
    [
        (PACK, "lm_head", (1024, 256, 1)),
        (PACK, "model.embed_tokens", (1024 * 256,)),
        (MOE_PACK, "model.layers.0.mlp.gate", (8, 256, 1)),
        (NEXT_PACK, "model.layers.0.mlp.shared_expert_gate", (256,)),
    ],
)
def test_a_dense_matrix_of_another_rank(tmp_path, fixtures_dir, pack, module, shape):
    """A dense head, table, router or gate whose weight is 3-D or 1-D (vLLM 0.32's loaders, or the plugin's geometry
    check, stopped on each in the worker) is named."""
    src = fixtures_dir / pack
    weight = {"weight": torch.zeros(shape, dtype=torch.bfloat16)}
    expect_problem(replace_module(src, tmp_path / "p", module, weight), f"{module}.weight: weight is {list(shape)}")
