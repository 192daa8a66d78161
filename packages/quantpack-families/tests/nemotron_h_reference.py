"""The Nemotron-H text tower's forward in plain PyTorch (float64), written from the architecture's public description
(docs/families.md, Nemotron-3.5-Super) and independent of vLLM, of transformers and of the model file under test; and
the tiny packs the tests serve, written with quantpack-core's pack writer.

A layer is ``x + mixer(rmsnorm(x))`` with one of three mixers (``layers_block_type`` / the older
``hybrid_override_pattern`` letter):

* ``linear_attention`` (``M``), Mamba2: ``in_proj`` gives ``z`` (gate, ``I``), ``x`` (``I``), ``B`` / ``C`` (``G*N``
  each) and ``dt`` (one per head); ``x, B, C`` pass a depthwise causal convolution (with bias) and SiLU; per head
  ``h`` (group ``g``), with ``dt = softplus(dt + dt_bias)`` and ``A = -exp(A_log)``, the state ``S (P x N)`` runs
  ``S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T`` and ``y_t = S_t C_t + D_h x_t``; then ``y * silu(z)`` is
  RMS-normalised per group of ``I / G`` channels (times ``norm.weight``) and ``out_proj`` maps it back;
* ``full_attention`` (``*``): causal grouped-query attention with no positional encoding;
* ``moe`` (``E``): a float32 router ``gate`` with sigmoid scores; experts chosen by score plus
  ``e_score_correction_bias``, weighted by their score alone (renormalised over the top-k, times
  ``routed_scaling_factor``); the routed experts work in the latent space (``fc1_latent_proj`` down to
  ``moe_latent_size``, ``fc2_latent_proj`` back) and are ``down(relu(up(x))^2)``; the shared expert, the same
  relu^2 MLP on the hidden state, is added unweighted.

The reference reads dense weights by their checkpoint names (``backbone.layers.N.mixer.in_proj.weight`` ...), so the
same function checks the EXL3 pack (its layers decoded by the core codec) and its dense bf16 twin.
"""

import json
import math
from pathlib import Path

import torch
from flint_reference import TinyPack, rms_norm

from quantpack_core.synthetic import write_pack, write_word_tokenizer

#: the served tiny model: two Mamba2 layers, a NoPE attention layer and a dense relu^2 MLP layer (vLLM's CPU builds
#: refuse the ungated experts of the MoE layers, docs/families.md); Mamba 4 heads of 64 (in_proj's 2*256 + 2*16 + 4
#: = 548 outputs pad to 640: off the 128 grid on purpose), one group, state 16; the MoE fields are SUPER's
TINY = dict(
    vocab_size=1024,
    hidden_size=256,
    layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention"],
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=128,
    mamba_num_heads=4,
    mamba_head_dim=64,
    ssm_state_size=16,
    n_groups=1,
    conv_kernel=4,
    use_conv_bias=True,
    use_bias=False,
    mamba_hidden_act="silu",
    chunk_size=8,  # a 32-token prompt spans four chunks of vLLM's chunked scan
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    moe_shared_expert_intermediate_size=256,
    n_shared_experts=1,
    moe_latent_size=128,
    routed_scaling_factor=2.5,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    mlp_hidden_act="relu2",
    mlp_bias=False,
    intermediate_size=512,
    layer_norm_epsilon=1e-5,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)

#: docs/families.md (Nemotron-3.5-Super): Super's layer kinds at the tiny sizes - a Mamba2 layer, NoPE attention and
#: two latent-MoE layers (4 experts, top-2, latent 128, a shared expert of 256, sigmoid router with correction bias)
SUPER = {**TINY, "layers_block_type": ["linear_attention", "moe", "full_attention", "moe"]}

#: K of each routed expert's (up_proj, down_proj) when the routed experts are EXL3 (three K groups per layer)
ROUTED_K = [(4, 3), (3, 4), (4, 3), (2, 4)]

#: the older single-letter naming of layer types (exllamav3's converter and vLLM's own config before 0.29 read it)
PATTERN = {"linear_attention": "M", "full_attention": "*", "moe": "E", "mlp": "-"}


def relu2_mlp(x, w, prefix):
    """``down(relu(up(x))^2)``: Nemotron-H's ungated MLP (experts and shared expert)."""
    return torch.relu(x @ w[f"{prefix}.up_proj.weight"].T).square() @ w[f"{prefix}.down_proj.weight"].T


