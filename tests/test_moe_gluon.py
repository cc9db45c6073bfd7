"""The sm_90 Gluon warp-specialized grouped expert kernel (wsattn.kernels.moe_gluon).

CPU: compile for sm_90 with no GPU at the Qwen3-30B-A3B (H 2048, F 768, E 128, k 8) and
Mixtral-8x7B (H 4096, F 14336, E 8, k 2) shapes, gate/up and down, blocks 1 / 4 / 16 / 32
(MMA N 8 / 8 / 16 / 32), and check the structure it is built for (a 1-warp producer
partition with its setmaxnreg, swap-AB wgmma m64nN, TMA loads, inactive blocks leaving
before any barrier, no spills, shared memory within sm_90's); the refusal when
VERIFIED_ON_GPU is set False and off sm_90; argument checks; the launcher's grid, descriptor
and constants (the kernel replaced by a recorder).
sm90: numerics against a float64 reference (NaN-poisoned outputs, T 1 / 3 / 8 / 33 / 64,
Qwen3 and Mixtral-shaped configs, a ragged shape, empty experts, one expert taking every
token), bit-identical reruns, CUDA graph replay equal to eager. They set VERIFIED_ON_GPU
inside the test, so they can run while it is False.
"""

from __future__ import annotations

import functools
import re
from types import SimpleNamespace

import pytest
import torch

# Gluon ships with triton 3.6, which the project pins: this skips only on a triton without
# it (ImportError of triton's own module), never on an error in wsattn's code
pytest.importorskip("triton.experimental.gluon")

from wsattn.kernels import moe as M  # noqa: E402
from wsattn.kernels import moe_gluon as MG  # noqa: E402

QWEN3 = dict(H=2048, F=768, E=128, top_k=8)
MIXTRAL = dict(H=4096, F=14336, E=8, top_k=2)
SMEM_LIMIT = 232448


# --------------------------------------------------------------------------- compile-only

@functools.lru_cache(maxsize=None)
def _compile(kernel: str, block: int, model: str, norm: bool = True):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    shape = QWEN3 if model == "qwen3" else MIXTRAL
    s = MG.settings_for(8, shape["top_k"], shape["E"], kernel == "gate_up", block=block)
    spec = MG.compile_spec(90, kernel, **shape, norm=norm, settings=s)
    src = GluonASTSource(spec["fn"], spec["signature"], spec["constexprs"])
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=spec["options"]), s


BUILDS = [pytest.param(m, k, b, id=f"{m}-{k}-block{b}")
          for m, blocks in (("qwen3", (1, 4, 16, 64)), ("mixtral", (1, 16, 32)))
          for k in ("gate_up", "down") for b in blocks]


@pytest.mark.parametrize("model, kernel, block", BUILDS)
def test_sm90_build_is_warp_specialized_swap_ab_wgmma_over_tma(model, kernel, block,
                                                               record_property):
    from test_prefill_compile import _ptxas_usage
    k, s = _compile(kernel, block, model)
    ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]

    ws = re.findall(r"ttg\.warp_specialize\(.*requestedRegisters = array<i32: ([0-9, ]+)>", ttgir)
    assert ws == [str(s.PRODUCER_REGS)], ws  # one worker: the producer, registers handed back
    parts = re.findall(r"^\s*partition(\d+)\(.*num_warps\((\d+)\)", ttgir, re.M)
    assert parts == [("0", "1")], parts  # the 1-warp TMA producer
    assert k.metadata.num_warps == 8  # the consumer warpgroup + the producer padded to 4
    assert "ttng.async_tma_copy_global_to_local" in ttgir
    assert ttgir.count("ttng.warp_group_dot %") == (2 if kernel == "gate_up" else 1)
    # swap-AB: M = 64 weight rows, N = the block's rows padded to 8
    mma = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.bf16\.bf16", ptx))
    assert mma == {f"m64n{max(8, block)}k16"}, mma
    assert "cp.async.bulk.tensor" in ptx
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{s.PRODUCER_REGS}\b", ptx)
    regs, stores, loads = _ptxas_usage(k)
    what = f"{model}-{kernel}-block{block}"
    record_property(f"{what}.registers", regs)
    record_property(f"{what}.spill_bytes", stores + loads)
    record_property(f"{what}.shared_bytes", k.metadata.shared)
    print(f"{what}: {regs} registers, spills {stores}/{loads}, shared {k.metadata.shared}, "
          f"stages {s.STAGES}")
    assert stores + loads == 0, f"{what} spills {stores}/{loads} bytes"
    assert k.metadata.shared <= SMEM_LIMIT


