"""Tier 1: each llama-tiny pack, dequantized by the core codec and run in transformers on CPU, reproduces the logits
exllamav3's own kernels produced (reference_logits.pt)."""

import pytest
import torch

from quantpack_core.compare import agreement, kl_per_position, outside_router_ties
from quantpack_core.reference import dense_transformers_model, router_margins

transformers = pytest.importorskip("transformers")

LLAMA_PACKS = [
    "llama-tiny-exl3-4.0bpw-mul1",
    "llama-tiny-exl3-4.0bpw-mcg",
    "llama-tiny-exl3-3.0bpw-3inst-h8",
    "llama-tiny-exl3-2.5bpw-mul1",
    "llama-tiny-exl3-mcg-k2k3",
]


def reproduces_reference(fixtures_dir, name, model) -> None:
    """``model`` (the pack's dense weights in transformers) gives the pack's exllamav3 reference logits back:
    KL <= 1e-4, top-1 >= 99%."""
    ref = torch.load(fixtures_dir / name / "reference_logits.pt")
    with torch.no_grad():
        logits = model(ref["input_ids"]).logits
    a = agreement(ref["logits"], logits)
    print(f"{name}: {a}")
    assert a.kl <= 1e-4
    assert a.top1 >= 0.99


@pytest.mark.parametrize("name", LLAMA_PACKS)
def test_dequantized_pack_reproduces_exllamav3_logits(fixtures_dir, name):
    reproduces_reference(fixtures_dir, name, dense_transformers_model(fixtures_dir / name, "LlamaForCausalLM"))


def test_qwen3_5_pack_loads_completely_into_transformers(fixtures_dir):
    """The Qwen3.5 pack (GDN in_proj_qkv / in_proj_z, dense in_proj_b / in_proj_a) dequantizes into every parameter
    of transformers' model; the vLLM layer tests use this as their reference."""
    model = dense_transformers_model(
        fixtures_dir / "qwen3_5-tiny-exl3-4.0bpw-mul1", "Qwen3_5ForCausalLM", rename=("model.language_model.", "model.")
    )
    ids = torch.load(fixtures_dir / "llama-tiny-exl3-4.0bpw-mul1" / "reference_logits.pt")["input_ids"]
    with torch.no_grad():
        out = model(ids, labels=ids)
    # trained to about 2.26 nats on held-out Python source (REPORT.json); an undecodable pack gives ~ln(1024) = 6.9
    assert out.loss.item() < 3.5


def test_qwen3_5_mcg_pack_reproduces_exllamav3_logits(fixtures_dir):
    """The Qwen3.5 mcg pack (fixtures/tools/make_mcg_packs.py; escha's GPU tests convert it) carries exllamav3's own
    logits: the core codec's weights in transformers reproduce them (measured KL 2.1e-5, top-1 100%)."""
    name = "qwen3_5-tiny-exl3-4.0bpw-mcg"
    model = dense_transformers_model(
        fixtures_dir / name, "Qwen3_5ForCausalLM", rename=("model.language_model.", "model.")
    )
    reproduces_reference(fixtures_dir, name, model)


def test_qwen3_next_pack_reproduces_exllamav3_logits(fixtures_dir):
    """The Qwen3-Next pack (fused GDN in_proj_qkvz, dense in_proj_ba, 8 routed experts + a 640-wide shared expert),
    dequantized into transformers, against exllamav3's own forward (fp16 kernels). Top-2 routing over 8 experts
    turns rounding-level differences into a different expert pair where two router scores nearly tie: on this
    prompt one position of 127 (46: KL 0.39 there, margin 9e-5) carries almost all of the mean. A position leaves
    the mean only at a router near-tie of this forward where it departed (``compare.outside_router_ties``: 46 and
    four more of KL 3.5e-4 to 2.1e-3, measured); the rest must agree as closely as the dense fixtures do."""
    split = moe_pack_against_exllamav3(fixtures_dir / "qwen3next-tiny-exl3-4.0bpw-mul1", bound=2e-4, top1=0.98)
    assert 46 in [e["position"] for e in split.excluded], split.excluded


@pytest.mark.parametrize("name", ["qwen3moe-tiny-exl3-4.0bpw-mul1", "qwen3moe-tiny-exl3-3.0bpw-mul1-hq"])
def test_qwen3moe_packs_reproduce_exllamav3_logits(fixtures_dir, name):
    """Both Qwen3-MoE packs, dequantized into transformers, against exllamav3's fp16 forward. The 3.0 bpw pack has
    one token (position 80) whose layer-0 second and third router scores lie 8e-5 apart: exllamav3's fp16 router
    takes the other expert there, so that one position leaves the mean (``compare.outside_router_ties``); the 4.0
    bpw pack has none, and every position counts."""
    split = moe_pack_against_exllamav3(fixtures_dir / name, bound=1e-4, top1=0.99)
    assert [e["position"] for e in split.excluded] == ([80] if "3.0bpw" in name else [])


def moe_pack_against_exllamav3(pack_dir, bound: float, top1: float):
    """The MoE pack's decoded weights in transformers (float32) against its exllamav3 reference logits: the mean KL
    outside the router near-ties that departed within ``bound``, top-1 at least ``top1``. Returns the split."""
    model = dense_transformers_model(pack_dir)  # Qwen3-Next's experts fused into transformers 5's layout
    ref = torch.load(pack_dir / "reference_logits.pt")
    with torch.no_grad():
        logits = model(ref["input_ids"]).logits
    split = outside_router_ties(
        kl_per_position(ref["logits"][0], logits[0]), router_margins(model, ref["input_ids"]), bound
    )
    a = agreement(ref["logits"], logits)
    print(f"{pack_dir.name}: {a}; outside the departed router near-ties {split}")
    assert split.kl <= bound
    assert a.top1 >= top1
    return split


def test_mixed_k_pack_reference_is_reproducible(fixtures_dir):
    """The mixed-K pack's stored reference (fixtures/tools/make_qwen3moe_mixed_k.py) is what the core codec and
    transformers give for its tensors today, routing included; and its experts do span four (K gate/up, K down)
    pairs per layer."""
    from quantpack_core import Pack
    from quantpack_core.reference import router_top_k

    pack_dir = fixtures_dir / "qwen3moe-tiny-exl3-mixed-k"
    ref = torch.load(pack_dir / "reference_logits.pt")
    model = dense_transformers_model(pack_dir)
    with torch.no_grad():
        logits = model(ref["input_ids"]).logits
    torch.testing.assert_close(logits, ref["logits"], rtol=1e-4, atol=1e-4)
    picks = router_top_k(model, ref["input_ids"])
    assert all(torch.equal(picks[i], ref["routing"][i]) for i in (0, 1))
    pack = Pack.open(pack_dir)
    for layer in (0, 1):
        pairs = {
            (pack.modules[f"model.layers.{layer}.mlp.experts.{e}.gate_proj"].k_bits,
             pack.modules[f"model.layers.{layer}.mlp.experts.{e}.down_proj"].k_bits)
            for e in range(8)
        }  # fmt: skip
        assert pairs == {(4, 4), (3, 4), (4, 3), (3, 3)}
