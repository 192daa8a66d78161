"""``quantpack verify``: does a pack compute what it should, checked on the CPU before it is served.

The pack is decoded by the core codec into transformers' model of its config
(:func:`.reference.dense_transformers_model`, float32) and its next-token logits over a short sequence are compared
(:func:`.compare.agreement`: KL and top-1) with a reference: the ``reference_logits.pt`` a pack may carry
(``{"input_ids": [1, T], "logits": [1, T, V]}``, the logits exllamav3's own kernels gave; the bundled packs have
one), another such file, or a model folder (the bf16 source the pack was made from, run by transformers on the same
ids). Source: docs/design.md ("Oracles").

With no reference at all, the pack's own forward is judged on text: its mean next-token NLL on Python source its
tokenizer encodes, against ``ln(vocabulary)`` (a uniform guess). A sound model predicts such text far better than
chance; a pack whose sizes or weights its config misstates in ways no tensor shows (8 heads of 32 for 4 of 64, with
the key-value heads to match: every projection the same shape) predicts it no better.
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
#: with no reference (kind ``"text"``): the largest mean NLL on the text, as a fraction of ``ln(vocabulary)``.
#: Measured on 256 tokens of the text below: the bundled packs 0.179 (Qwen3.5) to 0.313 (Qwen3-Next; llama-tiny 4.0
#: bpw 0.204, 2.5 bpw 0.220, Qwen3-MoE 3.0 bpw 0.213); llama-tiny with 8 heads of 32 and 4 key-value heads in its
#: config (every shape as stored, accepted by the pack check) 1.021. The bound lies between, nearer the sound ones.
TEXT_BOUND = 0.6
#: the text: Python source shipped with every interpreter (its standard library), the bundled packs' domain and one
#: every general model has seen
TEXT_FILES = ("json/encoder.py", "string.py")
#: positions read from the text when ``tokens`` does not say
TEXT_TOKENS = 256


class VerifyError(QuantpackError):
    """The verification cannot run: no reference, transformers missing, a model class that does not fit the pack."""


@dataclass(frozen=True)
class Verdict:
    """The outcome of :func:`verify_pack`.

    Attributes:
        agreement: KL / top-1 of the pack's logits against the reference (None for ``"text"``).
        source: what the reference was (a file or folder; for ``"text"``, the text's files).
        kind: ``"logits"`` (stored logits), ``"model"`` (a model run here) or ``"text"`` (no reference).
        max_kl, min_top1: the bounds applied (``"text"``: ``max_kl`` is the NLL bound in nats, ``min_top1`` 0).
        nll, uniform: for ``"text"``, the pack's mean NLL and ``ln(vocabulary)``, nats per token; else None.
    """

    agreement: Agreement | None
    source: str
    kind: str
    max_kl: float
    min_top1: float
    nll: float | None = None
    uniform: float | None = None

    @property
    def ok(self) -> bool:
        """Whether the agreement (the NLL, for ``"text"``) is within the bounds."""
        if self.agreement is None:
            return self.nll is not None and self.nll <= self.max_kl
        return self.agreement.kl <= self.max_kl and self.agreement.top1 >= self.min_top1

    def summary(self) -> str:
        """One line: what was compared, the figures, and whether they are within the bounds."""
        verdict = "within" if self.ok else "beyond"
        if self.agreement is None:
            return (
                f"no reference: mean NLL {self.nll:.4f} nats on {self.source}, a uniform guess {self.uniform:.4f}; "
                f"{verdict} the bound (NLL <= {self.max_kl:.4f}, {TEXT_BOUND:g} of the guess)"
            )
        return (
            f"against {self.source} ({self.kind}): {self.agreement}; {verdict} the bounds (KL <= {self.max_kl:g}, "
            f"top-1 >= {100 * self.min_top1:g}%)"
        )


def _config_top(folder: Path) -> dict:
    """A folder's config.json as a dict ({} when missing or unreadable)."""
    import json

    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _config(folder: Path) -> dict:
    """A model folder's config.json (its text part for a multimodal one), or :class:`VerifyError`."""
    cfg = _config_top(folder)
    if not cfg:
        raise VerifyError(f"{folder}: not a model folder with a readable config.json")
    text = cfg.get("text_config")
    return text if isinstance(text, dict) and text else cfg


#: config fields a reference model must share with the pack (else it is another model)
SAME_MODEL = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def _model(folder: Path, quantized: bool):
    """transformers' model of ``folder``, float32: a pack through the codec, a model folder through transformers
    (every weight present); a multimodal config falls back to its text class with the language model's names
    (``...ForConditionalGeneration`` -> ``...ForCausalLM``). Any failure is a :class:`VerifyError`."""
    import transformers

    from .reference import dense_transformers_model

    if quantized:
        try:
            return dense_transformers_model(folder)
        except Exception as first:
            archs = _config_top(folder).get("architectures")
            name = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else ""
            text = name.replace("ForConditionalGeneration", "ForCausalLM")
            try:  # a text model stored under the multimodal names (Qwen3.5's model.language_model.)
                return dense_transformers_model(folder, text, rename=("model.language_model.", "model."))
            except Exception:
                raise VerifyError(
                    f"{folder}: the pack does not fit its config's model class {name!r} ({first})"
                ) from None
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, output_loading_info=True
        )
    except Exception as e:
        raise VerifyError(
            f"{folder}: transformers cannot load this reference model ({type(e).__name__}: {e})"
        ) from None
    missing = [k for k in info.get("missing_keys", []) if "rotary" not in k]
    if missing:
        raise VerifyError(
            f"{folder}: the reference model lacks weights ({', '.join(missing[:4])} ...): not a whole model"
        )
    return model.eval()


