"""Carry a file larger than one upload to a machine that accepts a limited number of bytes per upload: split it here
into parts that each fit beside whatever else travels with an upload, keep the parts there as they arrive, one
upload after another, and join them once all are there, checked against the whole file's sha256. Standard library
only; the machine is described by the sizes given, nothing else.

Here::

    python3 ci/transfer/parts.py split FILE --out DIR --label NAME --limit 64MiB [--beside BYTES] [--spare 1MiB]
        # -> DIR/NAME-a/, DIR/NAME-b/, ...: one folder per upload, each holding one part-NN, the whole file's
        #    sha256, the number of parts and the label; --parts N forces N parts; no --limit: one part

There, after each upload that carried one of those folders::

    python3 ci/transfer/parts.py gather DIR... --store STORE    # each folder's part into STORE/<sha256>/
    python3 ci/transfer/parts.py status --store STORE           # "<sha256> <label> <parts here> <parts>" per file
    python3 ci/transfer/parts.py join SHA256 --store STORE --out FILE   # all parts there: joined and checked
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import string
import sys
from pathlib import Path

UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
#: one folder per upload, lettered: at most this many parts
LETTERS = string.ascii_lowercase
CHUNK = 1 << 20


class PartsError(SystemExit):
    """A refusal, its reason printed (exit status 1)."""

    def __init__(self, message: str):
        super().__init__(f"parts.py: {message}")


def size(text: str) -> int:
    """Bytes from ``123``, ``64MiB``, ``1.5GB``.

    Raises:
        argparse.ArgumentTypeError: not a size.
    """
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if not match or match[2].upper() not in UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is no size (e.g. 67108864, 64MiB, 50MB)")
    return int(float(match[1]) * UNITS[match[2].upper()])


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def part_count(total: int, limit: int | None, beside: int, spare: int, forced: int | None) -> tuple[int, int]:
    """How many parts, and the room for one part in an upload (``limit - beside - spare``).

    Raises:
        PartsError: no room at all beside what travels, or more parts than folders can be lettered, or a forced
            count whose parts would not fit.
    """
    room = (limit - beside - spare) if limit is not None else max(total, 1)
    if room <= 0:
        raise PartsError(f"an upload of {limit} bytes leaves no room beside {beside} bytes and {spare} to spare")
    parts = forced or max(1, -(-total // room))
    if parts > len(LETTERS) or -(-total // parts) > room:
        raise PartsError(f"a {total}-byte file in {parts} parts does not fit {room} bytes per upload")
    return parts, room


def split(path: Path, out: Path, label: str, parts: int) -> list[Path]:
    """Write ``parts`` folders ``out/<label>-a`` ... (any of an earlier split of that label removed first), each
    with one ``part-NN`` and the files ``sha256``, ``parts``, ``label``; the folders, in order."""
    for old in out.glob(f"{glob_escape(label)}-?"):
        shutil.rmtree(old)
    total, digest = path.stat().st_size, sha256(path)
    step = -(-total // parts) if total else 0
    folders = []
    with path.open("rb") as src:
        for i in range(parts):
            folder = out / f"{label}-{LETTERS[i]}"
            folder.mkdir(parents=True)
            with (folder / f"part-{i:02d}").open("wb") as dst:
                copy_bytes(src, dst, step)
            (folder / "sha256").write_text(digest + "\n")
            (folder / "parts").write_text(f"{parts}\n")
            (folder / "label").write_text(label + "\n")
            folders.append(folder)
    return folders


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


def copy_bytes(src, dst, count: int) -> None:
    while count > 0 and (block := src.read(min(CHUNK, count))):
        dst.write(block)
        count -= len(block)


def gather(folders: list[Path], store: Path) -> list[Path]:
    """Copy each folder's part (and its file's sha256, count, label) into ``store/<sha256>/``; folders without a
    ``sha256`` are passed over. The parts copied."""
    copied = []
    for folder in folders:
        if not (folder / "sha256").is_file():
            continue
        digest = (folder / "sha256").read_text().strip()
        keep = store / digest
        keep.mkdir(parents=True, exist_ok=True)
        for name in ("sha256", "parts", "label"):
            if (folder / name).is_file():
                shutil.copyfile(folder / name, keep / name)
        for part in sorted(folder.glob("part-*")):
            shutil.copyfile(part, keep / part.name)
            copied.append(keep / part.name)
    return copied


def status(store: Path) -> list[tuple[str, str, int, int]]:
    """``(sha256, label, parts here, parts)`` of each file in ``store``."""
    out = []
    for keep in sorted(p for p in store.glob("*") if (p / "sha256").is_file()):
        label = (keep / "label").read_text().strip() if (keep / "label").is_file() else "?"
        out.append((keep.name, label, len(list(keep.glob("part-*"))), int((keep / "parts").read_text())))
    return out


def join(digest: str, store: Path, dest: Path) -> Path:
    """Concatenate the parts of ``digest`` in order into ``dest`` and check the sha256.

    Raises:
        PartsError: parts missing, or the joined file's sha256 is not ``digest`` (``dest`` removed).
    """
    keep = store / digest
    parts = sorted(keep.glob("part-*"))
    need = int((keep / "parts").read_text()) if (keep / "parts").is_file() else None
    if need is None or len(parts) != need:
        raise PartsError(f"{digest[:12]}: {len(parts)} of {need or '?'} parts in {keep}: carry the others first")
    with dest.open("wb") as out:
        for part in parts:
            with part.open("rb") as src:
                shutil.copyfileobj(src, out, CHUNK)
    if sha256(dest) != digest:
        dest.unlink()
        raise PartsError(f"the joined parts of {digest[:12]} do not match their sha256: a part is damaged")
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("split", help="split FILE into one folder per upload")
    sp.add_argument("file", type=Path)
    sp.add_argument("--out", type=Path, required=True)
    sp.add_argument("--label", required=True, help="names the folders (LABEL-a, LABEL-b, ...) and the file there")
    sp.add_argument("--limit", type=size, help="bytes one upload may carry in all (none: one part)")
    sp.add_argument("--beside", type=size, default=0, help="bytes that travel with every upload besides a part")
    sp.add_argument("--spare", type=size, default=2**20, help="bytes kept free in every upload (default 1 MiB)")
    sp.add_argument("--parts", type=int, help="this many parts, if they fit")
    gp = sub.add_parser("gather", help="keep the parts of the folders given")
    gp.add_argument("folders", nargs="*", type=Path)
    for p in (gp, sub.add_parser("status", help="the files in the store")):
        p.add_argument("--store", type=Path, required=True)
    jp = sub.add_parser("join", help="join a file's parts, checked")
    jp.add_argument("sha256")
    jp.add_argument("--store", type=Path, required=True)
    jp.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.cmd == "split":
        total = args.file.stat().st_size
        parts, room = part_count(total, args.limit, args.beside, args.spare, args.parts)
        folders = split(args.file, args.out, args.label, parts)
        print(f"{args.file.name}: {total} bytes in {parts} parts of at most {room} bytes: carry "
              f"{folders[0]} .. {folders[-1]}, one an upload")  # fmt: skip
    elif args.cmd == "gather":
        print(f"{len(gather(args.folders, args.store))} parts kept in {args.store}")
    elif args.cmd == "status":
        print("\n".join(" ".join(map(str, row)) for row in status(args.store)))
    else:
        print(join(args.sha256, args.store, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
