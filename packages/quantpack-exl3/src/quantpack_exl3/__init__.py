"""quantpack-exl3: serve EXL3 (exllamav3 trellis) packs with stock vLLM.

Installed as a vLLM general plugin (entry point ``quantpack_exl3`` in ``vllm.general_plugins``), so ``vllm serve
<pack>`` picks up any checkpoint whose config says ``quant_method: "exl3"``. Importing this package does no work;
vLLM calls :func:`quantpack_exl3.plugin.register` in each of its processes.
"""

__version__ = "0.1.0"
