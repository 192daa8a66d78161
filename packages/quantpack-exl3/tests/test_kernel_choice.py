"""The per-shard kernel choice on vLLM's own layers: a stand-in kernel inserted first in the CPU priority list that
accepts only K=4 shards runs those, the reference kernel runs the rest, the layer's output is the fp64 reference of
every shard, and the model's table logs both kernels with the stand-in's reason for the shards it declined. The
stand-in computes its shards with the core codec's fp64 forward on every call (a second implementation, not a
constant); nothing is mocked. Also: the error when no kernel accepts, and the config-time error on a platform with
no kernel."""

import logging

import pytest
import torch
from test_exl3_layers import feed, make_config, ref_out

from quantpack_core import Exl3Tensors, reference_linear
from quantpack_core.codec import Codebook
from quantpack_core.compare import relative_error
from quantpack_core.kernels import LinearKernel, LinearSpec, PreparedShard
from quantpack_core.synthetic import random_exl3_layer

pytest.importorskip("vllm")

CODEBOOKS = list(Codebook)


def stand_in_gemm(x, trellis, suh, svh, codebook: int, out_features: int, out, col: int) -> None:
    """``out[:, col:col + n] = x @ W`` with the shard decoded by the core codec in float64 on every call."""
    t = Exl3Tensors(trellis, suh, svh, CODEBOOKS[codebook])
    y = reference_linear(x.double(), t, torch.float64, out_features=out_features)
    out.narrow(1, col, out_features).copy_(y.to(out.dtype))


class StandInKernel(LinearKernel):
    """Accepts EXL3 shards at K=4 only; keeps the shard as stored and decodes it at every call."""

    name = "stand-in"

    @classmethod
    def can_implement(cls, spec: LinearSpec):
        if spec.format != "exl3" or spec.k_bits != 4:
            return False, f"takes K=4 only, this shard is K={spec.k_bits:g}"
        return True, None

    @classmethod
    def prepare(cls, shard: Exl3Tensors, spec: LinearSpec, device) -> PreparedShard:
        tensors = {"trellis": shard.trellis.clone(), "suh": shard.suh.clone(), "svh": shard.svh.clone()}
        static = (CODEBOOKS.index(shard.codebook), spec.out_features)
        return PreparedShard(stand_in_gemm, tensors, spec.out_features, static)


def shards():
    g = torch.Generator().manual_seed(3)
    return {
        "q": random_exl3_layer(256, 256, 2, "3inst", generator=g),
        "k": random_exl3_layer(256, 128, 4, "mcg", generator=g),
        "v": random_exl3_layer(256, 128, 4, "mul1", generator=g),
    }


def qkv(config):
    from vllm.model_executor.layers.linear import QKVParallelLinear

    return QKVParallelLinear(
        256, 64, 4, 2, bias=False, quant_config=config, prefix="model.layers.0.self_attn.qkv_proj",
        params_dtype=torch.float32,
    )  # fmt: skip


def test_stand_in_takes_the_shards_it_accepts_and_the_next_kernel_the_rest(vllm_layers, caplog):
    config = make_config(vllm_layers)
    assert [k.name for k in config.linear_kernels] == ["reference"]  # the CPU list
    config.linear_kernels = (StandInKernel, *config.linear_kernels)
    layer = qkv(config)
    tensors = shards()
    for sid, t in tensors.items():
        feed(layer, t, sid)
    with caplog.at_level(logging.INFO, logger="vllm.quantpack"):
        layer.quant_method.process_weights_after_loading(layer)
    assert [run.kernel for run in layer.quant_state.runs] == ["reference", "stand-in", "stand-in"]
    assert {n for n, _ in layer.named_parameters()} == {
        "shard0_weight", "shard1_trellis", "shard1_suh", "shard1_svh", "shard2_trellis", "shard2_suh", "shard2_svh",
    }  # fmt: skip
    x = torch.randn(5, 256)
    y = layer.quant_method.apply(layer, x)
    want = ref_out(x, [Exl3Tensors.from_tensors(tensors[s]) for s in "qkv"], [256, 128, 128])
    assert relative_error(y, want) < 1e-5
    tables = [r.getMessage() for r in caplog.records if "kernels chosen per shard" in r.getMessage()]
    assert len(tables) == 1, tables
    table = tables[0]
    assert "linear   stand-in              2 shards" in table
    assert "linear   reference             1 shard" in table
    assert "linear   stand-in         declined 1: takes K=4 only, this shard is K=2" in table


