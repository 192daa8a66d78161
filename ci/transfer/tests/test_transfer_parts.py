"""ci/transfer/parts.py: a file split into parts that each fit an upload beside what travels with it, kept as the
uploads arrive (in any order, a second file's parts beside the first's), joined byte for byte once all are there;
a missing or damaged part, and sizes that leave no room, refused with the reason."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
TOOL = ROOT / "ci" / "transfer" / "parts.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("transfer_parts", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


parts = load_tool()


def tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, check=False)


@pytest.fixture
def big(tmp_path) -> Path:
    path = tmp_path / "bundle.tar.xz"
    path.write_bytes(os.urandom(100_000) + b"tail")
    return path


def test_parts_fit_the_upload_and_join_to_the_file(big, tmp_path):
    out, store = tmp_path / "stage", tmp_path / "store"
    done = tool("split", str(big), "--out", str(out), "--label", "vllm-0.25.1", "--limit", "40000",
                "--beside", "9000", "--spare", "1000")  # fmt: skip
    assert done.returncode == 0, done.stderr
    folders = sorted(out.iterdir())
    assert [f.name for f in folders] == ["vllm-0.25.1-a", "vllm-0.25.1-b", "vllm-0.25.1-c", "vllm-0.25.1-d"]
    assert all(sum(p.stat().st_size for p in f.iterdir()) + 9000 + 1000 <= 40000 for f in folders)
    digest = parts.sha256(big)
    for i, folder in enumerate(reversed(folders)):  # the uploads arrive in any order
        assert tool("gather", str(folder), str(tmp_path / "no-such-folder"), "--store", str(store)).returncode == 0
        have = tool("status", "--store", str(store)).stdout.split()
        assert have == [digest, "vllm-0.25.1", str(i + 1), "4"]
        if i < 3:
            refused = tool("join", digest, "--store", str(store), "--out", str(tmp_path / "joined"))
            assert refused.returncode == 1 and f"{i + 1} of 4 parts" in refused.stderr
    assert tool("join", digest, "--store", str(store), "--out", str(tmp_path / "joined")).returncode == 0
    assert (tmp_path / "joined").read_bytes() == big.read_bytes()


def test_a_second_file_keeps_its_own_parts_and_a_new_split_replaces_the_old(big, tmp_path):
    other = tmp_path / "other.bin"
    other.write_bytes(b"x" * 10)
    out, store = tmp_path / "stage", tmp_path / "store"
    first = parts.split(big, out, "vllm-0.22.1", 3)
    parts.split(big, out, "vllm-0.22.1", 2)  # staged again: the three old folders go
    assert sorted(f.name for f in out.iterdir()) == ["vllm-0.22.1-a", "vllm-0.22.1-b"]
    second = parts.split(other, out, "vllm-0.26.0", 1)
    parts.gather([*sorted(out.iterdir())], store)
    rows = {row[1]: row[2:] for row in parts.status(store)}
    assert rows == {"vllm-0.22.1": (2, 2), "vllm-0.26.0": (1, 1)} and len(first) == 3 and len(second) == 1


def test_a_damaged_part_is_refused(big, tmp_path):
    out, store = tmp_path / "stage", tmp_path / "store"
    folders = parts.split(big, out, "b", 2)
    parts.gather(folders, store)
    digest = parts.sha256(big)
    part = store / digest / "part-01"
    part.write_bytes(part.read_bytes()[:-1] + b"!")
    with pytest.raises(SystemExit, match="do not match their sha256"):
        parts.join(digest, store, tmp_path / "joined")
    assert not (tmp_path / "joined").exists()


def test_sizes_that_leave_no_room_are_refused():
    assert parts.part_count(100, None, 0, 0, None) == (1, 100)  # no limit: one part
    assert parts.part_count(100, 60, 10, 0, None) == (2, 50)
    with pytest.raises(SystemExit, match="leaves no room beside 60 bytes"):
        parts.part_count(100, 60, 60, 0, None)
    with pytest.raises(SystemExit, match="in 2 parts does not fit 40 bytes"):
        parts.part_count(100, 50, 10, 0, 2)
    with pytest.raises(SystemExit, match="in 27 parts"):
        parts.part_count(27, 1, 0, 0, None)
    assert parts.size("64MiB") == 64 * 2**20 and parts.size("50MB") == 50 * 10**6 and parts.size("7") == 7
    refused = tool("split", "x", "--out", "o", "--label", "l", "--limit", "lots")
    assert refused.returncode == 2 and "'lots' is no size" in refused.stderr