def test_sm90_inactive_blocks_leave_before_any_barrier():
    """A program past num_active_blocks must return before barriers and partitions exist,
    or its producer and consumer could disagree about the work and hang."""
    k, _ = _compile("down", 16, "qwen3")
    ttgir = k.asm["ttgir"]
    nact = re.search(r"tt\.load %nact_ptr", ttgir)
    assert nact, "the active-block count is read in the kernel"
    for op in ("ttng.init_barrier", "ttg.warp_specialize", "ttg.local_alloc"):
        assert nact.start() < ttgir.index(op), op
    assert "gpu.barrier" not in ttgir[:ttgir.index("ttg.warp_specialize")]


def test_sm90_flashnorm_only_in_the_norm_build():
    with_norm = _compile("gate_up", 16, "qwen3", True)[0].asm["ttgir"]
    without = _compile("gate_up", 16, "qwen3", False)[0].asm["ttgir"]
    assert "math.rsqrt" in with_norm and "math.rsqrt" not in without


# --------------------------------------------------------------------------- refusal

def _inputs(T=4, H=64, F=32, E=4, k=2, dt=torch.bfloat16, device="cpu"):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).to(dt).to(device)
    rw = torch.randn(E, H, generator=g).to(dt).to(device)
    wgu = (torch.randn(E, 2 * F, H, generator=g) / H ** 0.5).to(dt).to(device)
    wd = (torch.randn(E, H, F, generator=g) / F ** 0.5).to(dt).to(device)
    return x, rw, wgu, wd


