"""Spark-X2.5's forward in plain PyTorch (float64), written from the architecture's public description
(docs/families.md, Spark) and independent of vLLM and of the model file under test; and the tiny Spark packs the
tests serve: an EXL3 pack in exllamav3's layout (``embed_tokens``, split q / k / v, fp16 ``g_proj``, ``lm_head``
stored though the config ties it) written with quantpack-core's writer, and a bf16 checkpoint in the published
layout (``model.embedding``, fused ``q_k_v_proj``, no ``lm_head``).
"""

import json
import math
from pathlib import Path

import torch
from flint_reference import TinyPack, rms_norm

from quantpack_core.synthetic import write_pack, write_word_tokenizer

#: families-notes section 5: 4 layers (three sliding, one full), window 8 so a 32-token prompt crosses it
TINY = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=128,
    layer_types=["sliding_attention"] * 3 + ["full_attention"],
    sliding_window=8,
    rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.25},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0},
    },
    headwise_attn_output_gate=True,
    gate_attn_act_mode="sigmoid",
    rms_norm_eps=1e-6,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)


def rope_partial(x, theta, factor):
    """NeoX rotation of the first ``head_dim * factor`` dimensions of ``x`` ``(T, heads, D)``; the rest unchanged."""
    d = int(x.shape[-1] * factor)
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(x.shape[0], dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    a, b = x[..., : d // 2], x[..., d // 2 : d]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, x[..., d:]], dim=-1)


def forward(w: dict[str, torch.Tensor], cfg: dict, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits ``(T, vocab)`` float64 from dense weights named as in the EXL3 layout (``embed_tokens``, q / k / v)."""
    w = {k: v.double() for k, v in w.items()}
    x = w["model.embed_tokens.weight"][input_ids]
    t, hd, h, kvh, eps = (
        len(input_ids),
        cfg["head_dim"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["rms_norm_eps"],
    )
    act = torch.sigmoid if cfg["gate_attn_act_mode"] == "sigmoid" else torch.nn.functional.silu
    pos = torch.arange(t)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        kind = cfg["layer_types"][layer]
        y = rms_norm(x, w[f"{p}.input_layernorm.weight"], eps)
        a = f"{p}.self_attn"
        q = (y @ w[f"{a}.q_proj.weight"].T).view(t, h, hd)
        k = (y @ w[f"{a}.k_proj.weight"].T).view(t, kvh, hd)
        v = (y @ w[f"{a}.v_proj.weight"].T).view(t, kvh, hd)
        rp = cfg["rope_parameters"][kind]
        q, k = (rope_partial(z, rp["rope_theta"], rp["partial_rotary_factor"]) for z in (q, k))
        k, v = k.repeat_interleave(h // kvh, 1), v.repeat_interleave(h // kvh, 1)
        scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
        back = pos[:, None] - pos[None, :]
        visible = (back >= 0) & ((back < cfg["sliding_window"]) if kind == "sliding_attention" else True)
        o = torch.einsum("hts,shd->thd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)
        if cfg["headwise_attn_output_gate"]:
            o = o * act(y @ w[f"{a}.g_proj.weight"].T)[:, :, None]  # one gate per head
        x = x + o.reshape(t, h * hd) @ w[f"{a}.out_proj.weight"].T
        y = rms_norm(x, w[f"{p}.post_attention_layernorm.weight"], eps)
        m = f"{p}.mlp"
        gate, up = y @ w[f"{m}.gate_proj.weight"].T, y @ w[f"{m}.up_proj.weight"].T
        x = x + (torch.nn.functional.gelu(gate) * up) @ w[f"{m}.down_proj.weight"].T
    head = w["lm_head.weight"] if "lm_head.weight" in w else w["model.embed_tokens.weight"]
    return rms_norm(x, w["model.norm.weight"], eps) @ head.T


def tiny_spark(seed: int = 0):
    """The tiny Spark's EXL3 pack tensors (exllamav3's layout) and its dense weights (float32, EXL3 ones decoded)."""
    cfg = TINY
    g = torch.Generator().manual_seed(seed)
    built = TinyPack(g)
    exl3, plain = built.exl3, built.plain

    hid, hd, heads, kvh = cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    plain("model.embed_tokens.weight", (0.5 * torch.randn(cfg["vocab_size"], hid, generator=g)).half())
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        plain(f"{p}.input_layernorm.weight", (1 + 0.1 * torch.randn(hid, generator=g)).half())
        plain(f"{p}.post_attention_layernorm.weight", (1 + 0.1 * torch.randn(hid, generator=g)).half())
        a = f"{p}.self_attn"
        exl3(f"{a}.q_proj", hid, heads * hd, 4, 0.15)  # large enough that attention is not uniform
        exl3(f"{a}.k_proj", hid, kvh * hd, 4, 0.15)
        exl3(f"{a}.v_proj", hid, kvh * hd, 4, 1 / math.sqrt(hid))
        plain(f"{a}.g_proj.weight", (torch.randn(heads, hid, generator=g) / math.sqrt(hid)).half())
        exl3(f"{a}.out_proj", heads * hd, hid, 4, 1 / math.sqrt(heads * hd))
        for proj, n_in, n_out in (("gate", hid, 512), ("up", hid, 512), ("down", 512, hid)):
            exl3(f"{p}.mlp.{proj}_proj", n_in, n_out, 4, 1 / math.sqrt(n_in))
    plain("model.norm.weight", (1 + 0.1 * torch.randn(hid, generator=g)).half())
    exl3("lm_head", hid, cfg["vocab_size"], 6, 0.15)  # stored, though the config ties the head
    return built.pack, built.dense


def config_json(**changes) -> dict:
    from quantpack_families.models.spark_config import Spark2_5Config

    cfg = Spark2_5Config(**{**TINY, **changes}).to_dict()
    cfg.update(architectures=["Spark2_5ForCausalLM"], torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)
    return cfg


def write_spark_packs(root: Path, seed: int = 0, length: int = 32) -> dict[str, Path]:
    """``spark-exl3`` (sigmoid gate), ``spark-exl3-silu`` (the same weights, SiLU gate) and ``spark-bf16`` (the
    published layout: the first pack's decoded weights in bf16, q / k / v fused, the head tied to the embedding as
    the published checkpoint has it), each with a tokenizer and ``reference_logits.pt``."""
    from safetensors.torch import save_file

    ids = torch.randint(3, TINY["vocab_size"], (length,), generator=torch.Generator().manual_seed(seed + 1))
    pack, dense = tiny_spark(seed)
    out = {}
    for name, mode in (("spark-exl3", "sigmoid"), ("spark-exl3-silu", "silu")):
        path = write_pack(root / name, pack, config_json(gate_attn_act_mode=mode))
        write_word_tokenizer(path, TINY["vocab_size"])
        ref = forward(dense, {**TINY, "gate_attn_act_mode": mode}, ids).float()[None]
        torch.save({"input_ids": ids[None], "logits": ref}, path / "reference_logits.pt")
        out[name] = path
    twin = {k: v.to(torch.bfloat16) for k, v in dense.items() if k != "lm_head.weight"}
    hf = {}
    for k, v in twin.items():
        k = k.replace("model.embed_tokens.", "model.embedding.")
        if ".q_proj." in k:
            qkv = [twin[k.replace("q_proj", s)] for s in ("q_proj", "k_proj", "v_proj")]
            hf[k.replace("q_proj", "q_k_v_proj")] = torch.cat(qkv)
        elif ".k_proj." not in k and ".v_proj." not in k:
            hf[k] = v
    tpath = root / "spark-bf16"
    tpath.mkdir()
    save_file({k: v.contiguous() for k, v in hf.items()}, str(tpath / "model.safetensors"))
    cfg = config_json()
    cfg.pop("quantization_config", None)
    (tpath / "config.json").write_text(json.dumps(cfg, indent=2))
    write_word_tokenizer(tpath, TINY["vocab_size"])
    ref = forward({k: v.float() for k, v in twin.items()}, TINY, ids).float()[None]  # tied: the embedding as head
    torch.save({"input_ids": ids[None], "logits": ref}, tpath / "reference_logits.pt")
    out["spark-bf16"] = tpath
    return out