def _reference_logits(source: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [1, T] int64, logits [1, T, V] float)`` of a reference file, checked; else :class:`VerifyError`."""
    import pickle

    try:
        ref = torch.load(source, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, ValueError, KeyError) as e:
        raise VerifyError(f"{source}: not a reference logits file torch can read safely ({type(e).__name__})") from None
    ok = (
        isinstance(ref, dict)
        and isinstance(ref.get("input_ids"), torch.Tensor)
        and isinstance(ref.get("logits"), torch.Tensor)
    )
    ids, logits = (ref["input_ids"], ref["logits"]) if ok else (None, None)
    if not ok or ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 1 or ids.dtype not in (torch.int64, torch.int32):
        raise VerifyError(
            f"{source}: a reference logits file is a dict with input_ids (int64 [1, T], T >= 1) and logits "
            "([1, T, vocab])"
        )
    if logits.dim() != 3 or tuple(logits.shape[:2]) != tuple(ids.shape) or not bool(torch.isfinite(logits).all()):
        raise VerifyError(
            f"{source}: logits must be finite, [1, T, vocab] for input_ids [1, T]; got {tuple(logits.shape)}"
        )
    return ids.long(), logits


#: positions compared against a model when neither ``tokens`` nor the pack's own reference ids say otherwise
DEFAULT_TOKENS = 64


def verify_pack(
    pack: str | Path,
    against: str | Path | None = None,
    *,
    tokens: int | None = None,
    max_kl: float | None = None,
    min_top1: float | None = None,
) -> Verdict:
    """Compare the pack's logits with a reference (see the module).

    Args:
        pack: the pack folder.
        against: a ``reference_logits.pt`` file or a model folder; default the pack's own ``reference_logits.pt``.
        tokens: positions to compare when the reference is a model: ids drawn with a fixed seed below the vocabulary
            size, at most the model's ``max_position_embeddings``. None: the ids (text) of the pack's own
            ``reference_logits.pt`` when it has one, else :data:`DEFAULT_TOKENS`. A logits file brings its own ids.
        max_kl, min_top1: bounds (default :data:`BOUNDS` for the reference's kind): KL >= 0 in nats per token,
            top-1 a fraction in [0, 1].

    Returns:
        the :class:`Verdict`.

    Raises:
        VerifyError: bad bounds, no usable reference (missing, unreadable, malformed, another model, weights
            missing), transformers missing, or a pack that does not fit its config's class.
        PackError: the pack itself is unsound.
    """
    _check_bounds(max_kl, min_top1)
    pack = Path(pack)
    _open_pack(pack)  # a missing or unsound pack is named first
    source = Path(against) if against is not None else pack / REFERENCE_FILE
    if against is not None and not source.exists():
        raise VerifyError(
            f"{pack}: no reference to verify against ({source} does not exist) - give --against with the bf16 source "
            f"model's folder or a {REFERENCE_FILE} file"
        )
    _require_transformers()
    cfg = _config(pack)
    if not source.exists():
        return verify_on_text(pack, tokens)
    if source.is_file():
        kind = "logits"
        ids, want = _file_reference(source, cfg.get("vocab_size"))
    else:
        kind = "model"
        ids, want = _model_reference(pack, source, cfg, tokens)
    candidate = _model(pack, quantized=True)
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


def _check_bounds(max_kl: float | None, min_top1: float | None) -> None:
    """:class:`VerifyError` unless the bounds given are a KL >= 0 and a fraction in [0, 1]."""
    import math

    if max_kl is not None and not (math.isfinite(max_kl) and max_kl >= 0):
        raise VerifyError(f"--max-kl {max_kl}: give a KL bound >= 0 in nats per token")
    if min_top1 is not None and not (math.isfinite(min_top1) and 0 <= min_top1 <= 1):
        raise VerifyError(f"--min-top1 {min_top1}: give a fraction between 0 and 1 (0.95 for 95%)")


def _open_pack(pack: Path) -> None:
    """Open the pack under the rules of its format (:class:`PackError` when it is missing or unsound); a pack of
    another installed format than EXL3 is held to its own rules."""
    from .codec.exl3 import FORMAT as EXL3
    from .format import pack_formats
    from .pack import Pack

    qc = _config_top(pack).get("quantization_config")
    method = str(qc.get("quant_method", "")).lower() if isinstance(qc, dict) else ""
    own = pack_formats().get(method)
    Pack.open(pack, require_exl3=own is None or own.name == EXL3)


def _require_transformers() -> None:
    """:class:`VerifyError` naming the install when transformers is missing."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise VerifyError(
            'quantpack verify runs the pack through transformers: pip install "transformers>=5.17,<5.20" (the '
            "releases tested; docs/install.md)"
        ) from None