def mamba2(x, w, cfg, layer):
    """The Mamba2 mixer of layer ``layer`` on ``x`` ``(T, hidden)``, by the sequential recurrence."""
    p = f"backbone.layers.{layer}.mixer"
    t = x.shape[0]
    heads, hd, n, groups = cfg["mamba_num_heads"], cfg["mamba_head_dim"], cfg["ssm_state_size"], cfg["n_groups"]
    inner = heads * hd
    proj = x @ w[f"{p}.in_proj.weight"].T
    z, xbc, dt = proj.split([inner, inner + 2 * groups * n, heads], dim=-1)
    kernel = w[f"{p}.conv1d.weight"].reshape(xbc.shape[1], -1)  # (channels, K): one filter per channel
    k = kernel.shape[1]
    padded = torch.cat([xbc.new_zeros(k - 1, xbc.shape[1]), xbc])
    conv = sum(kernel[:, j] * padded[j : j + t] for j in range(k))
    if cfg["use_conv_bias"]:
        conv = conv + w[f"{p}.conv1d.bias"]
    xs, b, c = torch.nn.functional.silu(conv).split([inner, groups * n, groups * n], dim=-1)
    xs, b, c = xs.view(t, heads, hd), b.view(t, groups, n), c.view(t, groups, n)
    dt = torch.nn.functional.softplus(dt + w[f"{p}.dt_bias"])
    a = -torch.exp(w[f"{p}.A_log"])
    y = torch.zeros(t, heads, hd, dtype=x.dtype)
    per_group = heads // groups
    for h in range(heads):
        g = h // per_group
        state = torch.zeros(hd, n, dtype=x.dtype)
        for i in range(t):
            state = torch.exp(dt[i, h] * a[h]) * state + dt[i, h] * torch.outer(xs[i, h], b[i, g])
            y[i, h] = state @ c[i, g] + w[f"{p}.D"][h] * xs[i, h]
    gated = y.reshape(t, inner) * torch.nn.functional.silu(z)
    grouped = gated.view(t, groups, inner // groups)
    normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + cfg["layer_norm_epsilon"])
    return (normed.reshape(t, inner) * w[f"{p}.norm.weight"]) @ w[f"{p}.out_proj.weight"].T