def stand_in_fused(x, *tensors_and_static) -> None:
    """A fused run of stand-in shards: ``(trellis, suh, svh) x n, codebooks, widths, out, col``, each shard decoded
    by the core codec in float64 and written after the previous one."""
    *flat, codebooks, widths, out, col = tensors_and_static
    for i, (codebook, width) in enumerate(zip(codebooks, widths, strict=True)):
        stand_in_gemm(x, *flat[3 * i : 3 * i + 3], codebook, width, out, col)
        col += width


class FusingStandInKernel(StandInKernel):
    """The stand-in, fusing any group of its shards into one run (one op call writing their columns in order)."""

    name = "fusing-stand-in"

    @classmethod
    def fuse(cls, shards: list[PreparedShard]) -> PreparedShard:
        tensors = {f"{name}{i}": t for i, s in enumerate(shards) for name, t in s.tensors.items()}
        codebooks, widths = [s.static[0] for s in shards], [s.static[1] for s in shards]
        return PreparedShard(stand_in_fused, tensors, sum(widths), (codebooks, widths))


def test_consecutive_shards_of_one_kernel_run_fused(vllm_layers):
    """q goes to the reference kernel (K=2), k and v to a stand-in that fuses: two runs, the second writing both
    shards' columns, and the output is still every shard's fp64 reference. With every shard on the reference kernel,
    the three are one GEMM over the concatenated dense weights."""
    tensors = shards()
    want_of = lambda x: ref_out(x, [Exl3Tensors.from_tensors(tensors[s]) for s in "qkv"], [256, 128, 128])  # noqa: E731
    config = make_config(vllm_layers)
    config.linear_kernels = (FusingStandInKernel, *config.linear_kernels)
    layer = qkv(config)
    for sid, t in tensors.items():
        feed(layer, t, sid)
    layer.quant_method.process_weights_after_loading(layer)
    assert [(run.kernel, run.col) for run in layer.quant_state.runs] == [("reference", 0), ("fusing-stand-in", 256)]
    x = torch.randn(5, 256)
    assert relative_error(layer.quant_method.apply(layer, x), want_of(x)) < 1e-5

    layer = qkv(make_config(vllm_layers))
    for sid, t in tensors.items():
        feed(layer, t, sid)
    layer.quant_method.process_weights_after_loading(layer)
    assert [run.kernel for run in layer.quant_state.runs] == ["reference"]
    held = getattr(layer.quant_state.runs[0].fn, "shape", None)  # vLLM's CPU GEMM packed it: the shape it took
    assert tuple(held or layer.shard0_weight.shape) == (256, 512)
    assert relative_error(layer.quant_method.apply(layer, x), want_of(x)) < 1e-5


def test_each_shards_kernel_is_told_the_engines_largest_call(vllm_layers, monkeypatch):
    """The scheduler's token budget (``max_num_batched_tokens``, the most rows a forward pass gives a layer) reaches
    every shard's spec as ``max_rows``: the trellis_mma kernels time no row bucket above it."""
    from vllm.config import get_current_vllm_config

    monkeypatch.setattr(get_current_vllm_config().scheduler_config, "max_num_batched_tokens", 300)
    told = []

    class TellingStandIn(StandInKernel):
        name = "telling-stand-in"

        @classmethod
        def can_implement(cls, spec: LinearSpec):
            return spec.format == "exl3", None if spec.format == "exl3" else "takes EXL3 shards"

        @classmethod
        def prepare(cls, shard: Exl3Tensors, spec: LinearSpec, device) -> PreparedShard:
            told.append(spec.max_rows)
            return super().prepare(shard, spec, device)

    config = make_config(vllm_layers)
    config.linear_kernels = (TellingStandIn, *config.linear_kernels)
    layer = qkv(config)
    tensors = shards()
    for sid, t in tensors.items():
        feed(layer, t, sid)
    layer.quant_method.process_weights_after_loading(layer)
    assert told == [300, 300, 300]
    x = torch.randn(3, 256)
    want = ref_out(x, [Exl3Tensors.from_tensors(tensors[s]) for s in "qkv"], [256, 128, 128])
    assert relative_error(layer.quant_method.apply(layer, x), want) < 1e-5


