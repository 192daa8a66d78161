"""vLLM general-plugin entry point of quantpack-exl3 (``vllm.general_plugins``: ``quantpack_exl3``).

vLLM calls :func:`register` in every process it starts (front end, engine core, workers, its model-inspection
subprocess), sometimes twice in one process; it must be cheap, idempotent and must not touch CUDA. Importing this
package does no work. Follows vLLM's ``vllm/plugins/__init__.py`` (how and where general plugins are loaded).
"""

from __future__ import annotations

import logging
import os
from importlib.metadata import entry_points

logger = logging.getLogger("vllm.quantpack.exl3")

#: this package's entry-point name
ENTRY_POINT = "quantpack_exl3"
#: entry-point names of the plugins quantpack replaces: they register the same quant_method and patch the same
#: classes, so which one wins would depend on plugin order
CONFLICTS = ("orcasaq2", "qwen38_exl3_vision", "tarninfer_exl3", "flint_vllm", "spark_vllm")

_registered = False


class PluginConflictError(RuntimeError):
    """A plugin that quantpack replaces is installed and would be loaded too."""


def conflicting_plugins() -> list[str]:
    """Replaced plugins that vLLM would load in this environment: installed, and not left out by ``VLLM_PLUGINS``.

    Returns:
        sorted entry-point names.
    """
    allowed = os.environ.get("VLLM_PLUGINS")
    # vLLM splits VLLM_PLUGINS on commas without stripping (vllm/plugins/__init__.py); so do we
    allowed_set = None if allowed is None else set(allowed.split(","))
    return sorted(
        {
            ep.name
            for ep in entry_points(group="vllm.general_plugins")
            if ep.name in CONFLICTS and (allowed_set is None or ep.name in allowed_set)
        }
    )


def providers(names: list[str]) -> list[str]:
    """The distributions (what ``pip uninstall`` takes) that provide these ``vllm.general_plugins`` entry points;
    the entry-point name where the distribution is unknown."""
    out = []
    for ep in entry_points(group="vllm.general_plugins"):
        if ep.name in names:
            dist = getattr(ep, "dist", None)
            out.append(dist.name if dist is not None else ep.name)
    return sorted(set(out))


def register() -> None:
    """Make ``quant_method: "exl3"`` loadable in this process.

    Raises:
        PluginConflictError: a replaced plugin (see :data:`CONFLICTS`) would be loaded too; the message says what
            to uninstall or which ``VLLM_PLUGINS`` value leaves it out.
    """
    global _registered
    if _registered:
        return
    found = conflicting_plugins()
    if found:
        raise PluginConflictError(
            f"quantpack-exl3 replaces the vLLM plugin(s) {', '.join(found)}, which are installed here and would "
            f"register the same 'exl3' method: uninstall them (pip uninstall {' '.join(providers(found))}), or leave "
            f"them out with VLLM_PLUGINS={ENTRY_POINT},quantpack_families (add any other plugin you need, "
            "comma-separated)"
        )

    from quantpack_core.vllm.plugin import register_config

    from .config import Exl3Config

    register_config(Exl3Config)
    _registered = True
    logger.info("quantpack-exl3: quant_method 'exl3' registered")
