"""The family registry: one module per model family, each declaring one :class:`~quantpack_families.registry.Family`;
adding a family = one module + one line here."""

from . import flint, nemotron_h, nemotron_vl, qwen3_5, qwen3_next, qwen4_exp, qwen_vision, spark

FAMILIES = (
    qwen3_5.FAMILY,
    qwen3_next.FAMILY,
    qwen4_exp.FAMILY,
    flint.FAMILY,
    spark.FAMILY,
    nemotron_h.FAMILY,
    nemotron_vl.FAMILY,
    qwen_vision.FAMILY,
)
