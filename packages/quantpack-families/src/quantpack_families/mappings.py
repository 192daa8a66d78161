"""Checkpoint-name mappings of the family fixes, kept apart from the model classes so that they import without any
model code (vLLM's Qwen3.5 module needs torchvision, which vLLM's CPU environments lack)."""

from __future__ import annotations

#: Qwen3.5 text model: checkpoint prefix -> vLLM prefix (None: not part of the text model). Qwen3.5 checkpoints,
#: and exllamav3's packs of them, name the text model ``model.language_model.``; a text-only vLLM model is ``model.``;
#: ``mtp.`` (the multi-token-prediction head) and ``model.visual.`` (the vision tower) are not loaded by it.
QWEN3_5_TEXT_PREFIXES: dict[str, str | None] = {"model.language_model.": "model.", "mtp.": None, "model.visual.": None}