@pytest.mark.parametrize("encoder", ["is_multimodal_model", "is_encoder_decoder"])
def test_a_model_with_an_encoder_gives_its_kernels_no_row_limit(vllm_layers, monkeypatch, encoder):
    """A vision tower's blocks run on an image's patches (four per token before Qwen's merge), up to the encoder's own
    budget: no layer of such a model is told the scheduler's token budget."""
    from types import SimpleNamespace

    from vllm.config import get_current_vllm_config

    from quantpack_core.vllm.compile_key import engine_max_rows

    vllm_config = get_current_vllm_config()
    monkeypatch.setattr(vllm_config.scheduler_config, "max_num_batched_tokens", 300)
    assert engine_max_rows() == 300
    model = SimpleNamespace(is_multimodal_model=False, is_encoder_decoder=False)
    monkeypatch.setattr(vllm_config, "model_config", model)
    assert engine_max_rows() == 300
    setattr(model, encoder, True)
    assert engine_max_rows() is None


def test_the_table_waits_for_the_models_last_layer(vllm_layers, caplog):
    """Two layers of one model: nothing is logged after the first is processed, one table after the second."""
    config = make_config(vllm_layers)
    first, second = qkv(config), qkv(config)
    for layer in (first, second):
        for sid, t in shards().items():
            feed(layer, t, sid)
    with caplog.at_level(logging.INFO, logger="vllm.quantpack"):
        first.quant_method.process_weights_after_loading(first)
        assert not [r for r in caplog.records if "kernels chosen" in r.getMessage()]
        second.quant_method.process_weights_after_loading(second)
    tables = [r.getMessage() for r in caplog.records if "kernels chosen" in r.getMessage()]
    assert len(tables) == 1 and "linear   reference             6 shards" in tables[0], tables


def test_no_kernel_accepting_a_shard_names_every_reason(vllm_layers):
    from quantpack_core.errors import NoKernelError

    config = make_config(vllm_layers)
    config.linear_kernels = (StandInKernel,)
    layer = qkv(config)
    for sid, t in shards().items():
        feed(layer, t, sid)
    with pytest.raises(NoKernelError, match=r"qkv_proj: shard 'q' .*exl3 K=2 3inst 256x256 .*stand-in: takes K=4 only"):
        layer.quant_method.process_weights_after_loading(layer)


class ValueRefusingKernel(StandInKernel):
    """Accepts K=4 shards by their spec, then refuses one's values at prepare, as a kernel whose float16 scales
    cannot hold a shard's does (escha's trellis_mma backend)."""

    name = "value-refusing"

    @classmethod
    def prepare(cls, shard: Exl3Tensors, spec: LinearSpec, device) -> PreparedShard:
        from quantpack_core.errors import LayerLoadError

        raise LayerLoadError("its scales do not fit this kernel - set QUANTPACK_EXL3_BACKEND=reference")


def test_a_kernel_refusing_a_shards_values_at_prepare_is_named_with_the_layer_and_shard(vllm_layers):
    from quantpack_core.errors import LayerLoadError

    config = make_config(vllm_layers)
    config.linear_kernels = (ValueRefusingKernel, *config.linear_kernels)
    layer = qkv(config)
    for sid, t in shards().items():
        feed(layer, t, sid)
    named = r"qkv_proj: shard 'k' \(model\.layers\.0\.self_attn\.k_proj\): its scales do not fit"
    with pytest.raises(LayerLoadError, match=named):
        layer.quant_method.process_weights_after_loading(layer)


def test_platform_without_any_kernel_fails_at_config_time():
    from quantpack_core.errors import BackendUnavailableError
    from quantpack_core.kernels import ROCM, Platform
    from quantpack_exl3.config import Exl3Config

    with pytest.raises(BackendUnavailableError, match=r"no EXL3 kernel for rocm.*QUANTPACK_EXL3_BACKEND=reference"):
        Exl3Config.resolve_kernels(Platform(ROCM, arch="gfx1201"))


