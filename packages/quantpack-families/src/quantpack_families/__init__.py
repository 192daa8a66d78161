"""Model-family fixes for quantized packs in vLLM (a vLLM general plugin; see :mod:`quantpack_families.plugin`)."""

__version__ = "0.1.0"
