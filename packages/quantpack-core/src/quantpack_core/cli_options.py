"""Option types shared by the ``quantpack`` commands of every quantpack package (kept out of ``quantpack_core.cli``,
which loads the other packages' commands when it is imported)."""

from __future__ import annotations

from pathlib import Path

import click


def output_dir(ctx: click.Context, param: click.Parameter, value: str | None) -> Path | None:
    """Click callback of an ``--out DIR`` option declared with ``type=click.Path()``: the path, or None when the
    option was not given.

    Raises:
        click.BadParameter: an empty string (``--out ""``, e.g. an unset shell variable), which ``Path`` would read
            as the current directory.
    """
    if value is None:
        return None
    if not value.strip():
        raise click.BadParameter("is empty; give the directory to write (a shell variable may be unset)")
    return Path(value)
