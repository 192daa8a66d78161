"""Flint (``FlintForCausalLM``, ``model_type: "flint"``): no vLLM release has it (checked up to 0.32), nor
transformers; the family registers the config class with transformers and the model class written here
(:mod:`quantpack_families.models.flint`) with vLLM.

An EXL3 Flint pack keeps its shared expert dense where the pack stores it dense: a public 4-bit Flint pack lost the
model when the shared expert was quantized (every top-10 logprob identical), so a pack made for quantpack should
store it dense or at high bits; the quant config gives each module the method of its storage.

Source: docs/families.md (Flint), from the public descriptions.
"""

from __future__ import annotations

from ..registry import Architecture, Family

FAMILY = Family(
    name="flint",
    why="neither vLLM nor transformers knows Flint (sliding + NoPE layers, attention sinks, ungated shared expert)",
    registers={"FlintForCausalLM": Architecture("quantpack_families.models.flint:FlintForCausalLM")},
    configs={"flint": "quantpack_families.models.flint_config:FlintConfig"},
)
