"""The decoder layers of a pack against the layer vLLM builds for config.json's model class
(:mod:`quantpack_core.check.architectures`: the stated classes only), whatever the layer count.

:func:`architecture_problems` surveys every layer (:class:`Findings`: what each layer lacks, holds beside the stated
layer, or holds otherwise than vLLM's layer loads it), then reports each finding once, naming the first layer and the
count: a module missing from every layer, and a stray module or bias in any, mean the class does not match the
tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import Problem
from ..base import quantized_tensors, weight_tensors
from ..layers import DRAFT_FUSION, FIX, FIX_DENSE, LAYER_KEY, skipped_by_vllm
from . import BY_CLASS, architecture_layer, stated_class, stated_layer, unquantized

#: the fix where config.json's model class and the tensors disagree in every layer
WRONG_CLASS = (
    "config.json's architectures names another model than the tensors are of: use the config.json the pack was made "
    "with (or, where every other layer holds it, the pack is incomplete: re-download it)"
)
#: config.json's settings that give vLLM's layers a bias or take it away (:func:`architecture_layer`), all set
ALL_BIAS = {"attention_bias": True, "bias": True, "qkv_bias": True, "mlp_bias": True}
#: the fix of a bias vLLM's class has no place for, or always has, whatever the config says
FIX_CLASS_BIAS = "vLLM cannot serve this pack as it is (a model of another class, or one {})"
#: the fix of a bias the config's settings give or take away
FIX_CONFIG_BIAS = "use the config.json the pack was made with (its bias settings and architectures)"


def _within(path: str, module: str) -> bool:
    """Whether module path ``path`` is ``module`` or lies below it."""
    return path == module or path.startswith(module + ".")


def _uncovered_root(path: str, covered: tuple[str, ...]) -> str:
    """The shortest leading part of module path ``path`` that is neither one of ``covered`` nor a parent of one
    (``mlp.experts`` of ``mlp.experts.3.gate_proj`` where only ``mlp.gate_proj`` ... are covered): one problem for a
    stray bank, not one per expert."""
    parts = path.split(".")
    for n in range(1, len(parts) + 1):
        head = ".".join(parts[:n])
        if not any(_within(c, head) for c in covered):
            return head
    return path


def _shown(idx: list[int]) -> str:
    """Layer indices as a message lists them: the first eight, and the count beyond."""
    return ", ".join(map(str, idx[:8])) + (f" ... ({len(idx)} in all)" if len(idx) > 8 else "")


@dataclass
class Findings:
    """What the decoder layers hold against the stated layer, each finding with the layers it was seen in (in order).

    Attributes:
        lacking: a module vLLM loads into that the layer does not hold.
        unheld: ``(module, tensor)``: a module's own tensor (:attr:`~.base.Architecture.own_tensors`) it lacks.
        weightless: a module of the layer holding no weight (nor a trellis).
        coded: a module vLLM builds without the quantization config, stored quantized.
        stray: a module of another family's layer.
        unknown: any other module vLLM's layer has no module for (the shortest uncovered part of its path).
        biased: ``(module, whether vLLM's has one)``: a module whose bias is not vLLM's.
        first_wrong: the first module of each ``biased`` entry (an expert of a bank).
    """

    lacking: dict[str, list[int]] = field(default_factory=dict)
    unheld: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    weightless: dict[str, list[int]] = field(default_factory=dict)
    coded: dict[str, list[int]] = field(default_factory=dict)
    stray: dict[str, list[int]] = field(default_factory=dict)
    unknown: dict[str, list[int]] = field(default_factory=dict)
    biased: dict[tuple[str, bool], list[int]] = field(default_factory=dict)
    first_wrong: dict[tuple[str, bool], str] = field(default_factory=dict)


def architecture_problems(
    stacks: dict[str, dict[int, list]], tensors: dict[str, set[str]], config: dict
) -> list[Problem]:
    """The decoder layers against the layer vLLM builds for config.json's model class (:func:`architecture_layer`,
    :data:`~quantpack_core.check.architectures.KNOWN_LAYERS` only), whatever the layer count: a module it loads into
    missing from a layer (a Qwen3 layer's q_norm, vLLM would serve its initial ones without a word; the layout rules
    of :mod:`quantpack_core.check.layers` need more layers to see it), a module of another family's layer (a Qwen3
    q_norm in a Llama pack) or any other module vLLM's layer does not have (its loader stops in the worker; rotary
    tables and scales excepted, which vLLM skips or maps), a module of the layer holding no weight (a q_norm with a
    bias only: vLLM loads nothing into it), a bias where vLLM's layer has none (on a projection, a norm, a router or an
    expert: vLLM's loaders drop unexpected biases without a word) or none where it has one (served uninitialized), a
    module vLLM builds without the quantization config stored quantized
    (:func:`~quantpack_core.check.architectures.unquantized_layer_modules`: a trellis router of Mixtral, whose loader
    stops in the worker). A module missing from every layer, and a stray module or bias in any, mean the class does
    not match the tensors; each is one problem naming the first layer and the count. Also settings vLLM cannot plan
    the layers from (:attr:`~.base.Architecture.plan_problems`: the Qwen MoE classes' sparse step below 1, no MoE
    layer at all), and a module's own tensor vLLM loads into (the Gated DeltaNet's A_log and dt_bias) that it lacks.
    Only the first class of ``architectures`` is read: vLLM builds the first it has, and every stated class is vLLM's
    own.

    Args:
        stacks: :func:`~quantpack_core.check.layers.decoder_layers`'s grouping (its ``model.layers.`` stack is
            checked).
        tensors: every module key of the pack with the names of its tensors (``{"...q_proj": {"trellis", "bias"}}``);
            with EAGLE's ``fc`` outside the layers (:data:`~quantpack_core.check.layers.DRAFT_FUSION`: a draft, whose
            first layer vLLM builds without ``input_layernorm``), that norm is not required of the first layer.
        config: config.json.

    Returns:
        The problems, one per module (or per module path, where it is the class).
    """
    arch = stated_class(config)
    layers = stacks.get("model.layers.")
    if arch is None or not layers:
        return []
    plan = BY_CLASS[arch].plan_problems
    out = plan(arch, config, layers) if plan is not None else []
    # an EAGLE-1 draft published as LlamaForCausalLM (its fc outside the layers): vLLM builds it as a draft, whose
    # first layer has no input_layernorm
    draft = any(not LAYER_KEY.search(k) and k.rsplit(".", 1)[-1] == DRAFT_FUSION for k in tensors)
    found = Findings()
    for i, paths in sorted(layers.items()):
        _survey_layer(found, arch, config, i, paths, tensors, draft and i == min(layers))
    out += _missing_problems(found, arch, tensors, len(layers))
    out += _misplaced_problems(found, arch, tensors)
    return out + _bias_problems(found, arch, config)


def _survey_layer(
    found: Findings, arch: str, config: dict, i: int, paths: list[str], tensors: dict[str, set[str]], draft: bool
) -> None:
    """Record what layer ``i`` (its module ``paths``) holds against the stated layer; ``draft``: the first layer of
    a draft, which needs no ``input_layernorm``."""
    layer = stated_layer(arch, config, i)
    if not layer.required:  # a layer the project does not state (Mistral's with a time-conditioned norm)
        return
    held = {path: tensors.get(f"model.layers.{i}.{path}") for path in paths}
    for path in unquantized(arch, layer.required):
        if tensors.get(f"model.layers.{i}.{path}", set()) & quantized_tensors():
            found.coded.setdefault(path, []).append(i)
    _survey_required(found, arch, i, paths, layer.required, tensors, draft)
    for other in layer.absent:
        if any(_within(p, other) for p in paths):
            found.stray.setdefault(other, []).append(i)
    owned = _survey_unknown(found, i, held, layer.required, (*layer.required, *layer.absent, *layer.unstated))
    bias = {path: layer.bias.get(path, False) for path in layer.required}
    for path, has in bias.items():
        # the modules it owns each: all biased where vLLM's has one, none where it has none
        wrong = [p for p in owned.get(path, ()) if ("bias" in (held[p] or set())) != has]
        if wrong:
            found.biased.setdefault((path, has), []).append(i)
            found.first_wrong.setdefault((path, has), f"model.layers.{i}.{wrong[0]}")


def _survey_required(
    found: Findings,
    arch: str,
    i: int,
    paths: list[str],
    required: tuple[str, ...],
    tensors: dict[str, set[str]],
    draft: bool,
) -> None:
    """Record the required modules layer ``i`` lacks, those it holds without a weight, and the own tensors
    (:attr:`~.base.Architecture.own_tensors`) a held module lacks."""
    own_tensors = BY_CLASS[arch].own_tensors
    parents = {path.rsplit(".", n)[0] for path in paths for n in range(1, path.count(".") + 1)}
    for need in required:
        if draft and need == "input_layernorm":
            continue
        held_here = [p for p in paths if _within(p, need)]
        if not held_here:
            found.lacking.setdefault(need, []).append(i)
        for path in held_here:
            own = tensors.get(f"model.layers.{i}.{path}")
            if path not in parents and own is not None and not own & weight_tensors():
                found.weightless.setdefault(path, []).append(i)
        if held_here and need in own_tensors:
            own = tensors.get(f"model.layers.{i}.{need}", set())
            for name in own_tensors[need]:
                if name not in own:
                    found.unheld.setdefault((need, name), []).append(i)


def _survey_unknown(
    found: Findings, i: int, held: dict[str, set[str] | None], required: tuple[str, ...], covered: tuple[str, ...]
) -> dict[str, list[str]]:
    """Each module of layer ``i`` (``held``: path -> its tensors) under the required module it lies closest below (an
    expert under mlp.experts, a Gated DeltaNet's conv1d under linear_attn.conv1d, not linear_attn), returned; anything
    under none and outside ``covered`` (the other families' modules, what the layer leaves unstated) is recorded as a
    module vLLM's layer does not have (its loader raises "There is no module or parameter named ..."), but rotary
    tables, which vLLM's loaders skip."""
    owned: dict[str, list[str]] = {}
    for path, own in held.items():
        owner = max((r for r in required if _within(path, r)), key=len, default=None)
        if owner is not None:
            owned.setdefault(owner, []).append(path)
        elif not any(_within(path, c) for c in covered) and not skipped_by_vllm(path, own or set()):
            seen = found.unknown.setdefault(_uncovered_root(path, covered), [])
            if not seen or seen[-1] != i:  # layers come in order
                seen.append(i)
    return owned


def _missing_problems(found: Findings, arch: str, tensors: dict[str, set[str]], count: int) -> list[Problem]:
    """The required modules, own tensors and weights the layers lack (a module no layer of several holds: the class
    does not match the tensors)."""
    out: list[Problem] = []
    for need, idx in found.lacking.items():
        if len(idx) == count and count > 1:
            what = f"no decoder layer holds {need}, which every layer of vLLM's {arch} has"
            out.append(Problem(f"model.layers.{idx[0]}.{need}", f"model.layers.{idx[0]}.{need}.*", what, WRONG_CLASS))
            continue
        for i in idx:
            what = f"layer {i} holds no {need}, which every layer of vLLM's {arch} has"
            out.append(Problem(f"model.layers.{i}.{need}", f"model.layers.{i}.{need}.*", what, FIX))
    for (path, name), idx in found.unheld.items():
        key = f"model.layers.{idx[0]}.{path}"
        what = (
            f"layer(s) {_shown(idx)}: {path} holds no {name}, which vLLM's {arch} loads into a parameter of its own: "
            "it would serve that parameter's initial values without a word"
        )
        out.append(Problem(key, f"{key}.{name}", what, FIX))
    for path, idx in found.weightless.items():
        key = f"model.layers.{idx[0]}.{path}"
        what = (
            f"layer(s) {_shown(idx)}: {path} holds {', '.join(sorted(tensors[key]))} but no weight (nor a trellis): "
            "vLLM loads nothing into it and would serve its initial values without a word"
        )
        out.append(Problem(key, f"{key}.weight", what, FIX))
    return out


def _misplaced_problems(found: Findings, arch: str, tensors: dict[str, set[str]]) -> list[Problem]:
    """The modules stored quantized where vLLM builds them dense, the other families' modules and the modules
    vLLM's layer has none for."""
    out: list[Problem] = []
    for path, idx in found.coded.items():
        key = f"model.layers.{idx[0]}.{path}"
        held = sorted(tensors[key] & quantized_tensors())
        what = (
            f"layer(s) {_shown(idx)}: {path} is stored quantized ({', '.join(held)}), but vLLM's {arch} builds it "
            "without the quantization config, so it loads a dense weight only: vLLM's loader stops in the worker "
            '("There is no module or parameter named ...")'
        )
        out.append(Problem(key, f"{key}.{held[0]}", what, FIX_DENSE))
    for other, idx in found.stray.items():
        what = (
            f"layer(s) {_shown(idx)} hold {other}, which vLLM's {arch} has no place for (another family's layer holds "
            "one): vLLM's loader stops in the worker"
        )
        out.append(Problem(f"model.layers.{idx[0]}.{other}", f"model.layers.{idx[0]}.{other}.*", what, WRONG_CLASS))
    for path, idx in found.unknown.items():
        what = (
            f"layer(s) {_shown(idx)} hold {path}, which vLLM's {arch} layer has no module for: its loader stops in the "
            'worker ("There is no module or parameter named ...") or, in some releases, passes over it'
        )
        out.append(Problem(f"model.layers.{idx[0]}.{path}", f"model.layers.{idx[0]}.{path}.*", what, WRONG_CLASS))
    return out


def _bias_problems(found: Findings, arch: str, config: dict) -> list[Problem]:
    """The biases that are not vLLM's: missing where it always has one or where the config gives one, held where the
    config takes it away or where vLLM's class has none whatever the config says."""
    out: list[Problem] = []
    for (path, has), idx in found.biased.items():
        key = found.first_wrong[path, has]
        if has and architecture_layer(arch, {**config, **dict.fromkeys(ALL_BIAS, False)}, idx[0])[2].get(path):
            what = f"holds no bias, but vLLM's {arch} always gives it one: it would serve an uninitialized bias"
            fix = FIX_CLASS_BIAS.format("without the bias vLLM's has")
        elif has:
            what = (
                f"holds no bias, but vLLM's {arch} gives it one (config.json's attention / qkv bias settings): it "
                "would serve an uninitialized bias"
            )
            fix = FIX_CONFIG_BIAS
        elif architecture_layer(arch, {**config, **ALL_BIAS}, idx[0])[2].get(path):
            what = (
                f"holds a bias, but vLLM's {arch} gives it none (config.json's attention / qkv / mlp bias settings): "
                "vLLM would drop it without a word"
            )
            fix = FIX_CONFIG_BIAS
        else:
            what = (
                f"holds a bias, and vLLM's {arch} has none there whatever config.json says: vLLM would drop it "
                "without a word"
            )
            fix = FIX_CLASS_BIAS.format("whose bias vLLM's class lacks")
        out.append(Problem(key, f"{key}.bias", f"layer(s) {_shown(idx)}: {path} {what}", fix))
    return out
