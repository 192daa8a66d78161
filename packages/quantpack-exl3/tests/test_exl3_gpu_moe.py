"""GPU tier: EXL3 expert banks through each CUDA expert kernel: ``quantpack::exl3_moe_`` (exllamav3's ``exl3_mgemm``
per K group) and ``quantpack::trellis_moe_`` (the trellis_mma grouped kernels).

Banks of the bundled Qwen3-MoE packs (uniform K and four K groups) and random banks (several K groups, half-integer
K, every codebook, a padded hidden size, 64 experts top-8) run over token counts that take every path of each op:
exllamav3's slot-batched launches, token chunks of filtered launches and per-expert path for large eager batches;
trellis_mma's one sort + gate/up + down per K group + reduce, and its chunks of 2048 picks, on each of its two paths:
the 16-row mma.sync kernel (``trellis_mma``, the tensor-core path off) and, on Hopper, the tensor-core path for every
call (``trellis_mma-tc``: 64-row work items, chunks of 16,384 picks). Each result is compared with the core's float64
per-expert loop over the same bank (``reference_moe_forward``), and trellis_mma's error with exllamav3's on the same
case (no worse than 1.1x). Plus opcheck, CUDA-graph capture and replay against eager, uneven picks per expert and the
choice between the two paths at its threshold."""

from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest
import torch
from ops_check import opcheck
from test_exl3_gpu_kernels import current_platform

from quantpack_core.moe import Exl3MoeBank, bank_from_tensors, plan_moe_layer, reference_moe_forward
from quantpack_core.synthetic import random_exl3_layer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU tier: nox -s gpu-tests)"),
]

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures"
PACKS = ["qwen3moe-tiny-exl3-4.0bpw-mul1", "qwen3moe-tiny-exl3-mixed-k"]
#: 1 and 3 tokens: one launch per projection; 64 / 100 tokens x top-2: 128 / 200 slots (token chunks when the
#: bank has several K groups); 600 x 2 = 1200 slots: exllamav3's per-expert path (eager only); 1100 x 2 (or x 3):
#: trellis_mma's calls in chunks of 2048 picks
TOKENS = [1, 3, 64, 100, 600, 1100]
#: fp16 activations and fp16 gate / up outputs against a float64 oracle
TOL = 3e-3


class GroupedBanks:
    """One CUDA expert kernel, preparing whole (unsharded) banks on this GPU.

    Attributes:
        name: the kernel's name (trellis_mma's tensor-core path: ``trellis_mma-tc``); op: its custom op's name
            (``quantpack::<op>``); settings: the trellis_mma settings its preparation and calls run under.
    """

    def __init__(self, kernel, op: str, name: str | None = None, settings: dict | None = None):
        self.kernel, self.name, self.op, self.settings = kernel, name or kernel.name, op, settings

    def pinned(self):
        """A context in which the op runs this backend's path (trellis_mma's settings)."""
        from quantpack_core.trellis_mma import settings

        return settings.using(**self.settings) if self.settings is not None else nullcontext()

    def prepare_moe(
        self, bank: Exl3MoeBank, hidden: int, inter: int, dtype: torch.dtype, device: torch.device, layer_experts=None
    ):
        """The bank prepared as a whole layer's, or with ``layer_experts`` as one rank's share of a layer of that many
        experts (the tensor-parallel expert split)."""
        from quantpack_core.kernels import TP_EXPERT_SPLIT, TP_WHOLE
        from quantpack_exl3.format import EXL3

        tp = TP_WHOLE if layer_experts is None else TP_EXPERT_SPLIT
        spec = EXL3.expert_spec(bank, current_platform(), dtype, tp, layer_experts or bank.num_experts)
        assert self.kernel.can_implement(spec) == (True, None)
        with self.pinned():
            return Pinned(self.kernel.prepare(bank, spec, hidden, inter, device), self)


