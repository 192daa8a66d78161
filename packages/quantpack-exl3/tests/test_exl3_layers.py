"""Tier 2, layer level: vLLM's own linear layers built with the EXL3 method, loaded through vLLM's weight-loading
paths with the shard ids its model files use, against the core codec's fp64 reference."""

import json
import sys

import pytest
import torch

from quantpack_core import Exl3Tensors, Pack, reference_linear
from quantpack_core.compare import relative_error
from quantpack_core.synthetic import random_exl3_layer

torch.manual_seed(0)


def make_config(cfg_cls, pack=None):
    qc = {"quant_method": "exl3", "bits": 4.0, "head_bits": 6, "codebook": "mul1"}
    if pack is not None:
        qc["tensor_storage"] = pack.manifest
    return cfg_cls.from_config(qc)


def ref_out(x, shards, outs):
    """fp64 reference: each shard through the core codec, trimmed to its logical width, concatenated."""
    return torch.cat(
        [reference_linear(x.double(), t, torch.float64, out_features=o) for t, o in zip(shards, outs, strict=True)], -1
    )


def feed(layer, prefix_tensors, shard_id=None):
    """Hand a module's tensors to the layer as vLLM's loaders do: ``param.weight_loader(param, w[, shard_id])``."""
    for suffix, w in prefix_tensors.items():
        param = getattr(layer, suffix, None)
        if param is None:
            continue
        if shard_id is None:
            param.weight_loader(param, w)
        else:
            param.weight_loader(param, w, shard_id)


def finish(layer):
    layer.quant_method.process_weights_after_loading(layer)


# ------------------------------------------------------------------------------------------- llama-tiny layers


@pytest.fixture(scope="module")
def llama(fixtures_dir):
    return Pack.open(fixtures_dir / "llama-tiny-exl3-4.0bpw-mul1")