def attention(x, w, cfg, layer):
    """Causal grouped-query attention without positions (NoPE) of layer ``layer``."""
    p = f"backbone.layers.{layer}.mixer"
    t, hd, h, kvh = x.shape[0], cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    q = (x @ w[f"{p}.q_proj.weight"].T).view(t, h, hd)
    k = (x @ w[f"{p}.k_proj.weight"].T).view(t, kvh, hd).repeat_interleave(h // kvh, dim=1)
    v = (x @ w[f"{p}.v_proj.weight"].T).view(t, kvh, hd).repeat_interleave(h // kvh, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, v).reshape(t, h * hd) @ w[f"{p}.o_proj.weight"].T


def router(x, w, cfg, layer):
    """The sigmoid router of MoE layer ``layer``: ``(scores, choice)``, each ``(T, experts)``; ``choice`` (the
    scores plus the correction bias) picks the experts, ``scores`` weigh them. Where ``cfg["swap"]`` is ``(layer,
    token)`` (:func:`forward`'s ``swap``), that token takes its ``(k+1)``-th expert instead of its ``k``-th there."""
    p = f"backbone.layers.{layer}.mixer"
    scores = (x @ w[f"{p}.gate.weight"].T).sigmoid()
    choice = scores + (w[f"{p}.gate.e_score_correction_bias"] if cfg.get("correction_bias", True) else 0)
    if cfg.get("swap") is not None and cfg["swap"][0] == layer:
        t, k = cfg["swap"][1], cfg["num_experts_per_tok"]
        kth, next_ = choice[t].argsort(descending=True)[k - 1 : k + 1].tolist()
        choice = choice.clone()
        choice[t, [kth, next_]] = choice[t, [next_, kth]]
    return scores, choice


def router_margin(choice: torch.Tensor, top_k: int, other: torch.Tensor | None = None) -> torch.Tensor:
    """Per token ``(T,)`` of a router's ``choice`` scores ``(T, experts)``: how far the ``top_k``-th expert's score
    lies above the next one's. With ``other`` (another forward's choice scores of the same tokens), the same two
    experts' difference there instead: how far that forward moved the margin. A margin below what a forward moves
    it lets that forward pick the other expert. Without ``other``, ``quantpack_core.compare.router_margin``."""
    if other is None:
        from quantpack_core.compare import router_margin as margin

        return margin(choice, top_k)
    pair = choice.topk(top_k + 1, dim=-1).indices[:, -2:]
    top = (choice if other is None else other).gather(1, pair)
    return top[:, 0] - top[:, 1]


def moe(x, w, cfg, layer):
    """The latent MoE of layer ``layer``: routed relu^2 experts in the latent space plus the shared expert."""
    p = f"backbone.layers.{layer}.mixer"
    scores, choice = router(x, w, cfg, layer)
    top_i = choice.topk(cfg["num_experts_per_tok"], dim=-1).indices
    top_w = scores.gather(1, top_i)  # the bias only chooses; the weights are the scores
    if cfg["norm_topk_prob"]:
        top_w = top_w / top_w.sum(-1, keepdim=True)
    top_w = top_w * cfg["routed_scaling_factor"]
    latent = x @ w[f"{p}.fc1_latent_proj.weight"].T if cfg["moe_latent_size"] else x
    routed = torch.zeros_like(latent)
    for e in range(cfg["n_routed_experts"]):
        rows, slot = (top_i == e).nonzero(as_tuple=True)
        if rows.numel():
            routed[rows] += top_w[rows, slot, None] * relu2_mlp(latent[rows], w, f"{p}.experts.{e}")
    if cfg["moe_latent_size"]:
        routed = routed @ w[f"{p}.fc2_latent_proj.weight"].T
    return routed + relu2_mlp(x, w, f"{p}.shared_experts")


def mlp(x, w, cfg, layer):
    """The dense relu^2 MLP of layer ``layer``."""
    return relu2_mlp(x, w, f"backbone.layers.{layer}.mixer")


MIXERS = {"linear_attention": mamba2, "full_attention": attention, "moe": moe, "mlp": mlp}


def forward(
    w: dict[str, torch.Tensor],
    cfg: dict,
    input_ids: torch.Tensor,
    inputs_embeds: torch.Tensor | None = None,
    routers: list | None = None,
    dtype: torch.dtype = torch.float64,
    swap: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Logits ``(T, vocab)`` of one sequence ``input_ids`` ``(T,)`` from dense weights ``w`` (checkpoint names,
    ``backbone.*`` and ``lm_head.weight``), computed in ``dtype`` (float64: the reference; bfloat16: every weight,
    activation and state rounded, a forward noisier than vLLM's); ``inputs_embeds`` ``(T, hidden)``, where given,
    replaces the embedding rows (a vision-language model's image positions); ``routers``, where given, gets each MoE
    layer's choice scores ``(T, experts)`` (:func:`router`) appended in layer order; ``swap``, where given, is
    ``(layer, token)``: that token routed to its ``(k+1)``-th expert instead of its ``k``-th at that MoE layer (what
    a forward that rounds differently does at a router near-tie)."""
    w = {k: v.to(dtype) for k, v in w.items()}
    cfg = {**cfg, "swap": swap}
    x = w["backbone.embeddings.weight"][input_ids] if inputs_embeds is None else inputs_embeds.to(dtype)
    eps = cfg["layer_norm_epsilon"]
    for layer, kind in enumerate(cfg["layers_block_type"]):
        h = rms_norm(x, w[f"backbone.layers.{layer}.norm.weight"], eps)
        if kind == "moe" and routers is not None:
            routers.append(router(h, w, cfg, layer)[1])
        x = x + MIXERS[kind](h, w, cfg, layer)
    return rms_norm(x, w["backbone.norm_f.weight"], eps) @ w["lm_head.weight"].T


def tiny_nemotron_h(seed: int = 0, cfg: dict = TINY, routed_exl3: bool = False):
    """The pack tensors of a tiny Nemotron-H of layer kinds ``cfg["layers_block_type"]`` (:data:`TINY` or
    :data:`SUPER`) and its dense weights (float32; the EXL3 ones decoded by the core codec).

    EXL3 (mul1): the Mamba ``in_proj`` (K 4) / ``out_proj`` (K 3), attention q / k / v / o (K 4), the MLP's
    ``up_proj`` / ``down_proj`` (K 4), the latent projections (K 5), the shared experts (K 4) and ``lm_head`` (K 6).
    Dense as a pack keeps them: the embedding, norms, the convolution, ``A_log`` / ``D`` / ``dt_bias``, the router and
    its correction bias (float32), and the routed experts (fp16), unless ``routed_exl3``: then each routed expert's
    ungated ``up_proj`` / ``down_proj`` is EXL3 too, at :data:`ROUTED_K` (as exllamav3 quantizes them).
    """
    g = torch.Generator().manual_seed(seed)
    built = TinyPack(g)
    exl3, plain = built.exl3, built.plain

    hid, hd, heads, kvh = cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    mh, mhd, n, groups = cfg["mamba_num_heads"], cfg["mamba_head_dim"], cfg["ssm_state_size"], cfg["n_groups"]
    inner, conv_dim = mh * mhd, mh * mhd + 2 * groups * n
    plain("backbone.embeddings.weight", torch.randn(cfg["vocab_size"], hid, generator=g).half())
    for layer, kind in enumerate(cfg["layers_block_type"]):
        p = f"backbone.layers.{layer}"
        plain(f"{p}.norm.weight", (1 + 0.1 * torch.randn(hid, generator=g)).half())
        m = f"{p}.mixer"
        if kind == "linear_attention":
            exl3(f"{m}.in_proj", hid, 2 * inner + 2 * groups * n + mh, 4, 1 / math.sqrt(hid))
            plain(f"{m}.conv1d.weight", (0.4 * torch.randn(conv_dim, 1, cfg["conv_kernel"], generator=g)).half())
            plain(f"{m}.conv1d.bias", (0.1 * torch.randn(conv_dim, generator=g)).half())
            plain(f"{m}.A_log", torch.log(torch.linspace(0.5, 4.0, mh)))  # float32, as checkpoints keep it
            plain(f"{m}.D", 1 + 0.2 * torch.randn(mh, generator=g))
            plain(f"{m}.dt_bias", torch.linspace(-1.5, 0.5, mh))  # softplus: dt from about 0.2 to 1
            plain(f"{m}.norm.weight", (1 + 0.1 * torch.randn(inner, generator=g)).half())
            exl3(f"{m}.out_proj", inner, hid, 3, 1 / math.sqrt(inner))
        elif kind == "full_attention":
            exl3(f"{m}.q_proj", hid, heads * hd, 4, 0.15)  # large enough that attention is not uniform
            exl3(f"{m}.k_proj", hid, kvh * hd, 4, 0.15)
            exl3(f"{m}.v_proj", hid, kvh * hd, 4, 1 / math.sqrt(hid))
            exl3(f"{m}.o_proj", heads * hd, hid, 4, 1 / math.sqrt(heads * hd))
        elif kind == "mlp":
            inter = cfg["intermediate_size"]
            exl3(f"{m}.up_proj", hid, inter, 4, 1.5 / math.sqrt(hid))
            exl3(f"{m}.down_proj", inter, hid, 4, 1 / math.sqrt(inter))
        else:
            experts, latent, inter = cfg["n_routed_experts"], cfg["moe_latent_size"], cfg["moe_intermediate_size"]
            plain(f"{m}.gate.weight", 0.1 * torch.randn(experts, hid, generator=g))  # float32, as kept
            plain(f"{m}.gate.e_score_correction_bias", 0.3 * torch.randn(experts, generator=g))
            exl3(f"{m}.fc1_latent_proj", hid, latent, 5, 1 / math.sqrt(hid))
            exl3(f"{m}.fc2_latent_proj", latent, hid, 5, 1 / math.sqrt(latent))
            for e in range(experts):
                if routed_exl3:
                    k_up, k_down = ROUTED_K[e % len(ROUTED_K)]
                    exl3(f"{m}.experts.{e}.up_proj", latent, inter, k_up, 1.5 / math.sqrt(latent))
                    exl3(f"{m}.experts.{e}.down_proj", inter, latent, k_down, 1 / math.sqrt(inter))
                    continue
                for proj, n_in, n_out in (("up", latent, inter), ("down", inter, latent)):
                    plain(
                        f"{m}.experts.{e}.{proj}_proj.weight",
                        (torch.randn(n_out, n_in, generator=g) * 1.5 / math.sqrt(n_in)).half(),
                    )
            shared = cfg["moe_shared_expert_intermediate_size"]
            exl3(f"{m}.shared_experts.up_proj", hid, shared, 4, 1.5 / math.sqrt(hid))
            exl3(f"{m}.shared_experts.down_proj", shared, hid, 4, 1 / math.sqrt(shared))
    plain("backbone.norm_f.weight", (1 + 0.1 * torch.randn(hid, generator=g)).half())
    exl3("lm_head", hid, cfg["vocab_size"], 6, scale=0.15)  # logits of a few units: a peaked distribution
    return built.pack, built.dense


def config_json(quantized: bool, naming: str = "layers_block_type", cfg: dict = TINY) -> dict:
    """config.json of the tiny model ``cfg``: ``naming`` ``"layers_block_type"`` (Nemotron-3.5-Super's lists, with an
    MTP layer declared as Super's config has it; no MTP tensors are stored) or ``"hybrid_override_pattern"`` (the
    older letters and ``num_hidden_layers``)."""
    kinds = cfg["layers_block_type"]
    out = {k: v for k, v in cfg.items() if k != "layers_block_type"}
    if naming == "layers_block_type":
        out.update(layers_block_type=list(kinds), num_nextn_predict_layers=1)
        out["mtp_layers_block_type"] = ["full_attention", "moe"]
    elif naming == "hybrid_override_pattern":
        out["hybrid_override_pattern"] = "".join(PATTERN[k] for k in kinds)
        out["num_hidden_layers"] = len(kinds)
    else:
        raise ValueError(f"unknown layer naming {naming!r}")
    out.update(architectures=["NemotronHForCausalLM"], model_type="nemotron_h", torch_dtype="bfloat16")
    out.update(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if quantized:
        out["quantization_config"] = {"quant_method": "exl3", "version": "1.6.5", "bits": 4.0, "head_bits": 6}
    return out


def write_nemotron_h_packs(root: Path, seed: int = 0, length: int = 32) -> dict[str, Path]:
    """Under ``root``: ``nemotron-h-exl3`` (the EXL3 pack, ``layers_block_type`` naming) and ``nemotron-h-bf16`` (its
    dense twin: the pack's weights decoded and rounded to bf16, the router, its bias and ``A_log`` / ``D`` /
    ``dt_bias`` float32; ``hybrid_override_pattern`` naming), each with a word tokenizer and ``reference_logits.pt``
    (``input_ids`` ``(1, T)``, ``logits`` ``(1, T, V)`` float32 from :func:`forward` on the pack's own dense
    weights)."""
    from safetensors.torch import save_file

    ids = torch.randint(3, TINY["vocab_size"], (length,), generator=torch.Generator().manual_seed(seed + 1))
    pack, dense = tiny_nemotron_h(seed)
    out = {}
    path = write_pack(root / "nemotron-h-exl3", pack, config_json(True))
    write_word_tokenizer(path, TINY["vocab_size"])
    torch.save(
        {"input_ids": ids[None], "logits": forward(dense, TINY, ids).float()[None]}, path / "reference_logits.pt"
    )
    out["nemotron-h-exl3"] = path
    keep_fp32 = (".gate.", ".A_log", ".D", ".dt_bias")
    twin = {k: v if any(s in k for s in keep_fp32) else v.to(torch.bfloat16) for k, v in dense.items()}
    tpath = root / "nemotron-h-bf16"
    tpath.mkdir()
    save_file({k: v.contiguous() for k, v in twin.items()}, str(tpath / "model.safetensors"))
    (tpath / "config.json").write_text(json.dumps(config_json(False, "hybrid_override_pattern"), indent=2))
    write_word_tokenizer(tpath, TINY["vocab_size"])
    ref = forward({k: v.float() for k, v in twin.items()}, TINY, ids).float()[None]
    torch.save({"input_ids": ids[None], "logits": ref}, tpath / "reference_logits.pt")
    out["nemotron-h-bf16"] = tpath
    return out


def write_nemotron_moe_pack(root: Path, seed: int = 0, length: int = 32) -> dict[str, Path]:
    """Under ``root``: ``nemotron-h-moe-exl3``, the tiny model of Nemotron-3.5-Super's layer kinds (:data:`SUPER`: two
    latent-MoE layers) with its routed ungated relu2 experts in EXL3 (:data:`ROUTED_K`, three K groups) beside the
    EXL3 latent projections and shared experts, with a word tokenizer and ``reference_logits.pt`` from
    :func:`forward` on the decoded weights. vLLM builds these layers on CUDA, XPU and ROCm only."""
    ids = torch.randint(3, SUPER["vocab_size"], (length,), generator=torch.Generator().manual_seed(seed + 2))
    pack, dense = tiny_nemotron_h(seed, SUPER, routed_exl3=True)
    path = write_pack(root / "nemotron-h-moe-exl3", pack, config_json(True, cfg=SUPER))
    write_word_tokenizer(path, SUPER["vocab_size"])
    torch.save(
        {"input_ids": ids[None], "logits": forward(dense, SUPER, ids).float()[None]}, path / "reference_logits.pt"
    )
    return {"nemotron-h-moe-exl3": path}