class Pinned:
    """A prepared bank whose ``run`` calls run under its backend's settings (the path it names)."""

    def __init__(self, run, backend: GroupedBanks):
        self._run, self._backend = run, backend
        self.tensors, self.static = run.tensors, run.static

    def run(self, *args):
        with self._backend.pinned():
            return self._run.run(*args)


#: trellis_mma's paths: the 16-row kernel for every call, and the tensor-core path for every call (Hopper)
PATHS = {"trellis_mma": {"moe_tc_picks": 0}, "trellis_mma-tc": {"moe_tc_picks": 1}}


def _kernel(name: str) -> GroupedBanks:
    from quantpack_exl3.backends.exllamav3 import Exllamav3ExpertKernel
    from quantpack_exl3.backends.trellis_mma import TrellisMmaExpertKernel

    kinds = {"exllamav3": (Exllamav3ExpertKernel, "exl3_moe_"), "trellis_mma": (TrellisMmaExpertKernel, "trellis_moe_")}
    kernel, op = kinds[name.removesuffix("-tc")]
    assert kernel.available(current_platform()) == (True, None)
    return GroupedBanks(kernel, op, name, PATHS.get(name))


def on_hopper() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture(scope="module", params=["exllamav3", "trellis_mma", "trellis_mma-tc"])
def backend(request):
    """Each CUDA expert kernel (trellis_mma: each of its paths); on a GPU machine it must be available (a failure here
    fails the tier)."""
    if request.param == "trellis_mma-tc" and not on_hopper():
        pytest.skip("the tensor-core expert path runs on Hopper (compute capability 9.0)")
    return _kernel(request.param)


@pytest.fixture(scope="module")
def exllamav3_banks():
    """exllamav3's expert kernel: the error bound of the other kernels (no worse than 1.1x its error)."""
    return _kernel("exllamav3")


def pack_bank(pack: str, layer: str = "model.layers.0.mlp.experts") -> Exl3MoeBank:
    from test_exl3_moe import expert_tensors, grouped

    return bank_from_tensors(layer, grouped(expert_tensors(FIXTURES / pack, layer)), "cuda")


def random_bank(ks, hidden: int, inter: int, codebook: str, seed: int = 0, gated: bool = True) -> Exl3MoeBank:
    """Random experts of the given ``(K gate/up, K down)``; ``gated=False``: ungated relu2 experts (w1 and w2)."""
    g = torch.Generator().manual_seed(seed)
    k_bits = [(a, a, b) if gated else (a, b) for a, b in ks]
    bank = Exl3MoeBank(plan_moe_layer("random", k_bits, hidden, inter, codebook=codebook, gated=gated))
    bank.allocate("cuda")
    for e, (kgu, kd) in enumerate(ks):
        pieces = {
            "w1": random_exl3_layer(hidden, inter, kgu, codebook, generator=g, scale=0.05),
            "w3": random_exl3_layer(hidden, inter, kgu, codebook, generator=g, scale=0.05),
            "w2": random_exl3_layer(inter, hidden, kd, codebook, generator=g, scale=0.05),
        }
        if not gated:
            del pieces["w3"]
        bank.load_expert(e, pieces)
    return bank


def routing(tokens: int, experts: int, top_k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]).to(torch.int32)
    w = torch.rand(tokens, top_k, generator=g).softmax(-1)
    return ids.cuda(), w.cuda()


def skewed_routing(tokens: int, experts: int, top_k: int, seed: int):
    """Uneven picks per expert (top_k 3, at least 8 experts): choice 0 is expert 0 for every token (more picks than
    one 64-row work item), expert 1 has one pick (token 0's choice 1), expert 2 none, and experts 3 .. 7 share the
    rest."""
    assert top_k == 3 and experts >= 8
    t = torch.arange(tokens)
    c1 = torch.where(t == 0, 1, 3 + t % 5)
    ids = torch.stack([torch.zeros_like(t), c1, 3 + (t + 1) % 5], 1).to(torch.int32)
    w = torch.rand(tokens, top_k, generator=torch.Generator().manual_seed(seed)).softmax(-1)
    return ids.cuda(), w.cuda()


