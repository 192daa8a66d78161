"""Small shims over vLLM API drift between the supported releases (see each function for the versions)."""

from __future__ import annotations


def routed_experts_class():
    """The class every MoE expert layer is an instance of: ``RoutedExperts`` (vLLM 0.22+), else ``FusedMoE``; None
    when vLLM has neither."""
    try:
        from vllm.model_executor.layers.fused_moe import RoutedExperts

        return RoutedExperts
    except ImportError:
        pass
    try:
        from vllm.model_executor.layers.fused_moe import FusedMoE

        return FusedMoE if isinstance(FusedMoE, type) else None
    except ImportError:
        return None
