"""Spark-X2.5 (``Spark2_5ForCausalLM``, ``model_type: "spark2_5"``): no vLLM release has it (checked up to 0.32),
nor transformers; the family registers the config class with transformers and the model class written here
(:mod:`quantpack_families.models.spark`) with vLLM, and refuses to run beside the vendor's vLLM plugin, which
registers the same architecture name (whichever registers last would win, silently).

Source: docs/families.md (Spark).
"""

from __future__ import annotations

import os
from importlib.metadata import entry_points

from ..registry import Architecture, Family

#: the vendor's plugin packages and their ``vllm.general_plugins`` entry points (earlier and current names)
VENDOR = {"vllm_spark2_5_plugin": "spark2_5", "vllm_spark3_plugin": "spark3", "spark_vllm": "spark_vllm"}


def vendor_conflict() -> str | None:
    """A message naming the vendor's Spark plugin when vLLM would load it too (an entry point in
    ``vllm.general_plugins`` from one of :data:`VENDOR`'s packages, not excluded by ``VLLM_PLUGINS``); else None."""
    allowed = os.environ.get("VLLM_PLUGINS")
    allowed = None if allowed is None else {p.strip() for p in allowed.split(",") if p.strip()}
    for ep in entry_points(group="vllm.general_plugins"):
        package = ep.value.split(":")[0].split(".")[0]
        if package in VENDOR or ep.name in VENDOR.values():
            if allowed is not None and ep.name not in allowed:
                continue
            keep = ",".join(sorted({e.name for e in entry_points(group="vllm.general_plugins")} - {ep.name}))
            return (
                f"the vendor's Spark plugin ({package}, entry point {ep.name!r}) registers Spark2_5ForCausalLM too, "
                f"and whichever registers last wins: uninstall {package}, or set VLLM_PLUGINS={keep}"
            )
    return None


FAMILY = Family(
    name="spark",
    why="neither vLLM nor transformers knows Spark-X2.5, and exllamav3's layout differs from the vendor plugin's",
    registers={"Spark2_5ForCausalLM": Architecture("quantpack_families.models.spark:Spark2_5ForCausalLM")},
    configs={"spark2_5": "quantpack_families.models.spark_config:Spark2_5Config"},
    conflicts=vendor_conflict,
)
