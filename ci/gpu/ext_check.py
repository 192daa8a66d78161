"""Whether a process started as vLLM starts its engine process (multiprocessing's spawn) loads the same exllamav3
extension file as this one, within a time limit (ci/gpu/setup.sh runs it once the prebuilt extension has loaded).

A spawned child that is still importing after the limit is waiting on a JIT build: the prebuilt file was not found
on its path, and torch's JIT then builds or, where a killed build left its lock, waits forever. Usage:
``python3 ci/gpu/ext_check.py [SECONDS]`` (default 120); exit 0 when both processes load the same file.
"""

from __future__ import annotations

import multiprocessing
import sys


def origin() -> str:
    """The file of the exllamav3 extension this process loads (quantpack-exl3's loader, as the plugin does)."""
    from quantpack_exl3.backends.exllamav3.extension import load_extension

    return load_extension().__file__


def main(limit: float) -> int:
    here = origin()
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # leaving the block terminates a child still waiting
        try:
            there = pool.apply_async(origin).get(timeout=limit)
        except multiprocessing.TimeoutError:
            waits = "a JIT build, or its lock under $TORCH_EXTENSIONS_DIR"
            print(f"exllamav3 extension: a spawned process still imports it after {limit:g} s ({waits}); here: {here}")
            return 1
    print(f"exllamav3 extension: {here} here, {there} in a spawned process")
    return 0 if there == here else 1


if __name__ == "__main__":
    sys.exit(main(float(sys.argv[1]) if len(sys.argv) > 1 else 120.0))
