"""The HIP backend without ROCm: its loader, kernel choice, workspace and launch are tested with the extension
replaced at its import boundary (``radiance_escha_kernel`` in ``sys.modules``) by a stand-in that reads the exact
memory the op hands it, through the raw pointers, and computes through the escha reference. A wrong dtype, a
non-contiguous buffer, an unzeroed pre-quantization max, a missing scratch or a wrong column offset shows up as a
wrong result or a failed check here. The real extension on gfx1201 was not run."""

import ctypes
import math
import sys

import pytest
import torch

from quantpack_core.kernels import ROCM, TP_WHOLE, LinearSpec, Platform, choose_kernel
from quantpack_core.synthetic import random_exl3_layer
from quantpack_escha.backends.hip import EschaHipLinearKernel, extension, ops
from quantpack_escha.codec import EschaTensors, reference_linear
from quantpack_escha.convert import split_scale

ROCM_GFX1201 = Platform(ROCM, arch="gfx1201")


def view(ptr: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor over host memory at ``ptr`` (what a kernel would read through the pointer)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=dtype).view(shape)


class StandIn:
    """The extension's interface (see quantpack_escha.backends.hip.extension), computing through the reference."""

    def __init__(self):
        self.scratch = None
        self.scratch_calls = 0
        self.launches = []

    def set_decode_scratch(self, partial_ptr, nbytes, counters_ptr):
        self.scratch = (partial_ptr, nbytes, counters_ptr)
        self.scratch_calls += 1

    def launch(self, x, code, rin, rout, s_in, s_out, a_q, a_scale, a_max, c, out, rows, n, k, kbits, ldo, col, stream):
        assert self.scratch is not None and self.scratch[1] >= ops.scratch_bytes(n), "split-K scratch not set or small"
        assert torch.all(view(a_max, (rows,), torch.float32) == 0), "a_max must be zeroed before each launch"
        xs = view(x, (rows, k), torch.bfloat16)
        words = view(code, (k // 16, n // 16, 8 * kbits), torch.int32)
        t = EschaTensors(
            words.view(torch.int16).clone(),
            view(rin, (k,), torch.float16).clone(),
            view(s_in, (k,), torch.float32).clone(),
            view(rout, (n,), torch.float16).clone(),
            view(s_out, (n,), torch.float32).clone(),
        )
        y = reference_linear(xs.double(), t, torch.float64)
        o = view(out, ((rows - 1) * ldo + col + n,), torch.bfloat16)
        o.as_strided((rows, n), (ldo, 1), col).copy_(y)
        view(a_max, (rows,), torch.float32).fill_(7.0)  # the real kernel leaves its maxima behind
        self.launches.append((rows, n, k, kbits, col))


@pytest.fixture
def stand_in(monkeypatch):
    ext = StandIn()
    monkeypatch.setitem(sys.modules, extension.MODULE, ext)
    extension.load_extension.cache_clear()
    monkeypatch.setattr(ops, "_workspaces", {})
    monkeypatch.setattr(ops, "MAX_ROWS", 4)  # small pieces, so that a 10-row call runs in three
    yield ext
    extension.load_extension.cache_clear()


def shard(in_f, out_f, k, seed):
    g = torch.Generator().manual_seed(seed)
    t = random_exl3_layer(in_f, out_f, k, "mcg", generator=g)
    rin, s_in = split_scale(t["suh"].float() / math.sqrt(128), g)
    rout, s_out = split_scale(t["svh"].float() / math.sqrt(128), g)
    return EschaTensors(t["trellis"], rin, s_in, rout, s_out)


def spec(t, dtype=torch.bfloat16, logical=None):
    k, n = t.stored_shape
    i, o = logical or (k, n)
    return LinearSpec(ROCM_GFX1201, "escha", float(t.k_bits), "mcg", k, n, i, o, dtype, TP_WHOLE)


def test_without_the_extension_the_kernel_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, extension.MODULE, None)
    extension.load_extension.cache_clear()
    ok, why = EschaHipLinearKernel.available(ROCM_GFX1201)
    assert not ok and "radiance_escha_kernel does not import" in why and "install it" in why
    extension.load_extension.cache_clear()
    assert EschaHipLinearKernel.available(Platform("cuda", capability=90))[1] == "needs ROCm (this platform is 'cuda')"


def test_choice_takes_bf16_shards_of_k_1_to_4_stored_at_their_size(stand_in):
    assert EschaHipLinearKernel.available(ROCM_GFX1201) == (True, None)
    t2 = shard(256, 384, 2, 1)
    assert choose_kernel([EschaHipLinearKernel], spec(t2), "test").kernel is EschaHipLinearKernel
    assert "bfloat16" in EschaHipLinearKernel.can_implement(spec(t2, torch.float16))[1]
    assert "K=5" in EschaHipLinearKernel.can_implement(spec(shard(256, 256, 5, 2)))[1]
    assert "stored 256x384 for 256x300" in EschaHipLinearKernel.can_implement(spec(t2, logical=(256, 300)))[1]


def test_two_shards_of_two_k_into_one_output_in_pieces(stand_in):
    """gate K=2 and up K=3 into columns 0 and 384 of one bf16 output, 10 rows in pieces of 4, from a non-contiguous
    float32 input: every launch reads contiguous bf16 and writes only its columns."""
    gate, up = shard(256, 384, 2, 3), shard(256, 384, 3, 4)
    cpu = torch.device("cpu")
    runs = [EschaHipLinearKernel.prepare(t, spec(t), cpu) for t in (gate, up)]
    assert stand_in.scratch_calls == 1  # reserved once at load for both shards (the same size)
    x = torch.randn(256, 10).t()  # non-contiguous float32
    out = torch.full((10, 800), float("nan"), dtype=torch.bfloat16)
    for p, col in zip(runs, (0, 384), strict=True):
        p.run(x, *p.tensors.values(), *p.static, out, col)
    assert [launch[0] for launch in stand_in.launches] == [4, 4, 2, 4, 4, 2]
    assert torch.isnan(out[:, 768:].float()).all(), "wrote outside its columns"
    ref = torch.cat([reference_linear(x.bfloat16().double(), t, torch.float64) for t in (gate, up)], 1)
    got = out[:, :768].double()
    assert float((got - ref).norm() / ref.norm()) < 1e-2
    assert stand_in.scratch_calls == 1, "the scratch must never be set during a launch"


def test_workspace_grows_at_load_for_a_wider_shard_only(stand_in):
    cpu = torch.device("cpu")
    EschaHipLinearKernel.prepare(shard(256, 256, 4, 5), spec(shard(256, 256, 4, 5)), cpu)
    EschaHipLinearKernel.prepare(shard(256, 128, 4, 6), spec(shard(256, 128, 4, 6)), cpu)
    assert stand_in.scratch_calls == 1
    wide = shard(512, 2048, 4, 7)
    EschaHipLinearKernel.prepare(wide, spec(wide), cpu)
    assert stand_in.scratch_calls == 2 and stand_in.scratch[1] >= ops.scratch_bytes(2048)
    ws = ops._workspaces[("cpu", None)]
    assert (ws.k, ws.n) == (512, 2048) and ws.x.shape == (ops.MAX_ROWS, 512)


def test_op_without_a_reserved_workspace_names_the_fix(stand_in):
    t = shard(256, 256, 4, 8)
    code = t.code.view(torch.uint8).view(torch.int32)
    with pytest.raises(RuntimeError, match="workspace reserved at load"):
        ops.escha_hip_(torch.randn(2, 256), code, t.rin, t.rout, t.s_in.float(), t.s_out.float(), 4,
                       torch.empty(2, 256, dtype=torch.bfloat16), 0)  # fmt: skip


def test_opcheck(stand_in):
    """``torch.library.opcheck`` of ``quantpack::escha_hip_`` (schema, fake implementation, tracing) over the
    stand-in (quantpack-exl3's tests list it among the project's ops)."""
    t = shard(256, 256, 3, 9)
    p = EschaHipLinearKernel.prepare(t, spec(t), torch.device("cpu"))
    x = torch.randn(3, 256)
    out = torch.zeros(3, 300, dtype=torch.bfloat16)
    torch.library.opcheck(
        torch.ops.quantpack.escha_hip_.default,
        (x, *p.tensors.values(), *p.static, out, 16),
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
    )
