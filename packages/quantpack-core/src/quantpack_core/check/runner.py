"""The pack check's one runner: every rule, in order, over an opened pack (:func:`problems`). The vLLM configs (at
load, ``maybe_update_config``) and the command line (``quantpack inspect`` / ``verify`` / ``serve``) run it through
:meth:`quantpack_core.pack.Pack.open`.

Each rule is a plain function ``(pack, settings) -> list[Problem]`` of one module of this package; a format's own
rules (:class:`~quantpack_core.format.PackFormat`) run where the rules of their kind do: one module's, the quantization
config's, one manifest entry's, the modules' together and their values. The decoder layers' layout and the stated
classes' layers come last and name only modules no other rule named.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import Problem
from ..format import pack_formats
from ..inventory import DENSE, OTHER, PackView
from .architectures.problems import architecture_problems
from .config import bits_problems, config_problems, head_count_problems, method_problems
from .files import (
    config_read_problems,
    manifest_problems,
    manifest_read_problems,
    shard_problems,
    tokenizer_problems,
    unindexed_problems,
)
from .layers import OTHER_STACKS, decoder_layers, sibling_problems, stack_problems, sublayer_problems, tensor_problems
from .modules import fused_problems, module_problems, stray_tensor_problems
from .moe import moe_problems
from .settings import CheckSettings
from .shapes import shape_problems

Rule = Callable[[PackView, CheckSettings], list[Problem]]


def format_config_problems(pack: PackView, settings: CheckSettings) -> list[Problem]:
    """Each installed format's rules of its own quantization-config settings."""
    return [p for fmt in pack_formats().values() for p in fmt.config_problems(pack)]


def format_pack_problems(pack: PackView, settings: CheckSettings) -> list[Problem]:
    """Each installed format's rules of its modules together."""
    return [p for fmt in pack_formats().values() for p in fmt.pack_problems(pack, settings)]


def format_value_problems(pack: PackView, settings: CheckSettings) -> list[Problem]:
    """Each installed format's rules of its modules' values against the config (with ``settings.values`` only)."""
    return [p for fmt in pack_formats().values() for p in fmt.value_problems(pack)] if settings.values else []


#: the rules, in the order their problems are listed
RULES: tuple[Rule, ...] = (
    config_read_problems,
    bits_problems,
    manifest_read_problems,
    shard_problems,
    method_problems,
    module_problems,
    format_config_problems,
    moe_problems,
    fused_problems,
    manifest_problems,
    unindexed_problems,
    config_problems,
    shape_problems,
    stray_tensor_problems,
    tokenizer_problems,
    format_pack_problems,
    head_count_problems,
    format_value_problems,
)


def problems(pack: PackView, settings: CheckSettings) -> list[Problem]:
    """Every defect of the opened ``pack`` (an empty list when it is sound): each rule of :data:`RULES` in turn,
    then the layout rules (:func:`layout_problems`) for the modules no rule named."""
    if pack.config_method and not pack_formats():
        return [no_format_problem(pack.config_method)]
    out: list[Problem] = []
    for rule in RULES:
        out += rule(pack, settings)
    named = {p.module for p in out}
    return out + [p for p in layout_problems(pack, settings) if p.module not in named]


def no_format_problem(method: str) -> Problem:
    """The one problem of a quantized pack where no format package is installed (quantpack-core alone): no rule of
    its modules can be judged, so none is listed."""
    return Problem(
        "",
        "config.json",
        f"quantization_config.quant_method is {method!r}, but no package that reads a quantized format is installed "
        "beside quantpack-core, so its modules cannot be checked",
        "install the plugin of that format beside quantpack-core (docs/install.md; it needs no vLLM for the check)",
    )


def layout_problems(pack: PackView, settings: CheckSettings) -> list[Problem]:
    """Modules of the decoder layers that cannot be absent given those present (:mod:`.layers`): a gated MLP's or an
    attention block's missing member, a module every other instance of its parent holds, a layer short of a sublayer
    its stack's other layers hold, a plain module's tensor every other layer's has (the last three not for DeciLM's
    ``block_configs``, whose no-op blocks hold fewer by design); and for the model classes whose layer the project
    states (:mod:`.architectures`), the layers against it, at any layer count, where the rules above did not name the
    module or its parent. One problem per module, the first. Nothing where a shard file could not be read: its
    modules are reported through the file, not one by one as missing."""
    if pack.bad_files:
        return []
    cfg = pack.config.get("text_config") if isinstance(pack.config.get("text_config"), dict) else pack.config
    layers = cfg.get("num_hidden_layers") if isinstance(cfg, dict) else None
    layers = layers if isinstance(layers, int) and not isinstance(layers, bool) and layers > 0 else None
    stacks = decoder_layers(pack.modules, OTHER_STACKS, layers)
    blocks = isinstance(cfg, dict) and isinstance(cfg.get("block_configs"), list)
    out = [] if blocks else sublayer_problems(stacks)
    out += sibling_problems(stacks, lone=not blocks)
    out += stack_problems(stacks, pack.modules, OTHER_STACKS, pack.config)
    if not blocks:
        own = {k: set(m.tensors) for k, m in pack.modules.items() if m.format in (DENSE, OTHER)}
        out += tensor_problems(stacks, own, pack.modules)
    named = {p.module for p in out}
    tensors = {k: set(m.tensors) for k, m in pack.modules.items()}
    out += [
        p
        for p in architecture_problems(stacks, tensors, settings.built(pack.config))
        if not any(p.module == n or p.module.startswith(n + ".") for n in named)
    ]
    return list({p.module: p for p in reversed(out)}.values())[::-1]
