"""``quantpack escha-from-exl3``: the converter's command, added to quantpack-core's ``quantpack`` CLI through the
``quantpack.commands`` entry point."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from quantpack_core.cli_options import output_dir


@click.command("escha-from-exl3")
@click.argument("pack", type=click.Path(path_type=Path))
@click.option(
    "--out", type=click.Path(), callback=output_dir, required=True, help="Directory for the escha pack (new)."
)
@click.option(
    "--random-split",
    is_flag=True,
    help="Test device: split each scale into escha's pre / post pair at random (default: s_in = s_out = 1, the same "
    "output for the same input).",
)
@click.option(
    "--biases", is_flag=True, help="Test device: a random nonzero bias per coded module (escha never applies it)."
)
@click.option(
    "--seed",
    type=click.IntRange(0, 2**63 - 1),
    default=0,
    show_default=True,
    help="Seed of --random-split and --biases (0 to 2**63 - 1, torch's generator seed).",
)
def escha_from_exl3(pack: Path, out: Path, random_split: bool, biases: bool, seed: int) -> None:
    """Rewrite an mcg-coded EXL3 PACK as an escha pack in OUT (docs/escha-format.md); the same PACK gives the same
    files. Bad input exits with status 2, as the other ``quantpack`` commands do."""
    from quantpack_core.errors import QuantpackError

    from .convert import escha_from_exl3 as convert

    try:
        r = convert(pack, out, seed=seed, biases=biases, random_split=random_split)
    except (QuantpackError, OSError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    ks = sorted(set(r.coded.values()))
    click.echo(
        f"{len(r.coded)} coded modules (K {', '.join(map(str, ks))}), int8 tables {', '.join(r.int8_tables)}"
        f"{', random scale split' if random_split else ''}{', random biases' if r.biases else ''}; written to "
        f"{r.out_dir}"
    )
