"""The pages of checkpoint files a captured tensor occupies, handed back once the tensor has been turned into its
kernel's form.

vLLM reads safetensors shards through ``safe_open``, whose tensors are views of a private memory map of the whole
file; the placeholders (:mod:`.params`) keep those views until their layer is processed, so every page a layer's
processing reads stays in the process's RSS (as ``RssFile``) until the last tensor of that file is dropped - on a
pack whose head shares the first shard with the early layers, that is the end of the load. After a layer is
processed its captured tensors' pages are reclaimed with ``madvise(MADV_PAGEOUT)`` (Linux 5.4+): a hint that never
changes what memory holds (a clean file page is dropped and read back from the file if a neighbouring tensor on the
same page is read later; a page this process wrote to would need swap, so it stays). Only private file mappings are
advised; anonymous memory (the ``eager`` load strategy's buffers, tensors built in memory) is never touched.

Linux only (``/proc/self/maps``, ``madvise``); elsewhere, or on an older kernel, a no-op. Source: madvise(2),
proc_pid_maps(5).
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import sys

import torch

#: madvise(2) advice: reclaim these pages (their content is kept: a file page is read back from the file)
MADV_PAGEOUT = 21
PAGE = mmap.PAGESIZE

#: private file mappings of this process: sorted starts, and (start, end) by start
_starts: list[int] = []
_ranges: list[tuple[int, int]] = []


def _read_maps() -> None:
    """Refresh the private file mappings from ``/proc/self/maps``."""
    found = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            # "start-end perms offset dev inode path": readable, private, with a file path (safetensors maps rw-p)
            if len(parts) == 6 and parts[1][0] == "r" and parts[1][3] == "p" and parts[5].startswith("/"):
                a, b = parts[0].split("-")
                found.append((int(a, 16), int(b, 16)))
    found.sort()
    _ranges[:] = found
    _starts[:] = [a for a, _ in found]


def _mapping(address: int) -> tuple[int, int] | None:
    """The private file mapping holding ``address``, if any."""
    for refresh in (False, True):
        if refresh:
            _read_maps()
        i = bisect.bisect_right(_starts, address) - 1
        if i >= 0 and _ranges[i][0] <= address < _ranges[i][1]:
            return _ranges[i]
    return None


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc


_LIBC = _libc()


def drop_file_pages(tensors: list[torch.Tensor]) -> int:
    """Reclaim the pages of ``tensors`` that lie in a private file mapping (their content stays as it was).

    Args:
        tensors: CPU tensors (others are skipped), e.g. a layer's captured checkpoint views once processed.

    Returns:
        bytes of address range advised (0 off Linux, on a kernel without ``MADV_PAGEOUT``, or when no tensor lies
        in such a mapping).
    """
    if _LIBC is None:
        return 0
    advised = 0
    for t in tensors:
        if t.device.type != "cpu" or t.numel() == 0:
            continue
        begin = t.data_ptr()
        span = _mapping(begin)
        if span is None:
            continue
        end = begin + (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))) * t.element_size()
        a = begin // PAGE * PAGE
        b = min(-(-end // PAGE) * PAGE, span[1])
        if b > a and _LIBC.madvise(a, b - a, MADV_PAGEOUT) == 0:
            advised += b - a
    return advised
