"""Cut the CUDA device code embedded in shared libraries down to what one GPU architecture loads.

A CUDA library carries its kernels in the ELF section ``.nv_fatbin``: a run of fat binary containers (header magic
0xBA55ED50), each holding one image per target architecture, SASS (``cubin``) for exact architectures and PTX that
the driver compiles for newer ones. The slim vLLM bundle only runs on Hopper, so for every container this keeps:

- the SASS images for the target architecture (sm_90 and sm_90a both report 90), when there is one;
- otherwise the PTX of the highest architecture not above the target (what the driver would JIT-compile);
- otherwise the container as it is (nothing in it loads on the target; such kernels fail to launch there either
  way, and leaving them untouched keeps every registration valid).

The kept images move to the front of their container, the container's size field shrinks, and the freed bytes are
zeroed, so the library keeps its layout (every container starts where it did) and compresses well.

Usage::

    python3 prune_fatbin.py [--arch 90] FILE...          # rewrite each FILE in place
    python3 prune_fatbin.py [--arch 90] --check FILE...  # report; exit 1 if a FILE holds other usable images
"""

from __future__ import annotations

import argparse
import struct
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

CONTAINER_MAGIC = 0xBA55ED50
#: image kinds in an entry header
PTX, SASS = 1, 2
KIND_NAMES = {PTX: "ptx", SASS: "sass"}


@dataclass(frozen=True)
class Image:
    """One image of a container: its offset in the file, header and padded payload sizes, kind and architecture."""

    offset: int
    header_size: int
    payload_size: int
    kind: int
    arch: int

    @property
    def size(self) -> int:
        return self.header_size + self.payload_size

    @property
    def label(self) -> str:
        return f"{KIND_NAMES.get(self.kind, f'kind{self.kind}')}:sm_{self.arch}"


@dataclass(frozen=True)
class Container:
    """One fat binary container: its offset, header size, size of its images, and the images."""

    offset: int
    header_size: int
    body_size: int
    images: tuple[Image, ...]


def fatbin_section(data: bytes) -> tuple[int, int] | None:
    """File offset and size of the ``.nv_fatbin`` section of a 64-bit little-endian ELF file; None without one."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    (sh_off,) = struct.unpack_from("<Q", data, 0x28)
    sh_entsize, sh_num, sh_strndx = struct.unpack_from("<HHH", data, 0x3A)
    if sh_off == 0 or sh_num == 0:
        return None
    headers = [struct.unpack_from("<IIQQQQ", data, sh_off + i * sh_entsize) for i in range(sh_num)]
    names_offset = headers[sh_strndx][4]
    for name_index, _type, _flags, _addr, offset, size in headers:
        start = names_offset + name_index
        if data[start : data.index(b"\0", start)] == b".nv_fatbin":
            return offset, size
    return None


def read_containers(data: bytes, start: int, size: int) -> list[Container]:
    """The containers of a ``.nv_fatbin`` section (8-byte padding between them is skipped)."""
    containers = []
    position, end = start, start + size
    while position + 16 <= end:
        magic, _version, header_size, body_size = struct.unpack_from("<IHHQ", data, position)
        if magic != CONTAINER_MAGIC:
            position += 8
            continue
        images = []
        cursor, body_end = position + header_size, position + header_size + body_size
        while cursor < body_end:
            kind, _version, image_header, payload = struct.unpack_from("<HHIQ", data, cursor)
            if image_header == 0:
                break
            (arch,) = struct.unpack_from("<I", data, cursor + 28)
            images.append(Image(cursor, image_header, payload, kind, arch))
            cursor += image_header + payload
        if sum(image.size for image in images) != body_size:
            raise ValueError(f"container at {position:#x}: images do not fill its {body_size} bytes")
        containers.append(Container(position, header_size, body_size, tuple(images)))
        position += header_size + body_size
    return containers


def usable(images: tuple[Image, ...], arch: int) -> tuple[list[Image], str]:
    """The images of one container that a GPU of ``arch`` loads, and which kind they are ("sass", "ptx", "none")."""
    sass = [image for image in images if image.kind == SASS and image.arch == arch]
    if sass:
        return sass, "sass"
    ptx = [image for image in images if image.kind == PTX and image.arch <= arch]
    if ptx:
        best = max(image.arch for image in ptx)
        return [image for image in ptx if image.arch == best], "ptx"
    return [], "none"


def prune(path: Path, arch: int) -> dict[str, int]:
    """Rewrite ``path`` in place keeping only ``arch``'s images (see the module's docstring); returns counts."""
    data = bytearray(path.read_bytes())
    section = fatbin_section(bytes(data))
    stats = Counter(sass=0, ptx=0, none=0, before=0, after=0)
    if section is None:
        return dict(stats)
    for container in read_containers(bytes(data), *section):
        keep, kind = usable(container.images, arch)
        stats[kind] += 1
        stats["before"] += container.body_size
        if kind == "none":
            stats["after"] += container.body_size
            continue
        body = b"".join(bytes(data[image.offset : image.offset + image.size]) for image in keep)
        start = container.offset + container.header_size
        data[start : start + container.body_size] = body + bytes(container.body_size - len(body))
        struct.pack_into("<Q", data, container.offset + 8, len(body))
        stats["after"] += len(body)
    mode = path.stat().st_mode
    temporary = path.with_name(path.name + ".pruning")
    temporary.write_bytes(data)
    temporary.chmod(mode)
    temporary.replace(path)
    return dict(stats)


def check(path: Path, arch: int) -> tuple[bool, str]:
    """Whether every container of ``path`` holds only images ``arch`` loads (or none it loads), and a summary."""
    data = path.read_bytes()
    section = fatbin_section(data)
    if section is None:
        return True, "no device code"
    kinds, foreign, labels = Counter(), Counter(), Counter()
    for container in read_containers(data, *section):
        keep, kind = usable(container.images, arch)
        kinds[kind] += 1
        labels.update(image.label for image in container.images)
        if kind != "none" and len(keep) != len(container.images):
            foreign.update(image.label for image in container.images if image not in keep)
    summary = f"containers {dict(kinds)}, images {dict(sorted(labels.items()))}"
    if foreign:
        summary += f", beside sm_{arch} images: {dict(foreign)}"
    return not foreign, summary


def main(argv: list[str] | None = None) -> int:
    """Command line: prune the given files, or with ``--check`` report on them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="the SM architecture to keep (default: 90)")
    parser.add_argument("--check", action="store_true", help="report only; exit 1 if other images remain")
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args(argv)
    failed = False
    for path in args.files:
        if args.check:
            ok, summary = check(path, args.arch)
            failed |= not ok
            print(f"{'ok' if ok else 'NOT CUT'} {path}: {summary}")
        else:
            s = prune(path, args.arch)
            print(
                f"{path}: containers sass {s['sass']}, ptx {s['ptx']}, none (left) {s['none']}; "
                f"device code {s['before']} -> {s['after']} bytes"
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
