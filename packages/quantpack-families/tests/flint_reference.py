"""Flint's forward in plain PyTorch (float64), written from the architecture's public description
(docs/families.md, Flint) and independent of vLLM and of the model file under test; and the tiny Flint packs the
tests serve, written with quantpack-core's pack writer.

The reference reads dense weights by their checkpoint names (``model.layers.N.self_attn.q_proj.weight`` ...), so the
same function checks the EXL3 pack (its layers decoded by the core codec) and its dense bf16 twin.
"""

import math
from pathlib import Path

import torch

from quantpack_core.codec import Exl3Tensors
from quantpack_core.codec.exl3 import dequantize
from quantpack_core.synthetic import random_exl3_layer, write_pack, write_word_tokenizer

#: families-notes section 5: layer 0 dense MLP + full attention without positions, layers 1-2 MoE + sliding RoPE,
#: layer 3 MoE + full attention; a window of 8 tokens so a 32-token prompt crosses it
TINY = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=128,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    mlp_only_layers=[0],
    layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
    sliding_window=8,  # keys visible, the current one included
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def swiglu(x, w, prefix):
    gate, up = x @ w[f"{prefix}.gate_proj.weight"].T, x @ w[f"{prefix}.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ w[f"{prefix}.down_proj.weight"].T


def rope_neox(x, positions, theta):
    """NeoX rotation of ``x`` ``(T, heads, D)``: the two halves of each head rotate as pairs."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions[:, None].double() * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def attention(x, w, cfg, layer):
    p = f"model.layers.{layer}.self_attn"
    t, hd, h, kvh = x.shape[0], cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    q = (x @ w[f"{p}.q_proj.weight"].T).view(t, h, hd)
    k = (x @ w[f"{p}.k_proj.weight"].T).view(t, kvh, hd)
    v = (x @ w[f"{p}.v_proj.weight"].T).view(t, kvh, hd)
    if cfg.get("qk_norm", True):  # per head, before any rotation
        q, k = (
            rms_norm(q, w[f"{p}.q_norm.weight"], cfg["rms_norm_eps"]),
            rms_norm(k, w[f"{p}.k_norm.weight"], cfg["rms_norm_eps"]),
        )
    sliding = cfg["layer_types"][layer] == "sliding_attention"
    pos = torch.arange(t)
    if sliding:
        q, k = rope_neox(q, pos, cfg["rope_theta"]), rope_neox(k, pos, cfg["rope_theta"])
    k, v = k.repeat_interleave(h // kvh, dim=1), v.repeat_interleave(h // kvh, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
    back = pos[:, None] - pos[None, :]  # query t, key s: how far back
    visible = (back >= 0) & ((back < cfg["sliding_window"]) if sliding else True)  # the window counts the query
    scores = scores.masked_fill(~visible, float("-inf"))
    sink = w[f"{p}.sinks"].double()[:, None, None].expand(h, t, 1)  # a logit in the denominator, no value
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    out = torch.einsum("hts,shd->thd", probs, v).reshape(t, h * hd)
    return out @ w[f"{p}.o_proj.weight"].T


def moe(x, w, cfg, layer):
    p = f"model.layers.{layer}.mlp"
    logits = x @ w[f"{p}.gate.weight"].T
    scores = logits.softmax(-1) if cfg.get("router") == "softmax" else logits.sigmoid()  # Flint: sigmoid
    top_w, top_i = scores.topk(cfg["num_experts_per_tok"], dim=-1)
    if cfg["norm_topk_prob"]:
        top_w = top_w / top_w.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(cfg["num_experts"]):
        rows, slot = (top_i == e).nonzero(as_tuple=True)
        if rows.numel():
            out[rows] += top_w[rows, slot, None] * swiglu(x[rows], w, f"{p}.experts.{e}")
    return out + swiglu(x, w, f"{p}.shared_expert")  # the shared expert, ungated


def forward(w: dict[str, torch.Tensor], cfg: dict, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits ``(T, vocab)`` float64 of one sequence ``input_ids`` ``(T,)`` from dense weights ``w``."""
    w = {k: v.double() for k, v in w.items()}
    x = w["model.embed_tokens.weight"][input_ids]
    eps = cfg["rms_norm_eps"]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        x = x + attention(rms_norm(x, w[f"{p}.input_layernorm.weight"], eps), w, cfg, layer)
        h = rms_norm(x, w[f"{p}.post_attention_layernorm.weight"], eps)
        x = x + (swiglu(h, w, f"{p}.mlp") if layer in cfg["mlp_only_layers"] else moe(h, w, cfg, layer))
    return rms_norm(x, w["model.norm.weight"], eps) @ w["lm_head.weight"].T


def serve_and_compare(packs: dict[str, Path], tmp_path: Path, kl_bound: float) -> dict:
    """Serve each tiny pack in vLLM (float32, eager, one runner process) and require its logits to agree with the
    pack's stored reference: KL <= ``kl_bound`` and top-1 >= 99%. Returns the runner's results."""
    from e2e_runner import get, run_runner

    jobs = {
        name: {"kind": "logits", "pack": str(path), "dtype": "float32", "eager": True} for name, path in packs.items()
    }
    results = run_runner(jobs, tmp_path, timeout=900)
    for name in jobs:
        res = get(results, name)
        assert res["kl"] <= kl_bound and res["top1"] >= 0.99, (name, res["kl"], res["top1"])
    return results


class TinyPack:
    """A tiny pack's tensors as they are stored (``pack``) beside its dense float32 weights (``dense``, the EXL3
    layers decoded by the core codec), built layer by layer from one RNG."""

    def __init__(self, generator: torch.Generator):
        self.g = generator
        self.pack: dict[str, torch.Tensor] = {}
        self.dense: dict[str, torch.Tensor] = {}

    def exl3(self, name: str, n_in: int, n_out: int, k: float, scale: float = 0.02) -> None:
        """A random mul1 EXL3 linear ``name`` at K ``k`` (weights about ``scale`` in size)."""
        t = random_exl3_layer(n_in, n_out, k, "mul1", generator=self.g, scale=scale)
        self.pack.update({f"{name}.{s}": v for s, v in t.items()})
        self.dense[f"{name}.weight"] = dequantize(Exl3Tensors.from_tensors(t))[:n_in, :n_out].T.contiguous()

    def plain(self, name: str, tensor: torch.Tensor) -> None:
        """A tensor stored as it is."""
        self.pack[name] = tensor
        self.dense[name] = tensor.float()


def tiny_flint(seed: int = 0, shared_expert_k: float | None = None):
    """The tiny Flint's pack tensors (EXL3 attention, dense MLP, routed experts and head; the shared expert dense
    fp16, or EXL3 at ``shared_expert_k``) and its dense weights (the EXL3 ones decoded by the core codec, float32).
    """
    cfg = TINY
    g = torch.Generator().manual_seed(seed)
    built = TinyPack(g)
    exl3, plain = built.exl3, built.plain

    hid, hd, heads, kvh = cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    plain("model.embed_tokens.weight", torch.randn(cfg["vocab_size"], hid, generator=g).half())
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        plain(f"{p}.input_layernorm.weight", (1 + 0.1 * torch.randn(hid, generator=g)).half())
        plain(f"{p}.post_attention_layernorm.weight", (1 + 0.1 * torch.randn(hid, generator=g)).half())
        a = f"{p}.self_attn"
        exl3(f"{a}.q_proj", hid, heads * hd, 4)
        exl3(f"{a}.k_proj", hid, kvh * hd, 4)
        exl3(f"{a}.v_proj", hid, kvh * hd, 4)
        exl3(f"{a}.o_proj", heads * hd, hid, 4)
        plain(f"{a}.q_norm.weight", (1 + 0.1 * torch.randn(hd, generator=g)).half())
        plain(f"{a}.k_norm.weight", (1 + 0.1 * torch.randn(hd, generator=g)).half())
        plain(f"{a}.sinks", torch.randn(heads, generator=g) + 1.0)  # float32, as the model keeps them
        m = f"{p}.mlp"
        if layer in cfg["mlp_only_layers"]:
            for proj, n_in, n_out in (("gate", hid, 512), ("up", hid, 512), ("down", 512, hid)):
                exl3(f"{m}.{proj}_proj", n_in, n_out, 4)
            continue
        plain(f"{m}.gate.weight", 0.05 * torch.randn(cfg["num_experts"], hid, generator=g))  # float32, as kept
        inter, shared = cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
        for e in range(cfg["num_experts"]):
            for proj, n_in, n_out in (("gate", hid, inter), ("up", hid, inter), ("down", inter, hid)):
                exl3(f"{m}.experts.{e}.{proj}_proj", n_in, n_out, 3, scale=1 / math.sqrt(n_in))
        for proj, n_in, n_out in (("gate", hid, shared), ("up", hid, shared), ("down", shared, hid)):
            name = f"{m}.shared_expert.{proj}_proj"
            if shared_expert_k is None:
                plain(f"{name}.weight", (torch.randn(n_out, n_in, generator=g) / math.sqrt(n_in)).half())
            else:
                exl3(name, n_in, n_out, shared_expert_k, scale=1 / math.sqrt(n_in))
    plain("model.norm.weight", (1 + 0.1 * torch.randn(hid, generator=g)).half())
    exl3("lm_head", hid, cfg["vocab_size"], 6, scale=0.15)  # logits of a few units: a peaked distribution
    return built.pack, built.dense


def config_json(quantized: bool) -> dict:
    from quantpack_families.models.flint_config import FlintConfig

    cfg = FlintConfig(**TINY).to_dict()
    cfg.update(architectures=["FlintForCausalLM"], torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)
    if not quantized:
        cfg.pop("quantization_config", None)
    return cfg


def write_flint_packs(root: Path, seed: int = 0, length: int = 32) -> dict[str, Path]:
    """Under ``root``: ``flint-exl3`` (shared expert dense), ``flint-exl3-shared-k6`` (shared expert EXL3 at K 6)
    and ``flint-bf16`` (the first pack's dense twin: its weights decoded and rounded to bf16, sinks float32), each
    with a word tokenizer and ``reference_logits.pt`` (``input_ids`` ``(1, T)``, ``logits`` ``(1, T, V)`` float32
    from :func:`forward` on the pack's own dense weights)."""
    from safetensors.torch import save_file

    ids = torch.randint(3, TINY["vocab_size"], (length,), generator=torch.Generator().manual_seed(seed + 1))
    out = {}
    for name, shared_k in (("flint-exl3", None), ("flint-exl3-shared-k6", 6)):
        pack, dense = tiny_flint(seed, shared_k)
        path = write_pack(root / name, pack, config_json(True))
        write_word_tokenizer(path, TINY["vocab_size"])
        torch.save(
            {"input_ids": ids[None], "logits": forward(dense, TINY, ids).float()[None]}, path / "reference_logits.pt"
        )
        out[name] = path
        if shared_k is None:
            twin = {k: v if k.endswith(".sinks") else v.to(torch.bfloat16) for k, v in dense.items()}
            tpath = root / "flint-bf16"
            tpath.mkdir()
            save_file({k: v.contiguous() for k, v in twin.items()}, str(tpath / "model.safetensors"))
            import json

            (tpath / "config.json").write_text(json.dumps(config_json(False), indent=2))
            write_word_tokenizer(tpath, TINY["vocab_size"])
            ref = forward({k: v.float() for k, v in twin.items()}, TINY, ids).float()[None]
            torch.save({"input_ids": ids[None], "logits": ref}, tpath / "reference_logits.pt")
            out["flint-bf16"] = tpath
    return out
