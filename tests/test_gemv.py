"""The decode step's skinny-GEMM kernel (wsattn.kernels.gemv).

Numerics run through the Triton interpreter in a fresh child process (TRITON_INTERPRET=1
set before Triton is imported, outputs NaN-poisoned) against a float64 torch reference,
in fp32 and fp16, M in {1, 3, 8, 64} (FMA and tl.dot paths), shapes that are not
multiples of the tiles, every switch and the combinations a layer uses. Split-K is
checked against the reference and for bit-identical reruns. sm_90 builds are compiled
on the CPU: PDL puts griddepcontrol.wait / launch_dependents in the PTX with the first
W tile's loads issued before the wait, and no default build at the Llama shapes spills.
"""

from __future__ import annotations

import json
import re
import textwrap

import pytest
import torch

from conftest import assert_close, interpreter_child

REFERENCE = r'''
def reference(x, w, eps=None, res=None, silu=False):
    """float64: RMSNorm folded into w (FlashNorm), then silu(gate) * up, then + res."""
    x64, w64 = x.double(), w.double()
    y = x64 @ w64.T
    if eps is not None:
        y = y * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    if silu:
        F = w.shape[0] // 2
        y = torch.nn.functional.silu(y[:, :F]) * y[:, F:]
    if res is not None:
        y = y + res.double()
    return y
'''
exec(REFERENCE)  # the same reference in this process (GPU tests) and in the child

CHILD = REFERENCE + textwrap.dedent(r'''
    import json, sys
    import torch
    from wsattn.kernels import gemv as G
    from wsattn.testing import rel_err

    torch.manual_seed(0)
    case, arg = sys.argv[1], json.loads(sys.argv[2])
    res = {}
    SWITCHES = {"plain": (None, False, False), "norm": (1e-5, False, False),
                "residual": (None, True, False), "silu": (None, False, True),
                "norm_silu": (1e-5, False, True)}

    def inputs(M, N, K, dt, silu, resid):
        x = torch.randn(M, K, dtype=dt)
        w = (torch.randn(2 * N if silu else N, K) / K ** 0.5).to(dt)
        r = torch.randn(M, N, dtype=dt) if resid else None
        return x, w, r

    if case == "sweep":
        dt = getattr(torch, arg["dtype"])
        M = arg["M"]
        for N, K in ((80, 96), (513, 200)):
            for name, (eps, resid, silu) in SWITCHES.items():
                x, w, r = inputs(M, N, K, dt, silu, resid)
                y = G.gemv(x, w, norm_eps=eps, residual=r, silu_mul=silu)
                assert y.shape == (M, N) and y.dtype == dt
                res[f"N{N}-K{K}-{name}"] = rel_err(y, reference(x, w, eps, r, silu))

    elif case == "split_k":
        dt = torch.float16
        # 37 rows: three row blocks of the finish, the last one partial
        for M in (1, 8, 37):
            for name in ("plain", "residual", "norm_silu"):
                eps, resid, silu = SWITCHES[name]
                x, w, r = inputs(M, 80, 200, dt, silu, resid)
                # 200 / 32 = 7 K tiles in 3 splits of 3, 3, 1; FMA path for M <= 4
                s = G.GemvSettings(BLOCK_N=64, BLOCK_K=32, split_k=3, use_dot=M > 4,
                                   num_warps=4, num_stages=1)
                y1 = G.gemv(x, w, norm_eps=eps, residual=r, silu_mul=silu, settings=s)
                y2 = G.gemv(x, w, norm_eps=eps, residual=r, silu_mul=silu, settings=s)
                key = f"M{M}-{name}"
                res[key] = rel_err(y1, reference(x, w, eps, r, silu))
                res[key + "-rerun_identical"] = bool(torch.equal(y1, y2))

    elif case == "in_place":
        # the residual stream updated in place, one pass and split-K; strided x rows
        dt = torch.float16
        for split in (1, 2):
            for M in (3, 8):
                xs = torch.randn(M, 2 * 200, dtype=dt)
                x = xs[:, :200]  # rows 400 elements apart
                w = (torch.randn(96, 200) / 15).to(dt)
                r = torch.randn(M, 96, dtype=dt)
                ref = reference(x, w, 1e-6, r)
                s = G.GemvSettings(BLOCK_N=32, BLOCK_K=32, split_k=split, use_dot=M > 4,
                                   num_warps=4, num_stages=1)
                y = G.gemv(x, w, norm_eps=1e-6, residual=r, out=r, settings=s)
                res[f"split{split}-M{M}"] = rel_err(r, ref)
                res[f"split{split}-M{M}-same"] = y.data_ptr() == r.data_ptr()

    elif case == "bf16":
        dt = torch.bfloat16
        for M in (1, 8):
            x, w, r = inputs(M, 80, 96, dt, True, False)
            y = G.gemv(x, w, norm_eps=1e-5, silu_mul=True)
            res[f"M{M}"] = rel_err(y, reference(x, w, 1e-5, None, True))
            res[f"M{M}-dtype"] = str(y.dtype)

    elif case == "pdl":
        x = torch.randn(2, 64, dtype=torch.float16)
        w = torch.randn(32, 64, dtype=torch.float16)
        try:
            G.gemv(x, w, pdl=True)
            res["error"] = None
        except ValueError as e:
            res["error"] = str(e)
        res["off"] = rel_err(G.gemv(x, w, pdl=False), reference(x, w))
        res["auto"] = rel_err(G.gemv(x, w), reference(x, w))
    print("RESULT " + json.dumps(res))
''')