def _trellis_mma_shard(in_tiles: int, out_features: int, codebook: int, k_bits: float) -> PreparedShard:
    """A prepared trellis_mma shard as ``prepare`` returns it and records it (its model's dtype, which fuse reads;
    CPU tensors: fuse only groups, it never launches)."""
    from quantpack_core.trellis_mma import kernels
    from quantpack_core.trellis_mma.ops import trellis_mma_

    tensors = {
        "trellis": torch.zeros((in_tiles, out_features // 16, int(16 * k_bits)), dtype=torch.int16),
        "suh": torch.ones(in_tiles * 16, dtype=torch.float16),
        "svh": torch.ones(out_features, dtype=torch.float16),
    }
    kernels._act_dtypes[tensors["trellis"]] = torch.bfloat16
    kernels._act_dtypes[tensors["trellis"]] = torch.bfloat16  # recorded again, as a re-prepared shard would be
    return PreparedShard(trellis_mma_, tensors, out_features, (codebook, float(k_bits), out_features, 0))


def test_trellis_mma_fuses_shards_of_one_k_and_codebook_into_one_run():
    """q / k / v of one K, codebook and input width become one run over a table of the same tensors (no copy), the
    out_features in order; a different K, codebook or width, a single shard, or more shards than one launch runs
    keep one run per shard."""
    from quantpack_core.trellis_mma.ops import MAX_SHARDS, trellis_mma_shards_
    from quantpack_exl3.backends.trellis_mma import TrellisMmaLinearKernel

    q, k, v = (_trellis_mma_shard(256, o, 2, 4.0) for o in (4096, 1024, 1024))
    fused = TrellisMmaLinearKernel.fuse([q, k, v])
    assert fused.run is trellis_mma_shards_ and fused.out_features == 6144
    assert fused.static == (2, 4.0, (4096, 1024, 1024), 0)  # delegated 0: no GPU workspace, nothing measured
    assert list(fused.tensors) == [f"{n}{i}" for i in range(3) for n in ("trellis", "suh", "svh")]
    assert fused.tensors["trellis1"] is k.tensors["trellis"] and fused.tensors["svh2"] is v.tensors["svh"]
    for odd in (
        _trellis_mma_shard(256, 1024, 2, 3.0),
        _trellis_mma_shard(256, 1024, 1, 4.0),
        _trellis_mma_shard(128, 1024, 2, 4.0),
    ):
        assert TrellisMmaLinearKernel.fuse([q, k, odd]) is None
    assert TrellisMmaLinearKernel.fuse([q]) is None
    assert TrellisMmaLinearKernel.fuse([_trellis_mma_shard(256, 128, 2, 4.0)] * (MAX_SHARDS + 1)) is None
    assert TrellisMmaLinearKernel.fuse([_trellis_mma_shard(256, 128, 2, 4.0)] * MAX_SHARDS) is not None


def _plan_of(vllm_layers, kernels=()):
    """The compile-key digest vLLM's current config holds after one qkv layer of ``shards()`` is processed with
    ``kernels`` put first in the CPU list, and that config's hash."""
    import pickle

    from vllm.config import get_current_vllm_config

    from quantpack_core.vllm.compile_key import PLAN_KEY

    config = make_config(vllm_layers)
    config.linear_kernels = (*kernels, *config.linear_kernels)
    layer = qkv(config)
    for sid, t in shards().items():
        feed(layer, t, sid)
    layer.quant_method.process_weights_after_loading(layer)
    vllm_config = get_current_vllm_config()
    # vLLM pickles the quant config into its engine process (the serve test failed on a hash object in it)
    assert pickle.loads(pickle.dumps(config.compile_key)).digest == config.compile_key.digest
    return vllm_config.additional_config[PLAN_KEY], vllm_config.compute_hash()


def test_the_kernel_plan_joins_vllms_compile_cache_key(vllm_layers):
    """vLLM keys its compile cache on ``VllmConfig.compute_hash()``; the kernels chosen per shard change the traced
    graph (ops, parameter names), so they must change that hash: the same plan twice gives the same key (no
    addresses in it), another plan (a fusing kernel taking k and v) another key, and the user's own
    ``additional_config`` entries stay."""
    from vllm.config import get_current_vllm_config

    extra = get_current_vllm_config().additional_config
    extra["user_setting"] = "kept"
    plan, config_hash = _plan_of(vllm_layers)
    again, config_hash_again = _plan_of(vllm_layers)
    fused, config_hash_fused = _plan_of(vllm_layers, (FusingStandInKernel,))
    assert plan == again and config_hash == config_hash_again
    assert fused != plan and config_hash_fused != config_hash
    assert extra["user_setting"] == "kept"
    extra.pop("user_setting")
