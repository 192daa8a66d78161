"""The end-to-end jobs the vLLM tests share (run once per session by conftest's ``e2e`` fixture through
vllm_e2e.py)."""

import os
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
from e2e_runner import get, run_runner  # noqa: F401  (re-exported: the tests import them from here)

LLAMA_PACKS = [
    "llama-tiny-exl3-4.0bpw-mul1",
    "llama-tiny-exl3-4.0bpw-mcg",
    "llama-tiny-exl3-3.0bpw-3inst-h8",
    "llama-tiny-exl3-2.5bpw-mul1",
]
MAIN_PACK = LLAMA_PACKS[0]
#: Qwen3-MoE packs (8 experts, top-2): two exllamav3 quantizations and one with four (K gate/up, K down) groups
MOE_PACKS = [
    "qwen3moe-tiny-exl3-4.0bpw-mul1",
    "qwen3moe-tiny-exl3-3.0bpw-mul1-hq",
    "qwen3moe-tiny-exl3-mixed-k",
]
MIXED_PACK = MOE_PACKS[2]
#: Qwen3-Next: GDN + gated attention, 8 experts + a shared expert; its vLLM file builds embed_tokens / lm_head
#: without a quant config. vLLM's CPU GDN kernel takes bfloat16 only.
NEXT_PACK = "qwen3next-tiny-exl3-4.0bpw-mul1"
#: a one-layer EAGLE draft for MAIN_PACK without embed_tokens / lm_head (fixtures/tools/make_llama_eagle_draft.py)
DRAFT = "llama-tiny-eagle-draft"
STDLIB_FILES = [
    "textwrap.py",
    "heapq.py",
    "bisect.py",
    "fnmatch.py",
    "colorsys.py",
    "shlex.py",
    "calendar.py",
    "statistics.py",
]


def stdlib_tokens(tokenizer_json: Path, rows: int = 8, length: int = 256) -> list[list[int]]:
    """8 x 256 tokens of Python standard-library source (this interpreter's), one file per row."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    out = []
    for name in STDLIB_FILES[:rows]:
        text = (Path(sysconfig.get_paths()["stdlib"]) / name).read_text()
        ids = tok.encode(text).ids
        assert len(ids) >= length, name
        out.append(ids[:length])
    return out


def broken_pack(fixtures_dir: Path, dst: Path) -> Path:
    """A copy of the main pack whose down_proj trellis of layer 2 lost its last 4 words per tile (an illegal width)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(fixtures_dir / MAIN_PACK, dst)
    (dst / "model.safetensors").unlink()
    tensors = load_file(str(fixtures_dir / MAIN_PACK / "model.safetensors"))
    name = "model.layers.2.mlp.down_proj.trellis"
    tensors[name] = tensors[name][..., :60].contiguous()
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "quantization_config.json").unlink()
    return dst


def trellis_router_pack(src: Path, dst: Path) -> Path:
    """A copy of MoE pack ``src`` whose layer-0 router (``mlp.gate``) is stored as a random 4-bit mul1 EXL3 layer
    (exllamav3 keeps routers dense; vLLM builds Qwen3-MoE's with the quantization config, Qwen3-Next's without)."""
    from safetensors import safe_open

    from quantpack_core.synthetic import random_exl3_layer, replace_module

    module = "model.layers.0.mlp.gate"
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        out_features, in_features = f.get_slice(f"{module}.weight").get_shape()
    layer = random_exl3_layer(in_features, out_features, 4, "mul1", generator=torch.Generator().manual_seed(0))
    return replace_module(src, dst, module, layer)


def padded_vocabulary_pack(src: Path, dst: Path) -> tuple[Path, Path]:
    """A copy of pack ``src`` whose config.json says ``vocab_size`` 1000 over its 1,024 stored rows (the fixtures'
    tokenizer has 1,000 tokens), and its reference logits over those 1,000; returns ``(pack, reference file)``."""
    import json

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "vocab_size": 1000}))
    ref = torch.load(src / "reference_logits.pt")
    (dst / "reference_logits.pt").unlink()
    torch.save({"input_ids": ref["input_ids"], "logits": ref["logits"][..., :1000]}, dst.parent / f"{dst.name}.ref.pt")
    return dst, dst.parent / f"{dst.name}.ref.pt"