def _file_reference(source: Path, vocab: object) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, logits)`` of a reference logits file, its ids inside the pack's vocabulary of ``vocab``."""
    ids, want = _reference_logits(source)
    if isinstance(vocab, int) and (int(ids.max()) >= vocab or int(ids.min()) < 0):
        raise VerifyError(f"{source}: input_ids outside the pack's vocabulary of {vocab}")
    return ids, want


def _model_reference(pack: Path, source: Path, cfg: dict, tokens: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, logits)`` of the model folder ``source`` (the pack's config ``cfg`` describes the same model) run by
    transformers on the ids of the pack's own reference file, or on ``tokens`` seeded ids (see :func:`verify_pack`)."""
    other = _config(source)
    differ = [k for k in SAME_MODEL if k in cfg and other.get(k) != cfg[k]]
    if differ:
        shown = ", ".join(f"{k} {cfg[k]!r} vs {other.get(k)!r}" for k in differ)
        raise VerifyError(f"{source} is another model than the pack ({shown}): give the pack's bf16 source")
    own = pack / REFERENCE_FILE
    if tokens is None and own.is_file():
        ids = _reference_logits(own)[0]
    else:
        tokens = DEFAULT_TOKENS if tokens is None else tokens
        longest = cfg.get("max_position_embeddings")
        n = min(tokens, longest) if isinstance(longest, int) and longest > 0 else tokens
        ids = torch.randint(0, cfg.get("vocab_size"), (1, n), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return ids, _model(source, quantized=False)(ids).logits


def text_ids(pack: Path, tokens: int) -> torch.Tensor:
    """``[1, tokens]`` ids of :data:`TEXT_FILES` as the pack's ``tokenizer.json`` encodes them (fewer where the text
    is shorter), or :class:`VerifyError` when the pack has no tokenizer the ``tokenizers`` library reads."""
    import sysconfig

    try:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(pack / "tokenizer.json"))
    except Exception as e:  # missing library or file, or the library's own refusal
        raise VerifyError(
            f"{pack}: no {REFERENCE_FILE} and no tokenizer.json to run the pack on text ({type(e).__name__}) - give "
            "--against with the bf16 source model's folder or a reference logits file"
        ) from None
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((stdlib / name).read_text() for name in TEXT_FILES)
    return torch.tensor([tokenizer.encode(text).ids[:tokens]])


def verify_on_text(pack: Path, tokens: int | None = None) -> Verdict:
    """The ``"text"`` verdict (see the module): the pack's mean next-token NLL on :func:`text_ids` against
    :data:`TEXT_BOUND` x ``ln(vocabulary)``.

    Raises:
        VerifyError: no tokenizer, or a pack that does not fit its config's class.
    """
    import math

    from .compare import mean_nll

    ids = text_ids(pack, tokens or TEXT_TOKENS)
    candidate = _model(pack, quantized=True)
    with torch.no_grad():
        logits = candidate(ids).logits
    uniform = math.log(logits.shape[-1])
    return Verdict(None, " + ".join(TEXT_FILES), "text", TEXT_BOUND * uniform, 0.0, mean_nll(logits, ids), uniform)
