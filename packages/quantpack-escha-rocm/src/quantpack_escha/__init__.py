"""quantpack-escha-rocm: the escha format (EXL3-derived trellis codes with split pre / post scales) for vLLM.

Importing the package does no work; vLLM loads :func:`quantpack_escha.plugin.register` through the
``vllm.general_plugins`` entry point. The format: docs/escha-format.md.
"""

__version__ = "0.1.0"