def test_qkv_gate_up_down_o_and_head_of_llama_pack(vllm_layers, llama):
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    cfg = make_config(vllm_layers, llama)
    p = "model.layers.1"
    qkv = QKVParallelLinear(
        256, 64, 4, 2, bias=False, quant_config=cfg, prefix=f"{p}.self_attn.qkv_proj", params_dtype=torch.float32
    )
    for sid, name in zip("qkv", ("q_proj", "k_proj", "v_proj"), strict=True):
        feed(qkv, llama.module_tensors(f"{p}.self_attn.{name}"), sid)
    gate_up = MergedColumnParallelLinear(
        256, [640, 640], bias=False, quant_config=cfg, prefix=f"{p}.mlp.gate_up_proj", params_dtype=torch.float32
    )
    for sid, name in enumerate(("gate_proj", "up_proj")):
        feed(gate_up, llama.module_tensors(f"{p}.mlp.{name}"), sid)
    down = RowParallelLinear(
        640, 256, bias=False, quant_config=cfg, prefix=f"{p}.mlp.down_proj", params_dtype=torch.float32
    )
    feed(down, llama.module_tensors(f"{p}.mlp.down_proj"))
    o = RowParallelLinear(
        256, 256, bias=False, quant_config=cfg, prefix=f"{p}.self_attn.o_proj", params_dtype=torch.float32
    )
    feed(o, llama.module_tensors(f"{p}.self_attn.o_proj"))
    head = ParallelLMHead(1024, 256, quant_config=cfg, prefix="lm_head", params_dtype=torch.float32)
    feed(head, llama.module_tensors("lm_head"))
    cases = [
        (qkv, [f"{p}.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj")], [256, 128, 128], 256),
        (gate_up, [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"], [640, 640], 256),
        (down, [f"{p}.mlp.down_proj"], [256], 640),
        (o, [f"{p}.self_attn.o_proj"], [256], 256),
        (head, ["lm_head"], [1024], 256),
    ]
    for layer, mods, outs, width in cases:
        finish(layer)
        x = torch.randn(7, width)
        y = layer.quant_method.apply(layer, x)
        expect = ref_out(x, [llama.exl3_tensors(m) for m in mods], outs)
        assert y.shape == expect.shape
        assert relative_error(y, expect) < 1e-5, mods


# ----------------------------------------------------------------------------------------- qwen3_5-tiny layers


@pytest.fixture(scope="module")
def qwen(fixtures_dir):
    return Pack.open(fixtures_dir / "qwen3_5-tiny-exl3-4.0bpw-mul1")


QWEN_STACKED = {  # vLLM's Qwen3_5Model.hf_to_vllm_mapper orig_to_new_stacked (vllm/model_executor/models/qwen3_5.py)
    ".in_proj_qkv": (".in_proj_qkvz", (0, 1, 2)),
    ".in_proj_z": (".in_proj_qkvz", 3),
    ".in_proj_b": (".in_proj_ba", 0),
    ".in_proj_a": (".in_proj_ba", 1),
    ".q_proj": (".qkv_proj", "q"),
    ".k_proj": (".qkv_proj", "k"),
    ".v_proj": (".qkv_proj", "v"),
    ".gate_proj": (".gate_up_proj", 0),
    ".up_proj": (".gate_up_proj", 1),
}


class QwenLinears(torch.nn.Module):
    """The linear layers of the qwen3_5-tiny text model under vLLM's names (``language_model.model.layers.N``), built
    as vLLM's Qwen3.5 / GDN / attention / MLP modules build them."""

    def __init__(self, cfg, qcfg):
        from vllm.model_executor.layers.linear import (
            MergedColumnParallelLinear,
            QKVParallelLinear,
            RowParallelLinear,
        )
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        super().__init__()
        h, f32 = cfg["hidden_size"], torch.float32
        key_dim = cfg["linear_key_head_dim"] * cfg["linear_num_key_heads"]
        value_dim = cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"]
        nv = cfg["linear_num_value_heads"]
        self.layers = torch.nn.ModuleList()
        for i, kind in enumerate(cfg["layer_types"]):
            pre = f"language_model.model.layers.{i}"
            blk = torch.nn.Module()
            if kind == "linear_attention":
                blk.linear_attn = torch.nn.Module()
                blk.linear_attn.in_proj_qkvz = MergedColumnParallelLinear(
                    h,
                    [key_dim, key_dim, value_dim, value_dim],
                    bias=False,
                    quant_config=qcfg,
                    prefix=f"{pre}.linear_attn.in_proj_qkvz",
                    params_dtype=f32,
                )
                blk.linear_attn.in_proj_ba = MergedColumnParallelLinear(
                    h, [nv, nv], bias=False, quant_config=qcfg, prefix=f"{pre}.linear_attn.in_proj_ba", params_dtype=f32
                )
                blk.linear_attn.out_proj = RowParallelLinear(
                    value_dim, h, bias=False, quant_config=qcfg, prefix=f"{pre}.linear_attn.out_proj", params_dtype=f32
                )
            else:
                heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
                blk.self_attn = torch.nn.Module()
                # Qwen3.5 attention has an output gate: q_proj carries 2 * heads * head_dim.
                blk.self_attn.qkv_proj = QKVParallelLinear(
                    h,
                    hd,
                    heads * 2,
                    kv,
                    bias=False,
                    quant_config=qcfg,
                    prefix=f"{pre}.self_attn.qkv_proj",
                    params_dtype=f32,
                )
                blk.self_attn.o_proj = RowParallelLinear(
                    heads * hd, h, bias=False, quant_config=qcfg, prefix=f"{pre}.self_attn.o_proj", params_dtype=f32
                )
            blk.mlp = torch.nn.Module()
            inter = cfg["intermediate_size"]
            blk.mlp.gate_up_proj = MergedColumnParallelLinear(
                h, [inter, inter], bias=False, quant_config=qcfg, prefix=f"{pre}.mlp.gate_up_proj", params_dtype=f32
            )
            blk.mlp.down_proj = RowParallelLinear(
                inter, h, bias=False, quant_config=qcfg, prefix=f"{pre}.mlp.down_proj", params_dtype=f32
            )
            self.layers.append(blk)
        self.lm_head = ParallelLMHead(
            cfg["vocab_size"], h, quant_config=qcfg, prefix="language_model.lm_head", params_dtype=f32
        )


def load_qwen_linears(vllm_layers, qwen):
    """Load every linear tensor of the pack through vLLM's AutoWeightsLoader with the Qwen3.5 mapping (tuple shard
    id (0, 1, 2) for in_proj_qkv) and run process_weights_after_loading on every layer."""
    from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper

    cfg = json.loads((qwen.path / "config.json").read_text())
    model = QwenLinears(cfg, make_config(vllm_layers, qwen))
    mapper = WeightsMapper(
        orig_to_new_prefix={"model.language_model.": "layers_root.", "lm_head.": "lm_head."},
        orig_to_new_stacked=QWEN_STACKED,
    )
    wanted = (
        "linear_attn.in_proj",
        "linear_attn.out_proj",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.",
        "lm_head.",
    )
    linear = ((n, t) for n, t in qwen.iter_tensors() if any(w in n for w in wanted))
    weights = ((n.replace("layers_root.layers.", "layers."), t) for n, t in mapper.apply(linear))
    AutoWeightsLoader(model).load_weights(weights)
    for m in model.modules():
        if hasattr(m, "quant_method"):
            m.quant_method.process_weights_after_loading(m)
    return model, cfg


def test_every_linear_layer_of_qwen3_5_pack(vllm_layers, qwen):
    """Qwen3.5 GDN: in_proj_qkv + in_proj_z (K and suh of their own) under vLLM's fused in_proj_qkvz with tuple shard
    ids, dense in_proj_b / in_proj_a under in_proj_ba, gated attention qkv, MLP and the head."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    model, cfg = load_qwen_linears(vllm_layers, qwen)
    root = "model.language_model.layers"
    checked = 0
    for i, kind in enumerate(cfg["layer_types"]):
        blk = model.layers[i]
        if kind == "linear_attention":
            la = blk.linear_attn
            groups = [
                (la.in_proj_qkvz, ["in_proj_qkv", "in_proj_z"], [512, 256], "linear_attn"),
                (la.out_proj, ["out_proj"], [256], "linear_attn"),
            ]
            assert isinstance(la.in_proj_ba.quant_method, UnquantizedLinearMethod)
            x = torch.randn(5, 256)
            wb = qwen.get_tensor(f"{root}.{i}.linear_attn.in_proj_b.weight").double()
            wa = qwen.get_tensor(f"{root}.{i}.linear_attn.in_proj_a.weight").double()
            y = la.in_proj_ba.quant_method.apply(la.in_proj_ba, x)
            assert relative_error(y, x.double() @ torch.cat([wb, wa]).T) < 1e-6
        else:
            groups = [
                (blk.self_attn.qkv_proj, ["q_proj", "k_proj", "v_proj"], [512, 128, 128], "self_attn"),
                (blk.self_attn.o_proj, ["o_proj"], [256], "self_attn"),
            ]
        groups += [
            (blk.mlp.gate_up_proj, ["gate_proj", "up_proj"], [640, 640], "mlp"),
            (blk.mlp.down_proj, ["down_proj"], [256], "mlp"),
        ]
        for layer, names, outs, sub in groups:
            x = torch.randn(5, layer.input_size)
            y = layer.quant_method.apply(layer, x)
            shards = [qwen.exl3_tensors(f"{root}.{i}.{sub}.{n}") for n in names]
            assert relative_error(y, ref_out(x, shards, outs)) < 1e-5, (i, names)
            checked += 1
    x = torch.randn(3, 256)
    y = model.lm_head.quant_method.apply(model.lm_head, x)
    assert relative_error(y, ref_out(x, [qwen.exl3_tensors("lm_head")], [1024])) < 1e-5
    assert checked == 3 * 4 + 4


def test_qwen3_5_layers_reproduce_dense_transformers_weights(vllm_layers, qwen):
    """The same layers against the second implementation: the pack dequantized into transformers' Qwen3.5 weights
    (nn.Linear layout), fused in vLLM's shard order."""
    model, _cfg = load_qwen_linears(vllm_layers, qwen)
    dense = qwen.dense_state_dict(torch.float64)
    la = model.layers[0].linear_attn
    root = "model.language_model.layers.0.linear_attn"
    w = torch.cat([dense[f"{root}.in_proj_qkv.weight"], dense[f"{root}.in_proj_z.weight"]])
    x = torch.randn(4, 256, dtype=torch.float64)
    y = la.in_proj_qkvz.quant_method.apply(la.in_proj_qkvz, x.float())
    assert relative_error(y, x @ w.T) < 1e-5


# ------------------------------------------------------------------------------- mixed K, padding, dtype, release


def synthetic(prefix, in_f, out_f, k, cb, seed):
    g = torch.Generator().manual_seed(seed)
    return random_exl3_layer(in_f, out_f, k, cb, generator=g)


def test_mixed_k_and_codebooks_across_shards(vllm_layers):
    from vllm.model_executor.layers.linear import QKVParallelLinear

    cfg = make_config(vllm_layers)
    layer = QKVParallelLinear(
        256, 64, 4, 2, bias=False, quant_config=cfg, prefix="l.qkv_proj", params_dtype=torch.float32
    )
    shards = {
        "q": synthetic("q", 256, 256, 2, "3inst", 1),
        "k": synthetic("k", 256, 128, 5, "mcg", 2),
        "v": synthetic("v", 256, 128, 3.5, "mul1", 3),
    }
    for sid in ("v", "q", "k"):  # arrival order must not matter
        feed(layer, shards[sid], sid)
    finish(layer)
    x = torch.randn(9, 256)
    y = layer.quant_method.apply(layer, x)
    expect = ref_out(x, [Exl3Tensors.from_tensors(shards[s]) for s in "qkv"], [256, 128, 128])
    assert relative_error(y, expect) < 1e-5


def test_one_run_layer_returns_vllms_cpu_gemm_product_with_its_bias(vllm_layers):
    """On CPU a qkv layer's three shards are one dense run in vLLM's own CPU GEMM, and apply() returns that GEMM's
    product with the bias added inside it (no output buffer): equal to the run's op writing into a buffer plus the
    bias, and to the fp64 reference."""
    from vllm.model_executor.layers.linear import QKVParallelLinear

    layer = QKVParallelLinear(
        256, 64, 4, 2, bias=False, quant_config=make_config(vllm_layers), prefix="l.qkv_proj",
        params_dtype=torch.float32,
    )  # fmt: skip
    shards = {s: synthetic(s, 256, n, 4, "mul1", i) for i, (s, n) in enumerate((("q", 256), ("k", 128), ("v", 128)))}
    for sid, t in shards.items():
        feed(layer, t, sid)
    finish(layer)
    state = layer.quant_state
    assert len(state.runs) == 1 and state.returns is not None
    x, bias = torch.randn(5, 256), torch.randn(512)
    y = layer.quant_method.apply(layer, x, bias)
    run = state.runs[0]
    out = torch.full((5, 512), float("nan"))
    run.fn(x, *[getattr(layer, n) for n in run.params], *run.static, out, run.col)
    torch.testing.assert_close(y, out + bias)
    expect = ref_out(x, [Exl3Tensors.from_tensors(shards[s]) for s in "qkv"], [256, 128, 128])
    assert relative_error(y - bias, expect) < 1e-5


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_padded_layer_pads_input_and_trims_output(vllm_layers, dtype, tol):
    """A 200 -> 300 layer is stored 256 x 384 (exllamav3 pads to 128): the input is zero-extended and the extra
    output columns are dropped, in every model dtype."""
    from vllm.model_executor.layers.linear import ReplicatedLinear

    cfg = make_config(vllm_layers)
    layer = ReplicatedLinear(200, 300, bias=True, quant_config=cfg, prefix="m.proj", params_dtype=dtype)
    t = synthetic("m.proj", 200, 300, 4, "mul1", 5)
    feed(layer, t)
    layer.weight_loader(layer.bias, torch.linspace(-1, 1, 300).to(dtype))
    finish(layer)
    x = torch.randn(4, 200).to(dtype)
    y, _ = layer(x)
    assert y.shape == (4, 300) and y.dtype == dtype
    expect = reference_linear(x.double(), Exl3Tensors.from_tensors(t), torch.float64, out_features=300)
    expect = expect + torch.linspace(-1, 1, 300).to(dtype).double()
    assert relative_error(y, expect) < tol


def test_host_copies_released_after_load(vllm_layers, llama):
    import weakref

    from vllm.model_executor.layers.linear import RowParallelLinear

    layer = RowParallelLinear(
        640,
        256,
        bias=False,
        quant_config=make_config(vllm_layers, llama),
        prefix="x.down_proj",
        params_dtype=torch.float32,
    )
    tensors = llama.module_tensors("model.layers.0.mlp.down_proj")
    refs = [weakref.ref(t) for t in tensors.values()]
    feed(layer, tensors)
    del tensors
    finish(layer)
    names = dict(layer.named_parameters())
    assert set(names) == {"shard0_weight"}, names  # no placeholder left
    import gc

    gc.collect()
    assert all(r() is None for r in refs), "a captured checkpoint tensor is still referenced"


def _rss_file_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc/self/maps are Linux's")
def test_processed_checkpoint_pages_leave_the_process(tmp_path):
    """The pages a captured safetensors view occupies leave the process's RSS once dropped, the tensor still reads
    the same values (the file keeps them), and memory that is not a private file mapping is never advised."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from quantpack_core.vllm.mapped import drop_file_pages

    g = torch.Generator().manual_seed(0)
    data = torch.randint(-32768, 32768, (2048, 2048), dtype=torch.int32, generator=g).to(torch.int16)  # 8 MiB
    save_file({"a.trellis": data}, str(tmp_path / "m.safetensors"))
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        view = f.get_tensor("a.trellis")
    before = _rss_file_kib()
    assert torch.equal(view, data)  # reads every page
    touched = _rss_file_kib()
    assert drop_file_pages([view]) >= data.numel() * 2
    assert touched - _rss_file_kib() > 6 * 1024, (before, touched, _rss_file_kib())
    assert torch.equal(view, data)
    anonymous = data.clone()
    assert drop_file_pages([anonymous]) == 0
    assert torch.equal(anonymous, data)


def test_dense_layers_stored_in_pack_converted_once(vllm_layers):
    """Without a manifest, a layer whose pack tensors are plain .weight (fp16) loads through the same method and is
    converted once to the model dtype."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    layer = MergedColumnParallelLinear(
        256,
        [4, 4],
        bias=False,
        quant_config=make_config(vllm_layers),
        prefix="a.in_proj_ba",
        params_dtype=torch.bfloat16,
    )
    wb, wa = torch.randn(4, 256).half(), torch.randn(4, 256).half()
    feed(layer, {"weight": wb}, 0)
    feed(layer, {"weight": wa}, 1)
    finish(layer)
    # both dense shards in one GEMM, in the model dtype, handed to vLLM's own CPU GEMM (which keeps a packed copy)
    from quantpack_core.vllm.cpu_linear import CpuGemm

    assert len(layer.quant_state.runs) == 1 and not hasattr(layer, "shard1_weight")
    fn = layer.quant_state.runs[0].fn
    assert isinstance(fn, CpuGemm) and fn.dtype == torch.bfloat16 and fn.shape == (256, 8)
    x = torch.randn(3, 256).to(torch.bfloat16)
    y = layer.quant_method.apply(layer, x)
    assert relative_error(y, x.double() @ torch.cat([wb, wa]).double().T) < 2e-2


def test_dense_lm_head(vllm_layers):
    """A pack whose head is a plain .weight over the unpadded vocabulary (1000 rows for vLLM's 1024-row head):
    through the manifest it goes to vLLM's own unquantized method; without a manifest through the EXL3 method,
    padded with zero rows."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod

    w = torch.randn(1000, 256)
    storage = {"lm_head": {"stored_tensors": {"lm_head.weight": {"shape": [1000, 256], "dtype": "torch.float32"}}}}
    with_manifest = vllm_layers.from_config({"quant_method": "exl3", "tensor_storage": storage})
    head = ParallelLMHead(1000, 256, quant_config=with_manifest, prefix="lm_head", params_dtype=torch.float32)
    assert isinstance(head.quant_method, UnquantizedEmbeddingMethod)

    head = ParallelLMHead(
        1000, 256, quant_config=make_config(vllm_layers), prefix="lm_head", params_dtype=torch.float32
    )
    feed(head, {"weight": w})
    finish(head)
    x = torch.randn(3, 256)
    y = head.quant_method.apply(head, x)
    assert y.shape == (3, 1024)
    assert relative_error(y[:, :1000], x.double() @ w.double().T) < 1e-6
    assert torch.equal(y[:, 1000:], torch.zeros(3, 24))