def _grouping(T=4, E=4, k=2, block=16, device="cpu"):
    """A Grouping built on the host (group() itself is a kernel): pairs sorted by expert,
    each expert padded to a multiple of block."""
    ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t))[:k]
                       for t in range(T)]).to(torch.int32)
    flat = ids.flatten().tolist()
    rows, offs, eob = [], [0], []
    for e in range(E):
        ps = [p for p, x in enumerate(flat) if x == e]
        pad = -(-len(ps) // block) * block
        rows += ps + [-1] * (pad - len(ps))
        offs.append(offs[-1] + pad)
        eob += [e] * (pad // block)
    nb = M.blocks_max(T, k, E, block)
    rows += [-1] * (nb * block - len(rows))
    eob += [-1] * (nb - len(eob))
    i32 = functools.partial(torch.tensor, dtype=torch.int32, device=device)
    counts = torch.bincount(ids.flatten().long(), minlength=E).to(torch.int32).to(device)
    return M.Grouping(i32(rows), i32(offs), i32(eob), i32([offs[-1] // block]), counts,
                      block, k, E, T), ids


def test_refused_while_not_verified_on_gpu(monkeypatch):
    monkeypatch.setattr(MG, "VERIFIED_ON_GPU", False)
    x, rw, wgu, wd = _inputs()
    g, _ = _grouping()
    match = r"not enabled: it has not passed its GPU numerics"
    with pytest.raises(ValueError, match=match):
        M.moe_gate_up(x, wgu, g, impl="gluon")
    act = torch.randn(g.sorted_pairs.shape[0], 32).to(x.dtype)
    with pytest.raises(ValueError, match=match):
        M.moe_down_combine(act, wd, g, torch.rand(4, 2), impl="gluon")
    with pytest.raises(ValueError, match=match):
        M.moe(x, rw, wgu, wd, top_k=2, renormalize=True, impl="gluon")


def test_moe_refuses_before_any_kernel_runs(monkeypatch):
    monkeypatch.setattr(MG, "VERIFIED_ON_GPU", False)

    def no_kernel(*a, **kw):
        raise AssertionError("a kernel ran before the refusal")
    monkeypatch.setattr(M, "route", no_kernel)
    monkeypatch.setattr(M, "group", no_kernel)
    x, rw, wgu, wd = _inputs()
    with pytest.raises(ValueError, match="not enabled"):
        M.moe(x, rw, wgu, wd, top_k=2, renormalize=True, impl="gluon")


@pytest.mark.parametrize("cc, where", [(None, "CPU tensors"), (80, "sm_80"), (100, "sm_100")])
def test_refused_off_sm90_once_verified(monkeypatch, cc, where):
    monkeypatch.setattr(MG, "VERIFIED_ON_GPU", True)
    monkeypatch.setattr(MG, "_cc", lambda device: cc)
    x, rw, wgu, wd = _inputs()
    g, _ = _grouping()
    with pytest.raises(ValueError, match=rf"runs on sm_90 \(Hopper\) only, not on {where}"):
        M.moe_gate_up(x, wgu, g, impl="gluon")
    with pytest.raises(ValueError, match=rf"not on {where}"):
        M.moe(x, rw, wgu, wd, top_k=2, renormalize=True, impl="gluon")


def test_bench_column_is_not_available_with_the_kernels_reason(monkeypatch):
    from wsattn.bench import moe as bench
    x = torch.randn(2, 64).to(torch.bfloat16)
    with pytest.raises(bench.NotAvailable, match="runs on sm_90 .* not on CPU tensors"):
        bench._calls(SimpleNamespace(cfg=None), "wsattn-gluon", x, [], {})
    monkeypatch.setattr(MG, "VERIFIED_ON_GPU", False)
    with pytest.raises(bench.NotAvailable, match="not enabled"):
        bench._calls(SimpleNamespace(cfg=None), "wsattn-gluon", x, [], {})


# --------------------------------------------------------------------------- arguments

@pytest.fixture
def as_sm90(monkeypatch):
    """Pretend the kernel is enabled on an sm_90 device (CPU tensors), and record launches
    instead of running them."""
    monkeypatch.setattr(MG, "VERIFIED_ON_GPU", True)
    monkeypatch.setattr(MG, "_cc", lambda device: 90)
    calls = []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                calls.append((grid, args, kw))
            return launch

    monkeypatch.setattr(MG, "grouped_kernel", Recorder())
    return calls


def test_impl_must_be_known():
    x, rw, wgu, wd = _inputs()
    g, _ = _grouping()
    with pytest.raises(ValueError, match=r"impl must be one of \('triton', 'gluon'\)"):
        M.moe_gate_up(x, wgu, g, impl="cuda")
    with pytest.raises(ValueError, match="impl must be one of"):
        M.moe(x, rw, wgu, wd, top_k=2, renormalize=True, impl="Gluon")


def test_fp32_refused_by_name(as_sm90):
    x, rw, wgu, wd = _inputs(dt=torch.float32)
    g, _ = _grouping()
    with pytest.raises(ValueError, match="impl='gluon' takes float16 or bfloat16"):
        M.moe_gate_up(x, wgu, g, impl="gluon")
    assert not as_sm90


@pytest.mark.parametrize("change, error, match", [
    (dict(settings=M.MoeSettings(block=16, BLOCK_N=64, BLOCK_K=128)), TypeError,
     "settings for impl='gluon' must be None or a GluonMoeSettings"),
    (dict(settings=MG.GluonMoeSettings(block=4)), ValueError,
     "settings.block=4 differs from the grouping's block=16"),
    (dict(settings=MG.GluonMoeSettings(block=16, STAGES=9)), ValueError, "STAGES must be in 2..8"),
    (dict(wgu="strided"), ValueError, "needs w_gate_up contiguous"),
    (dict(wgu="unaligned"), ValueError, "16-byte aligned for TMA"),
], ids=["triton-settings", "block", "stages", "strided", "unaligned"])
def test_gate_up_refuses_bad_input_by_name(as_sm90, change, error, match):
    x, rw, wgu, wd = _inputs()
    if change.get("wgu") == "strided":
        wgu = torch.randn(4, 64, 128).to(x.dtype)[:, :, :64]  # rows 128 apart, not 64
    elif change.get("wgu") == "unaligned":
        x, _, _, _ = _inputs(H=60)
        wgu = torch.randn(4, 64, 60).to(x.dtype)
    g, _ = _grouping()
    with pytest.raises(error, match=match):
        M.moe_gate_up(x, wgu, g, settings=change.get("settings"), impl="gluon")
    assert not as_sm90  # refused before the launch


@pytest.mark.parametrize("kw, match", [
    (dict(block=8), r"block must be one of \(1, 2, 4, 16, 32, 64\)"),
    (dict(block=16, BLOCK_N=128), "BLOCK_N must be 64"),
    (dict(block=16, BLOCK_K=96), "BLOCK_K must be 64, 128 or 256"),
    (dict(block=16, PRODUCER_REGS=20), "setmaxnreg takes a multiple of 8"),
    (dict(block=16, BLOCK_K=256, STAGES=4), "bytes of shared memory"),
])
def test_settings_refuse_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        MG.GluonMoeSettings(**kw).check(gate_up=True)


def test_compile_spec_refuses_other_targets_and_kernels():
    with pytest.raises(ValueError, match="cc=80: the Gluon grouped kernel builds for sm_90 only"):
        MG.compile_spec(80, "gate_up")
    with pytest.raises(ValueError, match="kernel must be 'gate_up' or 'down'"):
        MG.compile_spec(90, "combine")


def test_default_settings_fit_and_pick_blocks():
    assert MG.default_block(1, 8, 128) == 1
    assert MG.default_block(8, 8, 128) == 16
    assert MG.default_block(64, 2, 8) == 16 and MG.default_block(64, 8, 8) == 32
    for gate_up, stages in ((True, 5), (False, 6)):
        s = MG.settings_for(8, 8, 128, gate_up)
        assert s.STAGES == stages and s.smem_bytes(gate_up) <= SMEM_LIMIT


def test_launcher_grid_descriptor_and_constants(as_sm90):
    """What the GPU run depends on and the CPU can check: the static grid (blocks_max x
    N tiles), the [E*N, K] descriptor with [64, BLOCK_K] boxes, per-pair fp32 output rows."""
    T, H, F, E, k = 5, 64, 96, 4, 2
    x, rw, wgu, wd = _inputs(T=T, H=H, F=F, E=E, k=k)
    g, _ = _grouping(T=T, E=E, k=k, block=4)
    act = M.moe_gate_up(x, wgu, g, norm_eps=1e-6, impl="gluon")
    (grid, args, kw), = as_sm90
    nb = M.blocks_max(T, k, E, 4)
    assert grid == (nb, 2)  # cdiv(F=96, 64)
    desc = args[0]
    assert desc.shape == [E * 2 * F, H] and desc.block_shape == [64, 128]
    assert desc.base.data_ptr() == wgu.data_ptr()
    assert act.shape == (nb * 4, F) and act.dtype == x.dtype
    assert args[6] is act and args[7:10] == (F, H, 1e-6)
    assert kw["GATE_UP"] and kw["NORM"] and kw["BLOCK"] == 4 and kw["MMA_N"] == 8
    assert kw["TOP_K"] == k and kw["num_warps"] == 4

    as_sm90.clear()
    wts = torch.rand(T, k)
    y = MG.down(act, wd, g, wts)
    (grid, args, kw), = as_sm90
    assert grid == (nb, 1) and args[0].shape == [E * H, F] and args[0].block_shape == [64, 128]
    assert y.shape == (T * k, H) and y.dtype == torch.float32 and args[6] is y
    assert args[5] is wts and args[7:9] == (H, F) and not kw["GATE_UP"] and not kw["NORM"]


# --------------------------------------------------------------------------- GPU (sm_90)

@pytest.fixture
def verified(monkeypatch):
    """The kernel itself under test: enabled for this test only."""
    monkeypatch.setattr(MG, "VERIFIED_ON_GPU", True)


def _reference(x, wgu, wd, ids, wts, eps=None, residual=None):
    """float64 on x's device: out[t] = residual[t] + sum_j wts[t, j] * down_e(silu(gate_e)
    * up_e) of token t's expert e = ids[t, j]."""
    x64 = x.double()
    if eps is not None:
        x64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    out = torch.zeros_like(x64) if residual is None else residual.double().clone()
    F = wd.shape[2]
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        h = x64[tok] @ wgu[e].double().T
        act = torch.nn.functional.silu(h[:, :F]) * h[:, F:]
        out.index_add_(0, tok, wts[tok, slot].double()[:, None] * (act @ wd[e].double().T))
    return out


def _ids(T, E, k, gen, hot=None, experts=None):
    """Distinct experts per token; hot: every token's slot 0 is that expert; experts: draw
    from only the first `experts` ids (the others stay empty)."""
    pool = E if experts is None else experts
    ids = torch.stack([torch.randperm(pool, generator=gen)[:k] for _ in range(T)])
    if hot is not None:
        ids = torch.stack([torch.cat([torch.tensor([hot]),
                                      torch.tensor([e for e in r.tolist() if e != hot][:k - 1])])
                           for r in ids])
    return ids.to(torch.int32)


CASES = {
    "qwen3": dict(H=2048, F=768, E=128, k=8),
    "mixtral-small": dict(H=4096, F=1792, E=8, k=2),
    "ragged": dict(H=320, F=200, E=6, k=3),  # F, H not multiples of 64 / 128: every tail
}


def _run_case(case, T, dt=torch.bfloat16, block=None, hot=None, experts=None, eps=1e-6):
    c = CASES[case]
    H, F, E, k = c["H"], c["F"], c["E"], c["k"]
    gen = torch.Generator().manual_seed(T * 1000 + E)
    dev = "cuda"
    x = torch.randn(T, H, generator=gen).to(dt).to(dev)
    wgu = (torch.randn(E, 2 * F, H, generator=gen) / H ** 0.5).to(dt).to(dev)
    wd = (torch.randn(E, H, F, generator=gen) / F ** 0.5).to(dt).to(dev)
    res = torch.randn(T, H, generator=gen).to(dt).to(dev)
    ids = _ids(T, E, k, gen, hot, experts).to(dev)
    wts = torch.rand(T, k, generator=gen).to(dev)
    block = block or MG.default_block(T, k, E)
    g = M.group(ids, E, block)
    act = M.moe_gate_up(x, wgu, g, norm_eps=eps, impl="gluon")
    out = M.moe_down_combine(act, wd, g, wts, residual=res, impl="gluon")
    ref = _reference(x, wgu, wd, ids.long(), wts, eps, res)
    return out, ref, (x, wgu, wd, g, wts, res, eps)


@pytest.mark.sm90
@pytest.mark.parametrize("T", [1, 3, 8, 33, 64], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("case", list(CASES))
def test_sm90_against_float64_reference(verified, case, T):
    from wsattn.testing import assert_close
    out, ref, _ = _run_case(case, T)
    assert not torch.isnan(out).any()
    assert_close(out, ref, torch.bfloat16)


@pytest.mark.sm90
@pytest.mark.parametrize("block", [1, 4, 16, 32, 64], ids=lambda b: f"block{b}")
def test_sm90_every_grouping_block(verified, block):
    from wsattn.testing import assert_close
    out, ref, _ = _run_case("ragged", 33, block=block)
    assert_close(out, ref, torch.bfloat16)


@pytest.mark.sm90
@pytest.mark.parametrize("T", [8, 64], ids=lambda t: f"T{t}")
def test_sm90_empty_experts_and_one_expert_taking_every_token(verified, T):
    from wsattn.testing import assert_close
    out, ref, _ = _run_case("qwen3", T, experts=12)  # 116 of 128 experts empty
    assert_close(out, ref, torch.bfloat16)
    out, ref, _ = _run_case("qwen3", T, hot=5)  # expert 5 in every token, several blocks
    assert_close(out, ref, torch.bfloat16)


@pytest.mark.sm90
def test_sm90_fp16(verified):
    from wsattn.testing import assert_close
    out, ref, _ = _run_case("mixtral-small", 8, dt=torch.float16)
    assert_close(out, ref, torch.float16)


@pytest.mark.sm90
@pytest.mark.parametrize("T", [1, 8, 64], ids=lambda t: f"T{t}")
def test_sm90_moe_end_to_end_reruns_bit_identical_and_matches_triton(verified, T):
    """moe(impl='gluon') with route's own ids: the float64 reference of those ids and
    weights, bit-identical reruns, close to the Triton path."""
    from wsattn.testing import assert_close
    gen = torch.Generator().manual_seed(T)
    dt, dev, (H, F, E, k) = torch.bfloat16, "cuda", QWEN3.values()
    x = torch.randn(T, H, generator=gen).to(dt).to(dev)
    rw = torch.randn(E, H, generator=gen).to(dt).to(dev)
    wgu = (torch.randn(E, 2 * F, H, generator=gen) / H ** 0.5).to(dt).to(dev)
    wd = (torch.randn(E, H, F, generator=gen) / F ** 0.5).to(dt).to(dev)
    kw = dict(top_k=k, renormalize=True, norm_eps=1e-6)
    y1 = M.moe(x, rw, wgu, wd, impl="gluon", **kw)
    y2 = M.moe(x, rw, wgu, wd, impl="gluon", **kw)
    wts, ids = M.route(x, rw, top_k=k, renormalize=True, norm_eps=1e-6)
    ref = _reference(x, wgu, wd, ids.long(), wts, 1e-6)
    assert torch.equal(y1, y2)
    assert_close(y1, ref, dt)
    assert_close(M.moe(x, rw, wgu, wd, **kw), ref, dt)


@pytest.mark.sm90
def test_sm90_cuda_graph_replay_equals_eager(verified):
    dt, dev = torch.bfloat16, "cuda"
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 512, generator=gen).to(dt).to(dev)
    rw = torch.randn(16, 512, generator=gen).to(dt).to(dev)
    wgu = (torch.randn(16, 2 * 256, 512, generator=gen) / 23).to(dt).to(dev)
    wd = (torch.randn(16, 512, 256, generator=gen) / 16).to(dt).to(dev)
    out = torch.empty_like(x)
    kw = dict(top_k=4, renormalize=True, impl="gluon")
    eager = M.moe(x, rw, wgu, wd, out=out, **kw).clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        M.moe(x, rw, wgu, wd, out=out, **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    x.copy_(torch.randn(8, 512, generator=gen).to(dt).to(dev))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, M.moe(x, rw, wgu, wd, **kw))
    assert not torch.equal(out, eager)