def _child(case: str, **arg) -> dict:
    return interpreter_child(CHILD, case, json.dumps(arg))


TOL = {"float32": 2e-5, "float16": 4e-3}  # fp32 accumulates exactly here: no tf32 on CPU


@pytest.mark.parametrize("M", [1, 3, 8, 64], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_interpreter_sweep(dtype, M):
    r = _child("sweep", dtype=dtype, M=M)
    assert len(r) == 10, r
    bad = {k: v for k, v in r.items() if not v <= TOL[dtype]}
    assert not bad, f"relative error above {TOL[dtype]}: {bad}"


def test_split_k_matches_reference_and_reruns_bit_identical():
    r = _child("split_k")
    assert len(r) == 18, r
    for key, value in r.items():
        if key.endswith("rerun_identical"):
            assert value is True, key
        else:
            assert value <= TOL["float16"], (key, value)


def test_residual_in_place():
    r = _child("in_place")
    for key, value in r.items():
        if key.endswith("same"):
            assert value is True, key
        else:
            assert value <= TOL["float16"], (key, value)


def test_bf16_runs_in_fp32_under_the_interpreter():
    """The interpreter's bf16 tl.dot multiplies raw bits: bf16 on the CPU runs in fp32."""
    r = _child("bf16")
    assert r["M1-dtype"] == r["M8-dtype"] == "torch.bfloat16", r
    assert r["M1"] <= 2e-2 and r["M8"] <= 2e-2, r


def test_pdl_refused_off_sm90_and_off_by_default_in_the_interpreter():
    r = _child("pdl")
    assert r["error"] and "pdl=True needs a CUDA GPU of sm_90" in r["error"], r
    assert r["off"] <= TOL["float16"] and r["auto"] <= TOL["float16"], r


# --------------------------------------------------------------------------- validation

def _g():
    from wsattn.kernels import gemv
    return gemv


@pytest.mark.parametrize("case, error, match", [
    (dict(x=torch.randn(3, 8, 4)), ValueError, r"x must be \[M, K\]"),
    (dict(w=torch.randn(16, 8, 1)), ValueError, r"w must be \[N, K\]"),
    (dict(x=torch.randn(65, 8)), ValueError, "M=65 rows"),
    (dict(w=torch.randn(16, 9)), ValueError, r"w must be \[N, K=8\]"),
    (dict(x=torch.randn(2, 8).double(), w=torch.randn(16, 8).double()), TypeError, "x dtype"),
    (dict(w=torch.randn(16, 8).half()), TypeError, "w dtype must match x"),
    (dict(x=torch.randn(8, 2).t()), ValueError, "contiguous last dimension"),
    (dict(w=torch.randn(15, 8), silu_mul=True), ValueError, "even row count"),
    (dict(silu_mul=1), TypeError, "silu_mul must be a bool"),
    (dict(norm_eps=True), TypeError, "norm_eps"),
    (dict(norm_eps=0.0), ValueError, "norm_eps must be > 0"),
    (dict(norm_eps=1e-50), ValueError, "norm_eps .*fp32's normal range"),
    (dict(norm_eps=1e39), ValueError, "norm_eps .*fp32's normal range"),
    (dict(out=torch.empty(1, 16).expand(2, 16)), ValueError, "out's elements overlap"),
    (dict(residual=torch.randn(1, 16).expand(2, 16), out="residual"), ValueError,
     "out's elements overlap"),
    (dict(residual=torch.randn(2, 15)), ValueError, r"residual must be \[M, N\] = \[2, 16\]"),
    (dict(residual=torch.randn(2, 16), silu_mul=True), ValueError, r"residual must be \[M, F\]"),
    (dict(out=torch.randn(2, 16).half()), TypeError, "out dtype"),
    (dict(out=torch.randn(16, 2).t()), ValueError, "out needs a contiguous last dimension"),
    (dict(pdl=1), TypeError, "pdl must be None or a bool"),
    (dict(pdl_late=1), TypeError, "pdl_late must be None or a bool"),
    (dict(settings={"BLOCK_N": 16}), TypeError, "settings must be None or a GemvSettings"),
    (dict(x=torch.randn(17, 8), settings="fma"), ValueError, "use_dot=False takes M <= 16"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_input_refused_by_name(case, error, match):
    g = _g()
    args = dict(x=torch.randn(2, 8), w=torch.randn(16, 8))
    args.update(case)
    if args.get("settings") == "fma":
        args["settings"] = g.GemvSettings(16, 32, 1, False, 4, 1)
    if args.get("out") == "residual":  # in place, over a residual whose rows overlap
        args["out"] = args["residual"]
    x, w = args.pop("x"), args.pop("w")
    with pytest.raises(error, match=match):
        g.gemv(x, w, **args)


def test_out_must_not_overlap_inputs():
    g = _g()
    buf = torch.randn(4, 16)
    x = buf[:2, :8]
    w = torch.randn(16, 8)
    with pytest.raises(ValueError, match="out must not overlap x"):
        g.gemv(x, w, out=buf[:2])
    r = torch.randn(3, 16)
    with pytest.raises(ValueError, match="partly overlap"):
        g.gemv(torch.randn(2, 8), w, residual=r[:2], out=r[1:3])


def test_settings_refuse_bad_values():
    g = _g()
    with pytest.raises(ValueError, match="power of two"):
        g.GemvSettings(24, 64, 1, True, 4, 2)
    with pytest.raises(ValueError, match="tl.dot's minimum"):
        g.GemvSettings(8, 64, 1, True, 4, 2)
    with pytest.raises(ValueError, match="split_k must be <= 16"):
        g.GemvSettings(16, 64, 32, True, 4, 2)


def test_default_settings_table():
    """Where the defaults split K and pick the FMA path (sm_90, 132 SMs, bf16)."""
    g = _g()
    from wsattn.target import Target
    t = Target("cuda", 90, 132)

    def s(M, N, K, silu=False):
        return g.default_settings(t, M=M, N=N, K=K, dtype=torch.bfloat16, silu_mul=silu)

    assert not s(1, 2048, 2048).use_dot and s(8, 2048, 2048).use_dot
    # sm_90: the dot path from two rows, with the wide-tile rule of M 2-32 (64 columns;
    # from three rows one wave with deep pipelines, below); other targets (and fp32) keep
    # the FMA reduction up to FMA_MAX_M
    for M in range(2, g.FMA_MAX_M + 1):
        st = s(M, 8192, 2048, True)
        assert st.use_dot and st.BLOCK_N == g.DOT_WIDE_BLOCK_N, (M, st)
        assert st.num_stages == (3 if M <= g.FMA_SPLIT_MAX_M_SM90 else 4), (M, st)
        for cc in (80, 120):
            other = g.default_settings(Target("cuda", cc, 108), M=M, N=8192, K=2048,
                                       dtype=torch.bfloat16)
            assert not other.use_dot, (cc, M, other)
        assert not g.default_settings(t, M=M, N=8192, K=2048, dtype=torch.float32,
                                      silu_mul=True).use_dot
    assert g.default_settings(Target("cuda", 100, 148), M=2, N=8192, K=2048,
                              dtype=torch.bfloat16).use_dot
    # ... but at two rows a shape the dot rule would split (o, down) keeps the FMA path
    assert s(3, 2048, 8192).use_dot and s(3, 2048, 8192).split_k > 1
    assert not s(2, 2048, 8192).use_dot and s(2, 2048, 8192).split_k == 1
    assert s(2, 128256, 2048).use_dot  # the LM head: unsplit on the dot path
    # one row: the FMA path's row fold at every shape, 16 rows of 512 bytes, six stages
    for N, K, silu in ((2048, 8192, False), (128256, 2048, False), (8192, 2048, True),
                       (14336, 4096, True), (512, 2048, False)):
        st = s(1, N, K, silu)
        assert not st.use_dot and (st.BLOCK_N, st.BLOCK_K, st.num_stages) == (
            g.ONE_ROW_BLOCK_N, 256, g.MAX_STAGES), (N, K, st)
    for cc in (80, 120):  # not on other targets: the rule above
        other = g.default_settings(Target("cuda", cc, 108), M=1, N=8192, K=2048,
                                   dtype=torch.bfloat16, silu_mul=True)
        assert other.num_stages < g.MAX_STAGES, (cc, other)  # their shared-memory budget
    assert s(1, 512, 2048).split_k > 1  # k/v projections: 32 column blocks only
    assert s(1, 3072, 2048).split_k == 1 and s(1, 128256, 2048).split_k == 1
    assert s(64, 2048, 2048).BLOCK_N >= 64  # BLOCK_N >= M: x re-reads <= W bytes
    # 33-64 rows unsplit: one program an SM, deeper pipelines (gate/up; the LM head's 128
    # columns with 8 warps); the split shapes keep the rule
    gu, lm = s(64, 8192, 2048, True), s(64, 128256, 2048)
    assert (gu.BLOCK_N, gu.split_k, gu.num_stages) == (64, 1, 3), gu
    assert (lm.BLOCK_N, lm.BLOCK_K, lm.num_warps, lm.num_stages) == (128, 64, 8, 4), lm
    assert s(64, 2048, 2048).split_k > 1 and s(64, 2048, 2048).num_warps == 4
    assert s(32, 128256, 2048).num_warps == 4  # up to 32 rows the wide-tile rule
    for M in (1, 4, 8, 64):
        st = s(M, 8192, 2048, True)
        assert 2 <= st.num_stages <= g.MAX_STAGES


def test_default_settings_one_wave_deep_pipelines():
    """3-32 rows on sm_90 (64-column dot tiles): the programs in one wave at one program an
    SM take as many stages as DEEP_STAGE_BUDGET holds; a split that would give more
    programs than SMs goes where the tiles alone fill half of them; deep=False (the
    GEMV-epilogue QKV path's projection) keeps the three-stage split rule."""
    g = _g()
    from wsattn.target import Target
    t = Target("cuda", 90, 132)

    def s(M, N, K, silu=False, deep=True):
        return g.default_settings(t, M=M, N=N, K=K, dtype=torch.bfloat16, silu_mul=silu,
                                  deep=deep)

    def cut(st):
        return st.split_k, st.num_stages

    assert cut(s(8, 4096, 14336)) == (2, 8)  # Llama-3.1-8B down: 64 tiles x 2
    assert cut(s(8, 4096, 4096)) == (2, 8)  # o
    assert cut(s(8, 6144, 4096)) == (1, 8)  # QKV: 96 tiles, x 2 would be 192 programs
    assert cut(s(8, 5120, 2048)) == (1, 8)  # Qwen3-30B-A3B QKV: 80 tiles
    assert cut(s(8, 2048, 4096)) == (4, 8)  # its o: 32 tiles x 4
    assert cut(s(8, 3072, 2048)) == (4, 3)  # Llama-3.2-1B QKV: 48 tiles x 4 = 192 stay
    assert cut(s(8, 8192, 2048, True)) == (1, 4)  # its gate/up: 36 KB stages
    assert cut(s(16, 4096, 14336)) == (2, 8)
    assert cut(s(32, 4096, 14336)) == (2, 6)  # 32 padded rows: 24 KB stages
    assert cut(s(8, 14336, 4096, True)) == (1, 3)  # 224 tiles: more than one wave
    assert cut(s(8, 6144, 4096, deep=False)) == (2, 3)
    assert cut(s(2, 4096, 4096, True)) == cut(s(2, 4096, 4096, True, deep=False))
    for M in range(3, g.DOT_WIDE_MAX_M + 1):
        for N, K, silu in ((4096, 14336, False), (2048, 2048, False), (8192, 2048, True),
                           (6144, 4096, False), (512, 4096, False)):
            st = s(M, N, K, silu)
            w_rows = st.BLOCK_N * (2 if silu else 1)
            stage = (w_rows + g.block_m(M, True)) * st.BLOCK_K * 2
            assert st.num_stages == 3 or st.num_stages * stage <= g.DEEP_STAGE_BUDGET, (M, N, st)
            assert st.num_stages <= g.DEEP_MAX_STAGES


# --------------------------------------------------------------------------- compile-only

LLAMA_SHAPES = {  # name: (N out, K, flags) per layer kind; silu counts F
    "1B": {"qkv": (3072, 2048, {}), "o": (2048, 2048, {"residual": True}),
           "gate_up": (8192, 2048, {"silu_mul": True, "norm": True}),
           "down": (2048, 8192, {"residual": True}), "lm_head": (128256, 2048, {"norm": True})},
    "8B": {"qkv": (6144, 4096, {}), "o": (4096, 4096, {"residual": True}),
           "gate_up": (14336, 4096, {"silu_mul": True, "norm": True}),
           "down": (4096, 14336, {"residual": True}), "lm_head": (128256, 4096, {"norm": True})},
}


def _compile(kernel="gemv", **kw):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    spec = _g().compile_spec(90, kernel=kernel, **kw)
    src = ASTSource(spec["fn"], spec["signature"], spec["constexprs"], spec["attrs"])
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=spec["options"])


def _ptxas_usage(kernel):
    from test_prefill_compile import _ptxas_usage as usage
    return usage(kernel)


@pytest.mark.parametrize("kw", [dict(M=1), dict(M=8), dict(M=1, silu_mul=True, norm=True),
                                dict(M=64, residual=True)],
                         ids=["M1-fma", "M8-dot", "M1-silu-norm", "M64-residual"])
def test_sm90_pdl_wait_after_the_first_weight_loads(kw):
    k = _compile(N=3072, K=2048, pdl=True, **kw)
    ptx, ttgir = k.asm["ptx"], k.asm["ttgir"]
    assert ptx.count("griddepcontrol.wait") == 1 and ptx.count("griddepcontrol.launch_dependents") == 1
    assert k.metadata.launch_pdl
    wait = ptx.index("griddepcontrol.wait")
    assert ptx.index("griddepcontrol.launch_dependents") > wait
    before = re.findall(r"\b(ld\.global\.v4|cp\.async)\S*", ptx[:wait])
    assert before and all(op == "ld.global.v4" for op in before), before  # 16-byte W loads
    # TTGIR: the loads before the wait are exactly the first W tile(s) (gate, and up)
    tw = ttgir.index("griddepcontrol.wait")
    names = re.findall(r"(%\w+) = tt\.load", ttgir[:tw])
    assert [n.split("_")[0] for n in names] == (["%wg", "%wu"] if kw.get("silu_mul") else ["%wg"])
    after = ttgir[tw:]
    assert re.search(r"%x\w* = tt\.load|async_copy_global_to_local", after)  # x only after


@pytest.mark.parametrize("kw", [dict(M=1), dict(M=8, norm=True)], ids=["M1-fma", "M8-dot"])
def test_sm90_pdl_late_releases_after_the_weight_stream(kw):
    """pdl_late (the default below PDL_LATE_BELOW_M rows): one wait, one release, the release after the last
    weight load of the K loop (so after every W load) and before the epilogue's stores;
    the default build releases right after the wait."""
    ptx = _compile(N=3072, K=2048, pdl=True, pdl_late=True, **kw).asm["ptx"]
    assert ptx.count("griddepcontrol.wait") == 1 and ptx.count("griddepcontrol.launch_dependents") == 1
    release = ptx.index("griddepcontrol.launch_dependents")
    loads = [m.start() for m in re.finditer(r"\b(ld\.global\.v4|cp\.async\.cg)", ptx)]
    assert loads and max(loads) < release, "a weight load after the release"
    assert ptx.index("st.global", release) > release
    early = _compile(N=3072, K=2048, pdl=True, **kw).asm["ptx"]
    wait = early.index("griddepcontrol.wait")
    between = early[wait:early.index("griddepcontrol.launch_dependents")]
    assert not re.search(r"\b(ld\.global|cp\.async)", between)


def test_sm90_pdl_off_has_no_griddepcontrol():
    for kw in (dict(M=1), dict(M=8, norm=True)):
        ptx = _compile(N=3072, K=2048, pdl=False, **kw).asm["ptx"]
        assert "griddepcontrol" not in ptx
    fin = _compile(kernel="finish", M=1, N=512, K=2048, pdl=True).asm["ptx"]
    assert "griddepcontrol.wait" in fin
    assert "griddepcontrol" not in _compile(kernel="finish", M=1, N=512, K=2048).asm["ptx"]


def _k_loop(ptx):
    """The PTX of the kernel's (one) K loop: from its header label to the branch back."""
    header = re.search(r"^(\$L__BB\d+_\d+):\s*// =>This Inner Loop Header", ptx, re.M)
    assert header, "no loop in the PTX"
    back = re.search(rf"bra(\.uni)?\s+{re.escape(header.group(1))};", ptx[header.end():])
    assert back, "no branch back to the loop header"
    return ptx[header.start():header.end() + back.end()]


@pytest.mark.parametrize("kw", [dict(N=2048, K=8192, residual=True),
                                dict(N=8192, K=2048, silu_mul=True, norm=True),
                                dict(N=128256, K=2048, norm=True), dict(N=512, K=2048)],
                         ids=["down", "gate_up", "lm_head", "split-k"])
def test_sm90_one_row_loop_has_no_cross_lane_reduction(kw):
    """One row on sm_90 (the FMA path's row fold): the K loop is loads, converts and FMAs;
    the reduction over K (warp shuffles) happens once, after it. Two rows keep the per-tile
    reduction (the contrast that shows the check finds one)."""
    spec = _g().compile_spec(90, M=1, pdl=True, **kw)
    assert not spec["constexprs"]["USE_DOT"] and spec["constexprs"]["BLOCK_M"] == 1
    ptx = _compile(M=1, pdl=True, **kw).asm["ptx"]
    loop = _k_loop(ptx)
    assert "fma.rn.f32" in loop and "shfl.sync" not in loop
    assert "shfl.sync" in ptx[ptx.index(loop) + len(loop):]  # the one reduction, after it
    two = _compile(M=2, N=2048, K=8192, residual=True).asm["ptx"]
    assert "shfl.sync" in _k_loop(two)


@pytest.mark.parametrize("M", [1, 8, 32, 64], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("model", ["1B", "8B"])
def test_sm90_default_builds_do_not_spill(model, M, record_property):
    rows = []
    for name, (N, K, flags) in LLAMA_SHAPES[model].items():
        spec = _g().compile_spec(90, M=M, N=N, K=K, pdl=True, **flags)
        k = _compile(M=M, N=N, K=K, pdl=True, **flags)
        regs, stores, loads = _ptxas_usage(k)
        c = spec["constexprs"]
        row = (f"{model} M{M} {name}: BLOCK_N {c['BLOCK_N']} BLOCK_K {c['BLOCK_K']} split "
               f"{c['SPLIT_K']} {'dot' if c['USE_DOT'] else 'fma'} stages {c['STAGES']}: "
               f"{regs} regs, spills {stores}/{loads}, shared {k.metadata.shared}")
        rows.append(row)
        record_property(f"{model}.M{M}.{name}.registers", regs)
        record_property(f"{model}.M{M}.{name}.spill_bytes", stores + loads)
        assert stores + loads == 0, row
        assert k.metadata.shared <= 232448, row
        if c["USE_DOT"] is False or c["BLOCK_N"] >= 16:
            assert "ld.global.v4" in k.asm["ptx"] or "cp.async.cg.shared.global" in k.asm["ptx"]
        if c["SPLIT_K"] > 1:
            fk = _compile(kernel="finish", M=M, N=N, K=K, pdl=True, **flags)
            assert sum(_ptxas_usage(fk)[1:]) == 0, f"{row}: the split-K finish spills"
    print("\n".join(rows))


# --------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 3, 8, 64], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("switch", ["plain", "norm", "residual", "silu", "norm_silu", "split"])
def test_gpu_bf16_against_reference_and_reruns(switch, M):
    g = _g()
    torch.manual_seed(0)
    dt, dev = torch.bfloat16, "cuda"
    N, K = 2048 + 80, 2048 + 64
    silu = "silu" in switch
    eps = 1e-5 if "norm" in switch else None
    x = torch.randn(M, K, dtype=dt, device=dev)
    w = (torch.randn(2 * N if silu else N, K, device=dev) / K ** 0.5).to(dt)
    r = torch.randn(M, N, dtype=dt, device=dev) if switch == "residual" else None
    settings = None
    if switch == "split":
        base = g.default_settings(g.target_of(x.device), M=M, N=N, K=K, dtype=dt)
        settings = g.GemvSettings(base.BLOCK_N, base.BLOCK_K, 4, base.use_dot,
                                  base.num_warps, base.num_stages)
    ref = reference(x, w, eps, r, silu)
    y1 = g.gemv(x, w, norm_eps=eps, residual=r, silu_mul=silu, settings=settings)
    y2 = g.gemv(x, w, norm_eps=eps, residual=r, silu_mul=silu, settings=settings)
    y3 = g.gemv(x, w, norm_eps=eps, residual=r, silu_mul=silu, settings=settings, pdl=False)
    torch.cuda.synchronize()
    assert_close(y1, ref, dt)
    assert torch.equal(y1, y2), "rerun differs"
    assert torch.equal(y1, y3), "PDL on and off differ"
    # the release the default did not pick (gemv.PDL_LATE_BELOW_M)
    other = not M < g.PDL_LATE_BELOW_M
    y4 = g.gemv(x, w, norm_eps=eps, residual=r, silu_mul=silu, settings=settings,
                pdl_late=other)
    torch.cuda.synchronize()
    assert torch.equal(y1, y4), f"the PDL release (pdl_late={other}) changed the result"


@pytest.mark.gpu
@pytest.mark.parametrize("M", [3, 8, 16, 17, 32], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("shape", ["split-deep", "one-pass-deep", "silu-deep"])
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_one_wave_deep_pipelines(shape, M, dt):
    """The 3-32-row defaults with deep pipelines (default_settings' one-wave rule): K split
    with 8 (6) stages, one pass after the split went, and gate/up's 36 KB stages, each
    against float64 from a NaN-poisoned output, rerun bit for bit, PDL on = off, and equal
    to the three-stage rule's result within rounding."""
    g = _g()
    torch.manual_seed(1)
    dev = "cuda"
    N, K, silu, res = {"split-deep": (4096, 14336, False, True),
                       "one-pass-deep": (6144, 4096, False, False),
                       "silu-deep": (8192, 2048, True, False)}[shape]
    target = g.target_of(torch.device(dev))
    st = g.default_settings(target, M=M, N=N, K=K, dtype=dt, silu_mul=silu)
    if target.cc != 90 or target.num_sms < 132 or st.num_stages == 3:
        # the shapes are chosen so that sm_90 with the H200's 132 SMs takes the deep builds
        # (every case ran there); elsewhere the defaults are the three-stage rule, which
        # test_gpu_bf16_against_reference_and_reruns covers, so nothing untested is skipped
        pytest.skip(f"this GPU's defaults take no deep pipeline here ({target.name}, "
                    f"{target.num_sms} SMs: {st})")
    x = torch.randn(M, K, dtype=dt, device=dev)
    w = (torch.randn(2 * N if silu else N, K, device=dev) / K ** 0.5).to(dt)
    r = torch.randn(M, N, dtype=dt, device=dev) if res else None
    ref = reference(x, w, None, r, silu)
    out = torch.full((M, N), float("nan"), dtype=dt, device=dev)
    y1 = g.gemv(x, w, residual=r, silu_mul=silu, out=out)
    y2 = g.gemv(x, w, residual=r, silu_mul=silu)
    y3 = g.gemv(x, w, residual=r, silu_mul=silu, pdl=False)
    old = g.default_settings(target, M=M, N=N, K=K, dtype=dt, silu_mul=silu, deep=False)
    y4 = g.gemv(x, w, residual=r, silu_mul=silu, settings=old)
    torch.cuda.synchronize()
    assert y1.data_ptr() == out.data_ptr() and not torch.isnan(y1).any()
    assert_close(y1, ref, dt)
    assert_close(y4, ref, dt)
    assert torch.equal(y1, y2), "rerun differs"
    assert torch.equal(y1, y3), "PDL on and off differ"