def per_position_kl(ref_logits: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """KL(reference || served) per position, nats: ``ref_logits (1, T, V)`` (logits or log-probabilities) against
    ``lp (T', V)`` log-probabilities, over the first ``T'`` positions, in float64."""
    a = ref_logits[0, : lp.shape[0]].double().log_softmax(-1)
    return (a.exp() * (a - lp.double())).sum(-1)


def run_jobs(fixtures_dir: Path, tmp: Path) -> dict:
    """Every end-to-end job in one vLLM process; returns {job id: result}."""
    tokens = stdlib_tokens(fixtures_dir / MAIN_PACK / "tokenizer.json")
    jobs = {}
    for name in LLAMA_PACKS:
        for dtype in ("float32", "bfloat16"):
            jobs[f"logits/{name}/{dtype}"] = {
                "kind": "logits",
                "pack": str(fixtures_dir / name),
                "dtype": dtype,
                "eager": True,
            }
    jobs["compiled"] = {"kind": "logits", "pack": str(fixtures_dir / MAIN_PACK), "dtype": "float32", "eager": False}
    for dtype in ("float32", "bfloat16"):
        jobs[f"nll/{dtype}"] = {"kind": "nll", "pack": str(fixtures_dir / MAIN_PACK), "dtype": dtype, "tokens": tokens}
    jobs["bad"] = {"kind": "load_error", "pack": str(broken_pack(fixtures_dir, tmp / "broken"))}
    for name in LLAMA_PACKS:  # int8 embedding rows against the same pack with its bf16 table
        from quantpack_core.embedding import convert_embedding_int8

        int8 = convert_embedding_int8(fixtures_dir / name, tmp / f"{name}-int8").out_dir
        jobs[f"logits/{name}/float32"]["save"] = str(tmp / f"{name}.lp.pt")
        jobs[f"int8/{name}"] = {
            "kind": "logits",
            "pack": str(int8),
            "dtype": "float32",
            "eager": True,
            "reference": str(fixtures_dir / name / "reference_logits.pt"),
            "save": str(tmp / f"{name}-int8.lp.pt"),
        }
    # MoE: every Qwen3-MoE pack in float32 with the routers' picks recorded; the mixed-K pack also compiled and
    # in bfloat16; Qwen3-Next (bfloat16 only on CPU) with its bf16 table and after embed-int8
    for name in MOE_PACKS:
        jobs[f"moe/{name}"] = {
            "kind": "logits",
            "pack": str(fixtures_dir / name),
            "dtype": "float32",
            "eager": True,
            "routing": True,
            "save": str(tmp / f"{name}.lp.pt"),
        }
    jobs["moe/compiled"] = {
        "kind": "logits",
        "pack": str(fixtures_dir / MIXED_PACK),
        "dtype": "float32",
        "eager": False,
    }
    jobs["moe/bf16"] = {"kind": "logits", "pack": str(fixtures_dir / MIXED_PACK), "dtype": "bfloat16", "eager": True}
    # a router stored as an EXL3 trellis: served where vLLM builds it with the quantization config (Qwen3-MoE),
    # refused in the user's process where it does not (Qwen3-Next)
    jobs["moe/trellis-router"] = {
        "kind": "logits",
        "pack": str(trellis_router_pack(fixtures_dir / MOE_PACKS[0], tmp / "moe-trellis-router")),
        "dtype": "float32",
        "eager": True,
        "routing": True,
        "save": str(tmp / "moe-trellis-router.lp.pt"),
    }
    jobs["next/trellis-router"] = {
        "kind": "load_error",
        "pack": str(trellis_router_pack(fixtures_dir / NEXT_PACK, tmp / "next-trellis-router")),
    }
    from quantpack_core.embedding import convert_embedding_int8

    next_int8 = convert_embedding_int8(fixtures_dir / NEXT_PACK, tmp / f"{NEXT_PACK}-int8").out_dir
    for kind, pack in (("table", fixtures_dir / NEXT_PACK), ("int8", next_int8)):
        jobs[f"next/{kind}"] = {
            "kind": "logits",
            "pack": str(pack),
            "dtype": "bfloat16",
            "eager": True,
            "routing": True,
            "reference": str(fixtures_dir / NEXT_PACK / "reference_logits.pt"),
            "save": str(tmp / f"next-{kind}.lp.pt"),
        }
    # speculative decoding: the EAGLE draft ships no embedding / lm_head and must use the target's (EXL3 head, bf16
    # or int8 table); 4 prompts of 32 tokens, 32 greedy tokens each, with and without the draft
    prompts = [row[:32] for row in tokens[:4]]
    for kind, target in (("table", fixtures_dir / MAIN_PACK), ("int8", tmp / f"{MAIN_PACK}-int8")):
        jobs[f"spec/{kind}"] = {
            "kind": "spec",
            "pack": str(target),
            "draft": str(fixtures_dir / DRAFT),
            "dtype": "float32",
            "prompts": prompts,
            "tokens": 32,
        }
    # vocab_size 1000 over 1,024 stored rows, at tensor-parallel size 1: Llama's embedding (built without a prefix)
    # and Qwen3-MoE's (with one, which a manifest's dense table used to route to vLLM's own, exact-length loader)
    for name in (MAIN_PACK, MOE_PACKS[0]):
        pack, ref = padded_vocabulary_pack(fixtures_dir / name, tmp / f"vocab1000-{name}")
        jobs[f"vocab1000/{name}"] = {
            "kind": "logits",
            "pack": str(pack),
            "dtype": "float32",
            "eager": True,
            "reference": str(ref),
        }
    # seeded sampling with prompts prefilled in chunks: 20 prompts of 300 tokens (6,000, over the 4,096 of one step)
    ids = torch.load(fixtures_dir / MAIN_PACK / "reference_logits.pt")["input_ids"][0].tolist()
    jobs["seeded"] = {
        "kind": "seeded",
        "pack": str(fixtures_dir / MAIN_PACK),
        "dtype": "float32",
        "prompts": [(ids[i:] + ids * 3)[:300] for i in range(20)],
        "tokens": 8,
    }
    out = run_runner(jobs, tmp, timeout=2400)
    out["_tmp"] = str(tmp)
    out["_tokens"] = tokens
    out["_prompt_ids"] = torch.load(fixtures_dir / MAIN_PACK / "reference_logits.pt")["input_ids"][0, :32].tolist()
    return out


#: every EXL3 pack vLLM serves on CPU (Qwen3.5's vLLM file imports torchvision, which the CPU environment lacks)
TP_PACKS = [*LLAMA_PACKS, *MOE_PACKS, NEXT_PACK]


def tp_dtype(name: str) -> str:
    """float32, except Qwen3-Next (vLLM's CPU GDN kernel takes bfloat16 only)."""
    return "bfloat16" if name == NEXT_PACK else "float32"


def cpu_pair() -> str | None:
    """Two cores this process may run on, as vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` names them (``"0|1"``: one per
    CPU worker); None with fewer than two."""
    cores = sorted(os.sched_getaffinity(0))
    return f"{cores[0]}|{cores[1]}" if len(cores) >= 2 else None


def run_tp_jobs(fixtures_dir: Path, tmp: Path) -> dict:
    """Every CPU-servable pack at tensor-parallel size 2 (two vLLM CPU workers, one core each), eager, its
    log-probabilities saved; the mixed-K MoE pack also at size 4 (two workers per core; its 256 channels over 4
    ranks split the experts whole); and the EAGLE draft with the main pack at size 2; in one runner process.
    Returns {pack: result, "tp4/<pack>": result, "spec": result}."""
    bind = cpu_pair()
    if bind is None:
        pytest.skip("tensor parallelism on CPU needs two cores (one per vLLM CPU worker)")
    jobs = {
        name: {
            "kind": "logits",
            "pack": str(fixtures_dir / name),
            "dtype": tp_dtype(name),
            "eager": True,
            "tp": 2,
            # vLLM binds each CPU worker's threads to a NUMA node unless told which cores to use
            "env": {"VLLM_CPU_OMP_THREADS_BIND": bind},
            "save": str(tmp / f"tp2-{name}.lp.pt"),
        }
        for name in TP_PACKS
    }
    a, b = bind.split("|")
    jobs[f"tp4/{MIXED_PACK}"] = dict(
        jobs[MIXED_PACK], tp=4, env={"VLLM_CPU_OMP_THREADS_BIND": f"{a}|{b}|{a}|{b}"}, save=str(tmp / "tp4-mixed.lp.pt")
    )
    # the draft's embedding and head are the target's vocabulary-parallel modules at size 2 too; the prompts are
    # the size-1 spec jobs' (run_e2e_jobs)
    tokens = stdlib_tokens(fixtures_dir / MAIN_PACK / "tokenizer.json")
    jobs["spec"] = {
        "kind": "spec",
        "pack": str(fixtures_dir / MAIN_PACK),
        "draft": str(fixtures_dir / DRAFT),
        "dtype": "float32",
        "prompts": [row[:32] for row in tokens[:4]],
        "tokens": 32,
        "tp": 2,
        "env": {"VLLM_CPU_OMP_THREADS_BIND": bind},
    }
    return run_runner(jobs, tmp, timeout=2400)


def check_draft_shares_target(res: dict) -> dict:
    """A ``spec`` job's checks: greedy output with the draft equals the output without it, and
    :func:`check_draft_vocab`'s. Returns the draft's embedding entry of ``draft_vocab_modules``."""
    assert res["spec"] == res["plain"]
    return check_draft_vocab(res)


def check_draft_vocab(res: dict) -> dict:
    """A ``spec`` job's checks but the greedy tokens': draft tokens were accepted, and the draft's embedding and head
    are the target's own modules (the head an EXL3 one). Returns the draft's embedding entry of
    ``draft_vocab_modules``."""
    mods = res["draft_vocab_modules"]
    assert res["drafted"] > 0 and res["accepted"] > 0
    emb = [v for k, v in mods.items() if k.endswith("embed_tokens")]
    assert len(emb) == 1 and emb[0]["shared_with_target"], mods
    assert mods["lm_head"]["shared_with_target"] and mods["lm_head"]["method"] == "Exl3LinearMethod", mods
    return emb[0]
