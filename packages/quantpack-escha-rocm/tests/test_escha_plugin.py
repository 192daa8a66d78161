"""The plugin's registration: importing does no work, the entry points are installed, registering twice is harmless,
and vLLM picks the escha config from a pack's config.json with no flag."""

import subprocess
import sys

import pytest


def test_import_does_no_work():
    code = "import sys, quantpack_escha, quantpack_escha.plugin; print('vllm' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_entry_points_are_installed():
    from importlib.metadata import entry_points

    assert {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}.get("quantpack_escha") == (
        "quantpack_escha.plugin:register"
    )
    assert {ep.name: ep.value for ep in entry_points(group="quantpack.commands")}.get("escha-from-exl3") == (
        "quantpack_escha.cli:escha_from_exl3"
    )


def test_register_is_idempotent_and_claims_escha_packs():
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.quantization import get_quantization_config

    from quantpack_escha.config import EschaConfig
    from quantpack_escha.plugin import register

    register()
    register()
    assert get_quantization_config("escha") is EschaConfig
    assert EschaConfig.override_quantization_method({"quant_method": "escha"}, None) == "escha"
    assert EschaConfig.override_quantization_method({"quant_method": "exl3"}, None) is None
