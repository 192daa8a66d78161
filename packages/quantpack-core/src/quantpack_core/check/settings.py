"""What one run of the pack check is asked to check (:class:`CheckSettings`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckSettings:
    """The settings of one run of the pack check (:func:`quantpack_core.check.problems`).

    Attributes:
        method: the ``quant_method`` config.json must say (a format's name), or None to leave it unchecked.
        values: also read each coded module's small tensors (markers, scales: a few KiB each) and the other modules'
            1-D floating tensors (norm weights, biases, int8 row scales) and vocabulary tables, and check their
            values (finite, within what a trained model holds, the padding a writer leaves).
        model_config: the model's config as the server built it from config.json (vLLM's ``hf_config`` as a dict:
            after ``--hf-overrides``, and with a draft's class renamed), or None: the decoder layers and the settings
            vLLM builds from are held against it instead of config.json.
    """

    method: str | None = None
    values: bool = True
    model_config: dict | None = None

    def built(self, config: dict) -> dict:
        """The config vLLM builds the model from: :attr:`model_config`, else config.json's ``config``."""
        return self.model_config if isinstance(self.model_config, dict) else config