def check(
    backend, bank: Exl3MoeBank, hidden: int, tokens: int, top_k: int, seed: int = 1, absent: int = -1, route=routing,
    run=None,
) -> float:  # fmt: skip
    """Relative error of the op against the float64 oracle, the picks from ``route`` (:func:`routing` or
    :func:`skewed_routing`); with ``absent`` >= 0, every pick of experts ``e % 3 == absent`` is given as id -1 (an
    expert of another tensor-parallel rank), and the oracle gives those picks weight 0 instead. ``run``: the bank
    prepared already (its preparation's warm-up call launched outside the caller's block)."""
    run = run or backend.prepare_moe(bank, hidden, bank.plan.intermediate, torch.float16, torch.device("cuda"))
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed)).cuda().half()
    ids, w = route(tokens, bank.num_experts, top_k, seed)
    given, w_ref = ids, w
    if absent >= 0:
        gone = ids % 3 == absent
        given, w_ref = torch.where(gone, -1, ids), torch.where(gone, 0.0, w)
    out = torch.full_like(x, float("nan"))
    run.run(x, given, w, *run.tensors.values(), *run.static, out)
    xp = torch.nn.functional.pad(x.double(), (0, bank.plan.hidden - hidden))
    ref = reference_moe_forward(bank, xp, ids, w_ref)[:, :hidden]
    assert not out.isnan().any()
    return ((out.double() - ref).norm() / ref.norm()).item()


def within_bound(err: float, backend, exllamav3_banks, *case) -> str:
    """For a kernel other than exllamav3's: its error on the same case must be no worse than 1.1x exllamav3's (plus
    1e-6 for cases both compute near-exactly). Returns a note of both errors for the figures."""
    if backend.name == "exllamav3":
        return ""
    base = check(exllamav3_banks, *case)
    assert err <= 1.1 * base + 1e-6, (err, base)
    return f" (exllamav3 {base:.2e})"


