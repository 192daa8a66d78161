"""``quantpack serve`` before vLLM starts: the CPU defaults from a pack's sizes and the machine's memory, a Hugging
Face repository's bitrate branch resolved through huggingface_hub (a local mirror of the Hub's cache layout, offline),
the start-up progress the plugins report, and the command line's speed (no torch or vLLM imported for --help).
The server itself: quantpack-exl3's test_exl3_serve.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from quantpack_core.errors import PackError
from quantpack_core.kernels import KernelLog
from quantpack_core.progress import PROGRESS_ENV, read_progress
from quantpack_core.serve import GIB, PackSizes, ServeError, cpu_defaults, health_url, option, pack_sizes, resolve_model

LLAMA = "llama-tiny-exl3-4.0bpw-mul1"


def test_pack_sizes_of_the_bundled_pack(fixtures_dir):
    """KV per token: 4 attention layers x 2 KV heads x 64 features x K and V x 2 bytes (bfloat16) = 2 KiB; weights as
    served: every coded module's stored (in x out) in the serving dtype plus the other tensors as stored."""
    folder = fixtures_dir / LLAMA
    config = json.loads((folder / "config.json").read_text())
    sizes = pack_sizes(folder, None, 1, None)
    assert sizes.kv_per_token == 4 * 2 * 64 * 2 * 2 and sizes.max_positions == config["max_position_embeddings"]
    h, i, v, layers = config["hidden_size"], config["intermediate_size"], config["vocab_size"], 4
    padded_i = -(-i // 128) * 128
    coded = layers * (h * h * 2 + h * 128 * 2 + 3 * h * padded_i) + h * v  # q, o; k, v (2 heads x 64); mlp; head
    dense = v * h * 2 + (2 * layers + 1) * h * 2  # embedding, norms (bfloat16)
    assert sizes.weights == coded * 2 + dense
    assert pack_sizes(folder, "float32", 1, None).weights == coded * 4 + dense
    assert pack_sizes(folder, None, 2, None).kv_per_token == 4 * 1 * 64 * 2 * 2  # one KV head per rank


def test_cpu_defaults_fit_the_memory():
    """An 8B-like model (16.4 GiB served, 144 KiB KV per token, 40,960 positions): 32 GiB available leave 12.6 GiB
    beside the weights and the 3 GiB reserve, half of it (floored to 6 GiB) for the KV cache, which holds 43,690
    tokens: the model's whole 40,960. With 20 GiB: 1 GiB (the least), 7,280 tokens."""
    sizes = PackSizes(weights=int(16.4 * GIB), kv_per_token=147456, max_positions=40960)
    big = cpu_defaults(sizes, "m", [], {}, available=32 * GIB)
    assert big.env == {"VLLM_CPU_KVCACHE_SPACE": "6"}
    assert big.args == ["--max-model-len", "40960", "--served-model-name", "m"]
    small = cpu_defaults(sizes, "m", [], {}, available=20 * GIB)
    assert small.env == {"VLLM_CPU_KVCACHE_SPACE": "1"} and small.args[:2] == ["--max-model-len", "7280"]
    assert "VLLM_CPU_KVCACHE_SPACE=1" in small.summary and "20.0 GiB" in small.summary and "note" not in small.summary
    short = cpu_defaults(sizes, "m", [], {}, available=16 * GIB)  # less than the weights and the reserve
    assert short.env == {"VLLM_CPU_KVCACHE_SPACE": "1"} and "need about 19.4 GiB" in short.summary


def test_cpu_defaults_keep_what_is_given():
    """A given KV space sets the length it allows; a given length sizes the KV cache to hold it; a given name and
    length add nothing."""
    sizes = PackSizes(weights=GIB, kv_per_token=2048, max_positions=1 << 20)
    kv_given = cpu_defaults(sizes, "m", [], {"VLLM_CPU_KVCACHE_SPACE": "2"}, available=64 * GIB)
    assert kv_given.env == {} and kv_given.args[:2] == ["--max-model-len", str(2 * GIB // 2048)]
    long = cpu_defaults(sizes, "m", ["--max-model-len=900000"], {}, available=8 * GIB)
    assert long.env == {"VLLM_CPU_KVCACHE_SPACE": "2"}  # 900,000 x 2 KiB = 1.7 GiB, rounded up past the share
    assert long.args == ["--served-model-name", "m"]
    given = ["--served-model-name", "x", "--max-model-len", "64"]
    none = cpu_defaults(sizes, "m", given, {"VLLM_CPU_KVCACHE_SPACE": "1"}, 8 * GIB)
    assert none.env == {} and none.args == [] and "as given" in none.summary


def test_options_and_the_health_url():
    args = ["--port", "8001", "--host=0.0.0.0", "-tp", "2", "--port=8002"]
    assert option(args, "--port") == "8002" and option(args, "--tensor-parallel-size", "-tp") == "2"
    assert health_url(args) == "http://127.0.0.1:8002"
    assert health_url([]) == "http://127.0.0.1:8000" and health_url(["--host", "::"]) == "http://[::1]:8000"


def test_a_local_folder_and_bad_names(fixtures_dir, tmp_path):
    folder, name = resolve_model(str(fixtures_dir / LLAMA), None)
    assert folder == (fixtures_dir / LLAMA).resolve() and name == LLAMA
    with pytest.raises(ServeError, match="is a local folder: --revision names a branch"):
        resolve_model(str(fixtures_dir / LLAMA), "4.0bpw")
    with pytest.raises(ServeError, match="no such folder, and not a Hugging Face repository id"):
        resolve_model(str(tmp_path / "missing"), None)


def test_a_symlinked_folder_is_served_by_its_own_name(fixtures_dir, tmp_path):
    """The served name is the given folder's name (docs/install.md), not a symlink target's."""
    link = tmp_path / "my-model"
    link.symlink_to(fixtures_dir / LLAMA, target_is_directory=True)
    folder, name = resolve_model(str(link), None)
    assert folder == (fixtures_dir / LLAMA).resolve() and name == "my-model"
    assert resolve_model(f"{link}/", None)[1] == "my-model"


@pytest.mark.parametrize("config", [None, "{not json", "[]"])
def test_a_missing_or_invalid_config_is_named_by_the_pack_check(fixtures_dir, tmp_path, config):
    """A folder without config.json, or with one that is no JSON object: the pack check names it (a raw
    FileNotFoundError / JSONDecodeError traceback before)."""
    folder = tmp_path / "p"
    shutil.copytree(fixtures_dir / LLAMA, folder)
    if config is None:
        (folder / "config.json").unlink()
    else:
        (folder / "config.json").write_text(config)
    with pytest.raises(PackError, match=r"config\.json: "):
        pack_sizes(folder, None, 1, None)


@pytest.mark.parametrize("space", ["4GiB", "1.5", ""])
def test_a_kv_cache_space_that_is_no_whole_number(space):
    """VLLM_CPU_KVCACHE_SPACE is read by vLLM with int(): 4GiB crashed here (ValueError), 1.5 passed and vLLM died."""
    sizes = PackSizes(weights=GIB, kv_per_token=2048, max_positions=1 << 20)
    said = re.escape(f"VLLM_CPU_KVCACHE_SPACE is {space!r}: it must be a whole number of GiB")
    with pytest.raises(ServeError, match=said):
        cpu_defaults(sizes, "m", [], {"VLLM_CPU_KVCACHE_SPACE": space}, available=64 * GIB)


def _hub_mirror(cache: Path, repo: str, branches: dict[str, Path]) -> dict[str, Path]:
    """huggingface_hub's cache layout for ``repo``: per branch a ref naming a commit whose snapshot holds the files
    of a folder (the layout an EXL3 repository's bitrate branches take once downloaded); branch -> snapshot."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshots = {}
    for i, (branch, src) in enumerate(branches.items()):
        commit = f"{i + 1:040x}"
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / branch).write_text(commit)
        snapshots[branch] = root / "snapshots" / commit
        shutil.copytree(src, snapshots[branch])
    return snapshots


def _resolve_offline(cache: Path, repo: str, revision: str | None) -> subprocess.CompletedProcess:
    code = "import sys; from quantpack_core.serve import resolve_model; print(resolve_model(sys.argv[1], sys.argv[2] or None)[0])"  # noqa: E501
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code, repo, revision or ""], capture_output=True, text=True, env=env)


def test_a_repository_s_bitrate_branch_resolves_through_snapshot_download(fixtures_dir, tmp_path):
    """An EXL3 repository with one bitrate per branch: --revision 4.0bpw gives that branch's snapshot, 3.0bpw the
    other; a branch the repository lacks is an error naming it and the fix."""
    pytest.importorskip("huggingface_hub")
    repo = "someone/llama-tiny-exl3"
    packs = {"4.0bpw": fixtures_dir / LLAMA, "3.0bpw": fixtures_dir / "llama-tiny-exl3-3.0bpw-3inst-h8"}
    snapshots = _hub_mirror(tmp_path / "hub", repo, packs)
    for branch, snapshot in snapshots.items():
        out = _resolve_offline(tmp_path / "hub", repo, branch)
        assert out.returncode == 0, out.stderr
        assert Path(out.stdout.strip()) == snapshot
    missing = _resolve_offline(tmp_path / "hub", repo, "5.0bpw")
    assert (
        missing.returncode != 0 and f"{repo}@5.0bpw: not in the local cache, and it cannot be fetched" in missing.stderr
    )


def test_the_kernel_log_reports_progress(tmp_path, monkeypatch):
    """Each expected layer processed appends (done, total) for quantpack serve's bar; two processes add up."""
    path = tmp_path / "progress"
    monkeypatch.setenv(PROGRESS_ENV, str(path))
    log, layers = KernelLog("t"), [object() for _ in range(3)]
    for layer in layers:
        log.expect(layer)
    log.finish(layers[0])
    log.finish(layers[0])  # twice: counted once
    assert read_progress(path) == (1, 3)
    log.forget(layers[2])
    log.finish(layers[1])
    assert read_progress(path) == (2, 2)
    with path.open("a") as f:
        f.write("modules 5 7 999999\n")  # another worker
    assert read_progress(path) == (7, 9)
