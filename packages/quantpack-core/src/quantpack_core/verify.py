"""``quantpack verify``: does a pack compute what it should, checked on the CPU before it is served.

The pack is decoded by the core codec into transformers' model of its config
(:func:`.reference.dense_transformers_model`, float32) and its next-token logits over a short sequence are compared
(:func:`.compare.agreement`: KL and top-1) with a reference: the ``reference_logits.pt`` a pack may carry
(``{"input_ids": [1, T], "logits": [1, T, V]}``, the logits exllamav3's own kernels gave; the bundled packs have
one), another such file, or a model folder (the bf16 source the pack was made from, run by transformers on the same
ids). Source: docs/design.md ("Oracles").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .compare import Agreement, agreement
from .errors import QuantpackError

REFERENCE_FILE = "reference_logits.pt"
#: default (max KL, min top-1) per reference kind: the same quantized model computed by exllamav3 (rounding, and an
#: MoE router's near-ties: up to about 3e-3 on the bundled Qwen3-Next pack), or the unquantized source (the
#: quantization error itself: a sound pack stays well below, a wrongly decoded one gives several nats)
BOUNDS = {"logits": (1e-2, 0.95), "model": (1.0, 0.5)}


class VerifyError(QuantpackError):
    """The verification cannot run: no reference, transformers missing, a model class that does not fit the pack."""


@dataclass(frozen=True)
class Verdict:
    """The outcome of :func:`verify_pack`.

    Attributes:
        agreement: KL / top-1 of the pack's logits against the reference.
        source: what the reference was (a file or folder).
        kind: ``"logits"`` (stored logits) or ``"model"`` (a model run here).
        max_kl, min_top1: the bounds applied.
    """

    agreement: Agreement
    source: str
    kind: str
    max_kl: float
    min_top1: float

    @property
    def ok(self) -> bool:
        """Whether the agreement is within both bounds."""
        return self.agreement.kl <= self.max_kl and self.agreement.top1 >= self.min_top1


def _model(folder: Path):
    """transformers' model of ``folder`` with the pack's (or a source's) weights, float32: a pack through the codec,
    a model folder through transformers; a multimodal config falls back to its text class with the language model's
    names (``...ForConditionalGeneration`` -> ``...ForCausalLM``)."""
    import transformers

    from .reference import dense_transformers_model

    if (folder / "quantization_config.json").exists() or "quantization_config" in (folder / "config.json").read_text():
        try:
            return dense_transformers_model(folder)
        except (ValueError, AttributeError) as first:
            cfg = transformers.AutoConfig.from_pretrained(folder)
            name = (cfg.architectures or [""])[0]
            text = name.replace("ForConditionalGeneration", "ForCausalLM")
            try:  # a text model stored under the multimodal names (Qwen3.5's model.language_model.)
                return dense_transformers_model(folder, text, rename=("model.language_model.", "model."))
            except (ValueError, AttributeError):
                raise VerifyError(f"{folder}: the pack does not fit {name} ({first})") from None
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def verify_pack(
    pack: str | Path,
    against: str | Path | None = None,
    *,
    tokens: int = 64,
    max_kl: float | None = None,
    min_top1: float | None = None,
) -> Verdict:
    """Compare the pack's logits with a reference (see the module).

    Args:
        pack: the pack folder.
        against: a ``reference_logits.pt`` file or a model folder; default the pack's own ``reference_logits.pt``.
        tokens: positions to compare when the reference is a model and the pack has no ``reference_logits.pt``
            whose ids (text) are used instead (ids drawn with a fixed seed below the vocabulary size); a logits file
            brings its own ids.
        max_kl, min_top1: bounds (default :data:`BOUNDS` for the reference's kind).

    Returns:
        the :class:`Verdict`.

    Raises:
        VerifyError: no reference given or found, transformers missing, or the pack does not fit its config's class.
        PackError: the pack itself is unsound.
    """
    pack = Path(pack)
    source = Path(against) if against is not None else pack / REFERENCE_FILE
    if not source.exists():
        raise VerifyError(
            f"{pack}: no reference to verify against ({source} does not exist) - give --against with the bf16 source "
            f"model's folder or a {REFERENCE_FILE} file"
        )
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise VerifyError("quantpack verify runs the pack through transformers: pip install transformers") from None
    candidate = _model(pack)
    if source.is_file():
        kind = "logits"
        ref = torch.load(source, map_location="cpu", weights_only=True)
        if not isinstance(ref, dict) or "input_ids" not in ref or "logits" not in ref:
            raise VerifyError(f"{source}: not a reference logits file (a dict with input_ids and logits)")
        ids, want = ref["input_ids"], ref["logits"]
    else:
        kind = "model"
        own = pack / REFERENCE_FILE
        if own.is_file():
            ids = torch.load(own, map_location="cpu", weights_only=True)["input_ids"]
        else:
            vocab = candidate.config.get_text_config().vocab_size
            ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            want = _model(source)(ids).logits
    with torch.no_grad():
        got = candidate(ids).logits
    if got.shape != want.shape:
        raise VerifyError(f"{source}: reference logits {tuple(want.shape)} against the pack's {tuple(got.shape)}")
    kl, top1 = BOUNDS[kind]
    return Verdict(
        agreement(want, got),
        str(source),
        kind,
        kl if max_kl is None else max_kl,
        top1 if min_top1 is None else min_top1,
    )