@pytest.mark.parametrize("pack", PACKS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_pack_banks(backend, exllamav3_banks, figures, pack, tokens):
    bank = pack_bank(pack)
    case = (bank, bank.plan.hidden, tokens, 2)
    err = check(backend, *case)
    note = within_bound(err, backend, exllamav3_banks, *case)
    figures.append(
        f"GPU MoE {backend.name} {pack} layer 0, {tokens} tokens: rel err {err:.2e}{note} "
        f"({len(bank.plan.groups)} K groups)"
    )
    assert err < TOL


RANDOM = {
    # (K gate/up, K down) per expert: unsorted, repeated pairs, a half-integer K (mul1 only)
    "mul1-mixed": ([(4, 2), (2, 5), (3, 3), (5, 4), (2, 5), (2.5, 3), (4, 2), (3, 3)], "mul1"),
    "mcg-mixed": ([(4, 3), (2, 2), (4, 3), (3, 4), (2, 2), (6, 4)], "mcg"),
    "3inst-uniform": ([(3, 3)] * 6, "3inst"),
}


@pytest.mark.parametrize("case", sorted(RANDOM))
@pytest.mark.parametrize("tokens", TOKENS)
def test_random_banks(backend, exllamav3_banks, figures, case, tokens):
    """Hidden 200 (stored 256: the op zero-pads the input and trims the output), intermediate 384, top-3."""
    ks, cb = RANDOM[case]
    bank = random_bank(ks, 256, 384, cb)
    err = check(backend, bank, 200, tokens, 3)
    note = within_bound(err, backend, exllamav3_banks, bank, 200, tokens, 3)
    figures.append(f"GPU MoE {backend.name} random {case}, {tokens} tokens: rel err {err:.2e}{note}")
    assert err < TOL


@pytest.mark.parametrize("case", ["mul1-mixed", "mcg-mixed"])
@pytest.mark.parametrize("tokens", TOKENS)
def test_ungated_relu2_banks(backend, exllamav3_banks, figures, case, tokens):
    """Ungated relu2 experts (Nemotron-H's: ``relu(x W1)^2 W2``, no w3), several K groups, a padded hidden size, a
    third of the picks another rank's: against the float64 oracle of the same bank (relu2, the ungated default)."""
    ks, cb = RANDOM[case]
    bank = random_bank(ks, 256, 384, cb, seed=3, gated=False)
    assert not bank.plan.gated
    err = check(backend, bank, 200, tokens, 3, absent=1)
    note = within_bound(err, backend, exllamav3_banks, bank, 200, tokens, 3, 1, 1)
    figures.append(f"GPU MoE {backend.name} ungated relu2 {case}, {tokens} tokens: rel err {err:.2e}{note}")
    assert err < TOL


@pytest.mark.parametrize("hidden", [1152, 2304])
@pytest.mark.parametrize("tokens", [1, 64])
def test_mixed_banks_over_several_panels(backend, exllamav3_banks, figures, monkeypatch, hidden, tokens):
    """A mixed-K bank whose gate / up reduce over 72 or 144 tiles, run by trellis_mma as one split (a low CTA target):
    each CTA takes several 64-tile panels, the last ending in a partial round of its cp.async ring, at each work
    item's own K in one launch per projection."""
    from quantpack_core.trellis_mma import ops

    ks, cb = RANDOM["mul1-mixed"]
    bank = random_bank(ks, hidden, 384, cb, seed=3)
    if backend.name.startswith("trellis_mma"):
        backend.prepare_moe(bank, hidden, 384, torch.float16, torch.device("cuda"))  # reserves the workspace
        ws = ops.workspace(torch.device("cuda"))
        monkeypatch.setattr(ws, "target_ctas", 1)
        monkeypatch.setattr(ws, "target_ctas_wide", 1)
    err = check(backend, bank, hidden, tokens, 3)
    monkeypatch.undo()
    note = within_bound(err, backend, exllamav3_banks, bank, hidden, tokens, 3)
    figures.append(f"GPU MoE {backend.name} mixed K over several panels, hidden {hidden}, {tokens} tokens: "
                   f"rel err {err:.2e}{note}")  # fmt: skip
    assert err < TOL


@pytest.mark.parametrize("pack", PACKS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_picks_of_other_ranks_are_skipped(backend, exllamav3_banks, figures, pack, tokens):
    """The expert-split TP fallback hands the op id -1 for experts another rank holds: on every path (one launch,
    token chunks of several K groups, per expert) those picks add nothing and the others are unchanged."""
    bank = pack_bank(pack)
    err = check(backend, bank, bank.plan.hidden, tokens, 2, absent=1)
    note = within_bound(err, backend, exllamav3_banks, bank, bank.plan.hidden, tokens, 2, 1, 1)
    figures.append(
        f"GPU MoE {backend.name} {pack} layer 0, {tokens} tokens, a third of the experts absent: rel err {err:.2e}"
        f"{note}"
    )
    assert err < TOL


def test_many_experts_top8(backend, exllamav3_banks, figures):
    """64 experts in three K groups, top-8: 16 tokens = 128 slots (exllamav3: one filtered launch per group and
    projection; trellis_mma: one launch per projection for every group)."""
    ks = [(4, 4)] * 30 + [(3, 4)] * 20 + [(2, 3)] * 14
    bank = random_bank(ks, 256, 256, "mul1", seed=3)
    for tokens in (1, 16, 17, 70):
        err = check(backend, bank, 256, tokens, 8)
        note = within_bound(err, backend, exllamav3_banks, bank, 256, tokens, 8)
        figures.append(f"GPU MoE {backend.name} 64 experts top-8, {tokens} tokens: rel err {err:.2e}{note}")
        assert err < TOL


def test_opcheck(backend):
    bank = pack_bank(PACKS[1])
    run = backend.prepare_moe(bank, 256, 256, torch.float16, torch.device("cuda"))
    x = torch.randn(5, 256, device="cuda", dtype=torch.float16)
    ids, w = routing(5, 8, 2, 0)
    out = torch.empty_like(x)
    with backend.pinned():
        opcheck(backend.op, (x, ids, w, *run.tensors.values(), *run.static, out), ("test_schema", "test_faketensor"))


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("tokens", [4, 100])
def test_cuda_graph_capture_and_replay(backend, tokens, gated):
    """The op captures into a CUDA graph (no host sync, no allocation outside the graph pool) and replays with new
    routing and activations exactly as an eager call computes them; 100 tokens of the mixed-K bank take the
    chunked path (ungated: a random mixed-K relu2 bank of 8 experts)."""
    bank = pack_bank(PACKS[1]) if gated else random_bank(RANDOM["mul1-mixed"][0], 256, 256, "mul1", 4, gated=False)
    run = backend.prepare_moe(bank, 256, 256, torch.float16, torch.device("cuda"))
    x = torch.randn(tokens, 256, device="cuda", dtype=torch.float16)
    ids, w = routing(tokens, 8, 2, 0)
    out = torch.empty_like(x)

    def step():
        run.run(x, ids, w, *run.tensors.values(), *run.static, out)

    step()  # warm: kernel selection happens eagerly
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in (5, 6):
        x.copy_(torch.randn(tokens, 256, generator=torch.Generator().manual_seed(seed)).cuda().half())
        new_ids, new_w = routing(tokens, 8, 2, seed)
        ids.copy_(new_ids)
        w.copy_(new_w)
        graph.replay()
        replayed = out.clone()
        step()
        torch.testing.assert_close(replayed, out, rtol=0, atol=0)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("absent", [-1, 1], ids=["all-here", "tp-slots"])
@pytest.mark.parametrize("tokens", [1, 40, 150])
def test_uneven_picks_per_expert(backend, exllamav3_banks, figures, gated, absent, tokens):
    """Mixed K (a half-integer K among four K groups), picks spread unevenly over the experts: one expert with every
    token's first choice (150 tokens: three 64-row items, the last partial), one with a single pick, one with none;
    with ``tp-slots`` a third of the experts another rank's (id -1), so whole slots and parts of items go empty."""
    ks, cb = RANDOM["mul1-mixed"]
    bank = random_bank(ks, 256, 384, cb, seed=5, gated=gated)
    case = (bank, 200, tokens, 3, 2, absent, skewed_routing)
    err = check(backend, *case)
    note = within_bound(err, backend, exllamav3_banks, *case)
    kind = "gated" if gated else "ungated relu2"
    figures.append(
        f"GPU MoE {backend.name} {kind} mixed K, uneven picks{', tp slots' if absent >= 0 else ''}, {tokens} tokens: "
        f"rel err {err:.2e}{note}"
    )
    assert err < TOL


def test_prefill_chunks(backend, exllamav3_banks, figures):
    """A prefill's worth of picks: 32 experts in three K groups (hidden 1024, intermediate 768), top-8 over 2,100
    tokens = 16,800 picks: the 16-row path in 9 chunks of 2,048 picks, the tensor-core path in two chunks (16,384 and
    416 picks), about 525 picks per expert in the first (several full 64-row items each)."""
    ks = [(4, 4)] * 14 + [(3, 4)] * 10 + [(2, 3)] * 8
    bank = random_bank(ks, 1024, 768, "mul1", seed=7)
    case = (bank, 1024, 2100, 8)
    err = check(backend, *case)
    note = within_bound(err, backend, exllamav3_banks, *case)
    figures.append(f"GPU MoE {backend.name} 32 experts top-8, 2100 tokens: rel err {err:.2e}{note}")
    assert err < TOL


@contextmanager
def kernel_names():
    """The names of the CUDA kernels the block launches (a list filled on exit)."""
    names: list[str] = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        yield names
        torch.cuda.synchronize()
    names.extend(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


@pytest.mark.skipif(not torch.cuda.is_available() or not on_hopper(), reason="the tensor-core path runs on Hopper")
def test_an_expert_split_rank_chooses_by_the_layers_experts(exllamav3_banks, figures):
    """A rank of the expert split holding 8 of a layer's 32 experts (a third of the picks another rank's, id -1), with
    the tensor-core path from 4 picks per expert on: the op counts the call's picks over the layer's 32 experts, so 16
    and 63 tokens (top-2: 32 and 126 picks, under 4 x 32) run the 16-row kernel and 64 tokens the tensor-core launches
    (counted over the bank's 8 slots, 16 tokens would already take them); within the bound on both paths."""
    backend = GroupedBanks(_kernel("trellis_mma").kernel, "trellis_moe_", "trellis_mma", {"moe_tc_picks": 4})
    bank = random_bank(RANDOM["mul1-mixed"][0], 256, 384, "mul1", seed=6)
    run = backend.prepare_moe(bank, 256, 384, torch.float16, torch.device("cuda"), layer_experts=32)
    assert run.static[1] == 32
    for tokens, tc in ((16, False), (63, False), (64, True)):
        with kernel_names() as names:
            err = check(backend, bank, 256, tokens, 2, absent=1, run=run)
        assert any("trellis_moe_tc_kernel" in n for n in names) == tc, (tokens, sorted(set(names)))
        assert any("trellis_moe_kernel" in n for n in names) == (not tc), tokens
        note = within_bound(err, backend, exllamav3_banks, bank, 256, tokens, 2, 1, 1)
        figures.append(f"GPU MoE trellis_mma, 8 of 32 experts, {tokens} tokens (tc {tc}): rel err {err:.2e}{note}")
        assert err < TOL


@pytest.mark.skipif(not torch.cuda.is_available() or not on_hopper(), reason="the tensor-core path runs on Hopper")
def test_path_choice_at_the_threshold(exllamav3_banks, figures):
    """With the tensor-core path from 4 picks per expert on (8 experts, top-2: 32 picks), 15 tokens (30 picks) run the
    16-row kernel and 16 tokens (32 picks) the transform and tensor-core launches; both sides within the bound, and
    the choice is the one ``uses_tensor_cores`` gives for the token count."""
    from quantpack_core.trellis_mma import moe, settings

    backend = GroupedBanks(_kernel("trellis_mma").kernel, "trellis_moe_", "trellis_mma", {"moe_tc_picks": 4})
    bank = random_bank(RANDOM["mul1-mixed"][0], 256, 384, "mul1", seed=6)
    for tokens, tc in ((15, False), (16, True)):
        run = backend.prepare_moe(bank, 256, 384, torch.float16, torch.device("cuda"))  # its warm-up: 1 token
        with kernel_names() as names:
            err = check(backend, bank, 256, tokens, 2, run=run)
        with settings.using(moe_tc_picks=4):
            buffers = moe.reserve_moe(torch.device("cuda"), 8, 256, 384)
            assert moe.uses_tensor_cores(buffers, tokens, 2, 8) == tc
        assert any("trellis_moe_tc_kernel" in n for n in names) == tc, sorted(set(names))
        assert any("moe_transform_kernel" in n for n in names) == tc
        assert any("trellis_moe_kernel" in n for n in names) == (not tc)
        note = within_bound(err, backend, exllamav3_banks, bank, 256, tokens, 2)
        figures.append(f"GPU MoE trellis_mma at 4 picks per expert, {tokens} tokens (tc {tc}): rel err {err:.2e}{note}")
        assert err < TOL
