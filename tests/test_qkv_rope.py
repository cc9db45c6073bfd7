"""The fused QKV projection + RoPE + KV-cache append kernel (wsattn.kernels.qkv_rope).

Kernel numerics run in a fresh child process with TRITON_INTERPRET=1 (fp32, fp16), one
child per (dtype, model family), against a float64 reference written here (projection,
FlashNorm scale, bias, QK-norm, RoPE through transformers' own apply_rotary_pos_emb,
append). rope_inv_freq is checked bit for bit against transformers' functions; sm_90
builds are compiled without a GPU; CUDA bf16 twins are marked gpu.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import textwrap

import pytest
import torch

from wsattn.kernels import qkv_rope
from wsattn.kernels.qkv_rope import QkvRopeSettings, qkv_rope_append, rope_inv_freq
from wsattn.testing import bits_report

from conftest import interpreter_child

FAMILIES = {  # what each supported family switches on
    "llama": dict(norm=True, bias=False, qk_norm=False),
    "qwen2": dict(norm=True, bias=True, qk_norm=False),
    "qwen3": dict(norm=True, bias=False, qk_norm=True),
    # OLMoE: one RMSNorm over the whole q and the whole k projection (two launches)
    "olmoe": dict(norm=True, bias=False, qk_norm=False, qk_norm_whole=True),
}
FUSED = [f for f in FAMILIES if not FAMILIES[f].get("qk_norm_whole")]  # one-launch families

# Shared by the interpreter child and the GPU tests: inputs, the float64 reference, and the
# checks (numerics, write-only cache, paged == contiguous bitwise).
HELPERS = r'''
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

PAGE = 16
POSITIONS = [15, 16, 37, 0, 47, 48, 20, 63]  # page ends, page starts, mid-page


def make_inputs(fam, M, K, Hq, Hkv, D, dt, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    N = (Hq + 2 * Hkv) * D
    inp = dict(x=rnd(M, K).to(dt), wqkv=(rnd(N, K) / K ** 0.5).to(dt),
               positions=torch.tensor((POSITIONS * (M // 8 + 1))[:M], dtype=torch.int32),
               inv_freq=rope_inv_freq(D, 10000.0 if D == 64 else 500000.0))
    if fam["norm"]:
        inp["norm_eps"] = 1e-5
    if fam["bias"]:
        inp["bqkv"] = (rnd(N) * 0.5).to(dt)
    if fam["qk_norm"]:
        inp["q_norm"] = (1 + 0.3 * rnd(D)).to(dt)
        inp["k_norm"] = (1 + 0.3 * rnd(D)).to(dt)
        inp["qk_eps"] = 1e-6
    if fam.get("qk_norm_whole"):
        inp["q_norm"] = (1 + 0.3 * rnd(Hq * D)).to(dt)
        inp["k_norm"] = (1 + 0.3 * rnd(Hkv * D)).to(dt)
        inp["qk_eps"] = 1e-6
        inp["qk_norm_whole"] = True
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}


def make_caches(M, Hkv, D, dt, device, seed=1):
    """A paged cache (random page order, spare pages, some pages all NaN) and a contiguous
    one of the same capacity, holding random 'earlier' contents."""
    g = torch.Generator().manual_seed(seed)
    maxp = 4
    pages = M * maxp + 3
    bt = torch.randperm(pages, generator=g)[:M * maxp].to(torch.int32).view(M, maxp)
    kc = torch.randn(pages, PAGE, Hkv, D, generator=g).to(dt)
    vc = torch.randn(pages, PAGE, Hkv, D, generator=g).to(dt)
    kc[::3] = float("nan")
    vc[1::3] = float("nan")
    kl = torch.randn(M, maxp * PAGE, Hkv, D, generator=g).to(dt)
    vl = torch.randn(M, maxp * PAGE, Hkv, D, generator=g).to(dt)
    return [t.to(device) for t in (kc, vc, bt, kl, vl)]


def reference(inp, Hq, Hkv, D):
    """float64: (q [M, Hq, D], k [M, Hkv, D], v [M, Hkv, D]) as transformers computes them."""
    x = inp["x"].double().cpu()
    qkv = x @ inp["wqkv"].double().cpu().T
    if "norm_eps" in inp:
        qkv = qkv * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + inp["norm_eps"])
    if "bqkv" in inp:
        qkv = qkv + inp["bqkv"].double().cpu()
    M = x.shape[0]
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    if inp.get("qk_norm_whole"):  # OLMoE: over the whole projection, before the heads
        eps = inp["qk_eps"]
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + eps) * inp["q_norm"].double().cpu()
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps) * inp["k_norm"].double().cpu()
    q, k, v = q.reshape(M, Hq, D), k.reshape(M, Hkv, D), v.reshape(M, Hkv, D)
    if "q_norm" in inp and not inp.get("qk_norm_whole"):
        eps = inp["qk_eps"]
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + eps) * inp["q_norm"].double().cpu()
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps) * inp["k_norm"].double().cpu()
    freqs = inp["positions"].double().cpu()[:, None] * inp["inv_freq"].double().cpu()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)  # [M, D]
    q, k = apply_rotary_pos_emb(q, k, emb.cos(), emb.sin(), unsqueeze_dim=1)
    return q, k, v


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def run_case(fam, M, K, Hq, Hkv, D, dt, device, settings=None, seq_index=False, seed=0):
    """Runs the kernel on the paged and on the contiguous cache; returns the checks."""
    inp = make_inputs(fam, M, K, Hq, Hkv, D, dt, device, seed)
    kc, vc, bt, kl, vl = make_caches(M, Hkv, D, dt, device, seed + 1)
    rows_b = torch.arange(M)
    kw = {}
    if seq_index:  # consecutive tokens of a few sequences: sequence m // 3, positions 14..
        rows_b = torch.arange(M) // 3
        inp["positions"] = (14 + torch.arange(M) % 3 + 17 * (torch.arange(M) // 3)).to(
            torch.int32).to(device)
        kw["seq_index"] = rows_b.to(torch.int32).to(device)
    before = [t.clone() for t in (kc, vc, kl, vl)]
    q_p = qkv_rope_append(**inp, k_cache=kc, v_cache=vc, block_table=bt, settings=settings, **kw)
    q_c = qkv_rope_append(**inp, k_cache=kl, v_cache=vl, settings=settings, **kw)
    q_ref, k_ref, v_ref = reference(inp, Hq, Hkv, D)
    pos = inp["positions"].long().cpu()
    kc, vc, kl, vl, bt = kc.cpu(), vc.cpu(), kl.cpu(), vl.cpu(), bt.cpu()
    before = [t.cpu() for t in before]
    page, off = bt[rows_b, pos // PAGE].long(), pos % PAGE
    res = {"q": rel_err(q_p, q_ref), "k": rel_err(kc[page, off], k_ref),
           "v": rel_err(vc[page, off], v_ref), "tol": tol(dt)}
    # everything but the written slots keeps its earlier bits (NaN pages included)
    keep_paged = torch.ones(kc.shape[:2], dtype=torch.bool)
    keep_paged[page, off] = False
    keep_contig = torch.ones(kl.shape[:2], dtype=torch.bool)
    keep_contig[rows_b, pos] = False
    res["untouched"] = all(torch.equal(bits(a)[keep], bits(b)[keep]) for a, b, keep in (
        (kc, before[0], keep_paged), (vc, before[1], keep_paged),
        (kl, before[2], keep_contig), (vl, before[3], keep_contig)))
    # the paged append equals a plain contiguous write, bit for bit: gather the pages back
    res["paged_eq_contig"] = (torch.equal(bits(kc[page, off]), bits(kl[rows_b, pos]))
                              and torch.equal(bits(vc[page, off]), bits(vl[rows_b, pos]))
                              and torch.equal(bits(q_p.cpu()), bits(q_c.cpu())))
    return res
'''

CHILD = textwrap.dedent(r'''
    import json, sys
    import torch
    from wsattn.kernels.gemv import GemvSettings
    from wsattn.kernels.qkv_rope import (qkv_rope_append, rope_inv_freq, QkvRopeSettings,
                                         TwoLaunchSettings, GemvRopeSettings)
    from wsattn.testing import rel_err, tol
''') + HELPERS + textwrap.dedent(r'''
    dtype_name, fam_name, fam = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    dt = {"fp32": torch.float32, "fp16": torch.float16}[dtype_name]
    out = {}
    i = 0
    for D in (64, 128):
        for Hq, Hkv in ((8, 2), (4, 2)):  # GQA 4:1 and 2:1
            for M in (1, 3, 8):
                K = 64 if D == 64 else 128
                # alternate one pass and split K (the last-arriving program reduces)
                split = 1 + (i % 3)
                i += 1
                s = QkvRopeSettings(BLOCK_K=16, split_k=split, num_warps=4, num_stages=1)
                out[f"D{D}-Hq{Hq}-Hkv{Hkv}-M{M}-split{split}"] = run_case(
                    fam, M, K, Hq, Hkv, D, dt, "cpu", settings=s)
    s = QkvRopeSettings(BLOCK_K=32, split_k=2, num_warps=4, num_stages=1)
    out["seq_index-T3-M6"] = run_case(fam, 6, 64, 8, 2, 64, dt, "cpu", settings=s,
                                      seq_index=True)
    out["default-settings-M5"] = run_case(fam, 5, 96, 4, 2, 64, dt, "cpu")
    # head counts whose Hq * D and Hkv * D are not powers of two (OLMoE's whole-row tiles
    # are masked there)
    out["Hq6-Hkv3-M3"] = run_case(fam, 3, 64, 6, 3, 64, dt, "cpu")
    # the two-launch path (gemv, then one program per row and head) for every family
    for D, M in ((64, 3), (128, 1)):
        out[f"two-launch-D{D}-M{M}"] = run_case(fam, M, 64 if D == 64 else 128, 4, 2, D, dt,
                                                "cpu", settings=TwoLaunchSettings())
    # the FMA path (use_dot=False): one row block of M <= 8 rows, one pass and split K
    for D, Hq, Hkv, M, split in ((64, 8, 2, 1, 1), (64, 4, 2, 3, 2), (128, 4, 2, 8, 3)):
        s = QkvRopeSettings(BLOCK_K=16, split_k=split, num_warps=4, num_stages=1,
                            use_dot=False)
        out[f"fma-D{D}-Hq{Hq}-Hkv{Hkv}-M{M}-split{split}"] = run_case(
            fam, M, 64 if D == 64 else 128, Hq, Hkv, D, dt, "cpu", settings=s)
    s = QkvRopeSettings(BLOCK_K=32, split_k=2, num_warps=4, num_stages=1, use_dot=False)
    out["fma-seq_index-T3-M6"] = run_case(fam, 6, 64, 8, 2, 64, dt, "cpu", settings=s,
                                          seq_index=True)
    if not fam["qk_norm"] and not fam.get("qk_norm_whole"):
        # the GEMV-epilogue path (no QK-norm): gemv's defaults (BLOCK_N capped at D), the FMA
        # rows split K, the dot rows split K (the finish kernel's epilogue), tokens of a few
        # sequences
        for D, M, gs in ((64, 1, None), (128, 3, None), (64, 8, None),
                         (64, 3, GemvSettings(16, 32, 2, False, 4, 1)),
                         (128, 8, GemvSettings(32, 32, 3, True, 4, 1)),
                         # the finish kernel's row blocks: three, the last one partial
                         (64, 37, GemvSettings(32, 32, 3, True, 4, 1))):
            out[f"gemv-rope-D{D}-M{M}-{'split' if gs else 'default'}"] = run_case(
                fam, M, 64 if D == 64 else 128, 4, 2, D, dt, "cpu",
                settings=GemvRopeSettings(gemv=gs))
        out["gemv-rope-seq_index-T3-M6"] = run_case(fam, 6, 64, 8, 2, 64, dt, "cpu",
                                                    settings=GemvRopeSettings(), seq_index=True)
    elif fam["qk_norm"]:
        # per-head QK-norm on the GEMV-epilogue path: where a program holds whole heads (K
        # split: the finish kernel's programs; or BLOCK_N = D unsplit)
        for D, M, gs in ((64, 3, GemvSettings(16, 32, 2, False, 4, 1)),
                         (128, 8, GemvSettings(32, 32, 3, True, 4, 1)),
                         (128, 37, GemvSettings(32, 32, 3, True, 4, 1)),
                         (64, 1, GemvSettings(64, 32, 1, False, 4, 1))):
            out[f"gemv-rope-D{D}-M{M}-split{gs.split_k}"] = run_case(
                fam, M, 64 if D == 64 else 128, 4, 2, D, dt, "cpu",
                settings=GemvRopeSettings(gemv=gs))
    print("RESULT " + json.dumps(out))
''')


def _child(*args) -> dict:
    return interpreter_child(CHILD, *args)  # q_out starts as NaN (WSATTN_POISON)


# fp16 for every family; fp32 (the same kernel code, exact products in the interpreter)
# for the plain and the per-head QK-norm family only, to keep the CPU suite's time
@pytest.mark.parametrize("dtype, family", [("fp16", f) for f in FAMILIES]
                         + [("fp32", "llama"), ("fp32", "qwen3")])
def test_interpreter_against_float64(dtype, family):
    """Every case: q, k, v within the dtype's tolerance of the float64 reference; cache
    slots other than the rows' own keep their bits (NaN pages too); q_out fully written
    (it starts as NaN); the paged append equals the contiguous one bit for bit."""
    res = _child(dtype, family, json.dumps(FAMILIES[family]))
    fam = FAMILIES[family]
    assert len(res) == 21 + (0 if fam.get("qk_norm_whole") else 4 if fam["qk_norm"] else 7)
    bad = {}
    for case, r in res.items():
        errs = {k: r[k] for k in ("q", "k", "v") if not r[k] <= r["tol"]}
        if errs or not r["untouched"] or not r["paged_eq_contig"]:
            bad[case] = r
    assert not bad, f"{dtype} {family}: {bad}"


EQUAL_CHILD = textwrap.dedent(r'''
    import json, sys
    import torch
    from wsattn.kernels.gemv import GemvSettings
    from wsattn.kernels.qkv_rope import (qkv_rope_append, rope_inv_freq, GemvRopeSettings,
                                         TwoLaunchSettings)
    dt = {"fp32": torch.float32, "fp16": torch.float16}[sys.argv[1]]
    g = torch.Generator().manual_seed(3)
    out = {}
    # FMA rows only (M <= 4 or use_dot=False), where the interpreter's products do not
    # depend on a column's place in the tile: its dot is a numpy matmul, whose summation
    # order may (the GPU test compares the dot rows bit for bit)
    # (M, K, Hq, Hkv, D, gemv settings, bias, per-head QK-norm)
    cases = [(1, 64, 4, 2, 64, None, False, False), (3, 128, 4, 2, 128, None, True, False),
             (3, 128, 4, 2, 64, GemvSettings(16, 32, 2, False, 4, 1), True, False),
             (8, 128, 4, 2, 128, GemvSettings(32, 32, 3, False, 4, 1), False, False),
             (3, 128, 4, 2, 64, GemvSettings(16, 32, 2, False, 4, 1), False, True),
             (8, 128, 4, 2, 128, GemvSettings(32, 32, 3, False, 4, 1), True, True),
             (1, 64, 4, 2, 64, GemvSettings(64, 32, 1, False, 4, 1), False, True)]
    for M, K, Hq, Hkv, D, gs, bias, qkn in cases:
        N = (Hq + 2 * Hkv) * D
        x = torch.randn(M, K, generator=g).to(dt)
        w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dt)
        b = (torch.randn(N, generator=g) * 0.5).to(dt) if bias else None
        norms = dict(q_norm=(1 + 0.3 * torch.randn(D, generator=g)).to(dt),
                     k_norm=(1 + 0.3 * torch.randn(D, generator=g)).to(dt),
                     qk_eps=1e-6) if qkn else {}
        pos = torch.tensor([15, 16, 37, 0, 47, 48, 20, 63][:M], dtype=torch.int32)
        bt = torch.randperm(M * 4 + 3, generator=g)[:M * 4].to(torch.int32).view(M, 4)
        got = []
        for st in (TwoLaunchSettings(gemv=gs), GemvRopeSettings(gemv=gs)):
            kc = torch.full((M * 4 + 3, 16, Hkv, D), float("nan"), dtype=dt)
            vc = kc.clone()
            q = qkv_rope_append(x, w, bqkv=b, norm_eps=1e-5, inv_freq=rope_inv_freq(D, 1e4),
                                positions=pos, k_cache=kc, v_cache=vc, block_table=bt,
                                settings=st, **norms)
            got.append([t.view(torch.int16 if dt == torch.float16 else torch.int32)
                        for t in (q, kc, vc)])
        out[f"M{M}-D{D}-{'explicit' if gs else 'default'}{'-qknorm' if qkn else ''}"] = all(
            torch.equal(a, c) for a, c in zip(*got))
    print("RESULT " + json.dumps(out))
''')


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_interpreter_gemv_rope_equals_two_launch(dtype):
    """The GEMV-epilogue path does the two-launch path's arithmetic in the same order
    (the projection, its FlashNorm scale and rounding, then bias, QK-norm and RoPE), so
    its q and cache bits equal that path's, one pass and split K, on the FMA rows."""
    res = interpreter_child(EQUAL_CHILD, dtype)
    assert len(res) == 7 and all(res.values()), res


def test_gemv_rope_refuses_what_it_cannot_do(monkeypatch):
    """QK-norm where a program sees a few columns of a head (K unsplit, BLOCK_N < D), the
    whole-projection QK-norm, a BLOCK_N that does not divide the head dim, bf16 in the
    interpreter: each named before any launch."""
    from wsattn.kernels.gemv import GemvSettings
    from wsattn.kernels.qkv_rope import GemvRopeSettings
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    a = _good()
    kc_before = a["k_cache"].clone()
    qn = dict(a, q_norm=torch.ones(64, dtype=torch.float16),
              k_norm=torch.ones(64, dtype=torch.float16), qk_eps=1e-6)
    narrow = GemvRopeSettings(gemv=GemvSettings(16, 32, 1, False, 4, 1))
    with pytest.raises(ValueError, match="QK-norm .* only where a program holds whole heads"):
        qkv_rope_append(**qn, settings=narrow)
    whole = dict(a, q_norm=torch.ones(4 * 64, dtype=torch.float16),
                 k_norm=torch.ones(2 * 64, dtype=torch.float16), qk_eps=1e-6,
                 qk_norm_whole=True)
    with pytest.raises(ValueError, match="no QK-norm over the whole projection"):
        qkv_rope_append(**whole, settings=GemvRopeSettings())
    wide = GemvRopeSettings(gemv=GemvSettings(128, 32, 1, True, 4, 1))
    with pytest.raises(ValueError, match="BLOCK_N 128 must divide the head dim 64"):
        qkv_rope_append(**a, settings=wide)
    bf = {k: (v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.dtype == torch.float16
              else v) for k, v in a.items()}
    with pytest.raises(ValueError, match="bfloat16 in the Triton interpreter"):
        qkv_rope_append(**bf, settings=GemvRopeSettings())
    assert torch.equal(a["k_cache"], kc_before)


# --------------------------------------------------------------------------- rope_inv_freq


def _hf_config(head_dim, theta, rope_parameters):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                       rope_parameters=dict(rope_parameters, rope_theta=theta))


@pytest.mark.parametrize("head_dim,theta", [(64, 10000.0), (128, 500000.0), (128, 1000000),
                                            (256, 10000.0)])
def test_rope_inv_freq_default_matches_transformers(head_dim, theta):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
    cfg = _hf_config(head_dim, theta, {"rope_type": "default"})
    for fn in (LlamaRotaryEmbedding.compute_default_rope_parameters,
               Qwen3RotaryEmbedding.compute_default_rope_parameters):
        ref, scale = fn(cfg)
        assert scale == 1.0
        ours = rope_inv_freq(head_dim, theta)
        assert ours.dtype == torch.float32 and ours.shape == (head_dim // 2,)
        assert torch.equal(ours, ref)
    assert torch.equal(rope_inv_freq(head_dim, theta, {"rope_type": "default"}), ours)


@pytest.mark.parametrize("params", [
    # Llama-3.1 / 3.3
    dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=8192),
    # Llama-3.2 1B/3B
    dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=8192),
], ids=["llama3.1", "llama3.2"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_inv_freq_llama3_matches_transformers(params, head_dim):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    scaling = dict(params, rope_type="llama3")
    ref, scale = ROPE_INIT_FUNCTIONS["llama3"](_hf_config(head_dim, 500000.0, scaling))
    assert scale == 1.0
    ours = rope_inv_freq(head_dim, 500000.0, scaling)
    assert torch.equal(ours, ref)
    # scaling changes the low frequencies only: the first stays, the last is divided
    plain = rope_inv_freq(head_dim, 500000.0)
    assert ours[0] == plain[0] and ours[-1] == plain[-1] / params["factor"]


def test_rope_inv_freq_refuses_unknown_scaling():
    with pytest.raises(ValueError, match="scaling: rope type 'yarn'"):
        rope_inv_freq(128, 10000.0, {"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        rope_inv_freq(128, 10000.0, {"rope_type": "llama3", "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0})
    with pytest.raises(ValueError, match="head_dim"):
        rope_inv_freq(127, 10000.0)


# --------------------------------------------------------------------------- bad input


def _good(M=2, K=64, Hq=4, Hkv=2, D=64, dt=torch.float16):
    return dict(x=torch.randn(M, K, dtype=dt), wqkv=torch.randn((Hq + 2 * Hkv) * D, K, dtype=dt),
                inv_freq=rope_inv_freq(D, 10000.0),
                positions=torch.tensor([3, 17][:M], dtype=torch.int32),
                k_cache=torch.zeros(6, 16, Hkv, D, dtype=dt),
                v_cache=torch.zeros(6, 16, Hkv, D, dtype=dt),
                block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32))


BAD = {
    "x-dtype": (lambda a: a.update(x=a["x"].double()), "x must have dtype"),
    "x-1d": (lambda a: a.update(x=a["x"][0]), "x must be 2-D"),
    "x-K": (lambda a: a.update(x=torch.randn(2, 40, dtype=torch.float16)), "x: hidden size 40"),
    "wqkv-K": (lambda a: a.update(wqkv=a["wqkv"][:, :32]), "wqkv must be"),
    "wqkv-rows": (lambda a: a.update(wqkv=a["wqkv"][:-64]), "wqkv: "),
    "wqkv-dtype": (lambda a: a.update(wqkv=a["wqkv"].float()), "wqkv must have dtype"),
    "bqkv-shape": (lambda a: a.update(bqkv=torch.zeros(7, dtype=torch.float16)), "bqkv must"),
    "q_norm-alone": (lambda a: a.update(q_norm=torch.ones(64)), "q_norm and k_norm"),
    "q_norm-shape": (lambda a: a.update(q_norm=torch.ones(32), k_norm=torch.ones(64),
                                        qk_eps=1e-6), "q_norm must"),
    "qk_eps-missing": (lambda a: a.update(q_norm=torch.ones(64), k_norm=torch.ones(64)),
                       "qk_eps"),
    "whole-without-norms": (lambda a: a.update(qk_norm_whole=True), "qk_norm_whole=True needs"),
    "whole-per-head-shape": (lambda a: a.update(q_norm=torch.ones(64, dtype=torch.float16),
                                                k_norm=torch.ones(64, dtype=torch.float16),
                                                qk_eps=1e-6, qk_norm_whole=True),
                             r"q_norm must be a contiguous \[256\] \(Hq \* D"),
    "whole-with-bias": (lambda a: a.update(q_norm=torch.ones(256, dtype=torch.float16),
                                           k_norm=torch.ones(128, dtype=torch.float16),
                                           qk_eps=1e-6, qk_norm_whole=True,
                                           bqkv=torch.zeros(512, dtype=torch.float16)),
                        "takes no bqkv"),
    "whole-type": (lambda a: a.update(qk_norm_whole=1), "qk_norm_whole must be a bool"),
    "norm_eps-type": (lambda a: a.update(norm_eps="1e-5"), "norm_eps"),
    "inv_freq-dtype": (lambda a: a.update(inv_freq=a["inv_freq"].double()), "inv_freq must"),
    "inv_freq-shape": (lambda a: a.update(inv_freq=torch.ones(64)), "inv_freq must"),
    "positions-dtype": (lambda a: a.update(positions=a["positions"].long()), "positions must"),
    "positions-shape": (lambda a: a.update(positions=torch.zeros(3, dtype=torch.int32)),
                        "positions must"),
    "positions-range": (lambda a: a.update(positions=torch.tensor([3, 32], dtype=torch.int32)),
                        r"positions must lie in \[0, 32\)"),
    "head-dim": (lambda a: a.update(k_cache=torch.zeros(6, 16, 2, 96, dtype=torch.float16),
                                    v_cache=torch.zeros(6, 16, 2, 96, dtype=torch.float16)),
                 "head dim 96"),
    "v_cache-shape": (lambda a: a.update(v_cache=a["v_cache"][:5]), "v_cache shape"),
    "k_cache-dtype": (lambda a: a.update(k_cache=a["k_cache"].float()), "k_cache must have"),
    "block_table-dtype": (lambda a: a.update(block_table=a["block_table"].long()),
                          "block_table must"),
    "block_table-range": (lambda a: a.update(block_table=torch.tensor([[0, 1], [2, 9]],
                                                                      dtype=torch.int32)),
                          "block_table entries"),
    "rows-over-batch": (lambda a: a.update(block_table=a["block_table"][:1]), "2 rows"),
    "seq_index-range": (lambda a: a.update(seq_index=torch.tensor([0, 5], dtype=torch.int32)),
                        "seq_index must lie"),
    "q_out-shape": (lambda a: a.update(q_out=torch.empty(2, 4, 32, dtype=torch.float16)),
                    "q_out must be"),
    "pdl-type": (lambda a: a.update(pdl="yes"), "pdl must be"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_names_the_argument(case):
    args = _good()
    mutate, message = BAD[case]
    mutate(args)
    kc_before = args["k_cache"].clone()
    with pytest.raises(ValueError, match=message):
        qkv_rope_append(**args)
    assert torch.equal(args["k_cache"], kc_before)


def test_fma_settings_refused_by_name(monkeypatch):
    """use_dot=False takes one row block of at most FMA_MAX_ROWS rows, and a bool
    (refused before any launch; the interpreter is the target so the settings are read)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    a = _good()
    s = QkvRopeSettings(BLOCK_K=16, split_k=1, num_warps=4, num_stages=1, use_dot=False)
    many = dict(a, x=torch.randn(9, 64, dtype=torch.float16),
                positions=torch.zeros(9, dtype=torch.int32),
                block_table=torch.zeros(9, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="use_dot=False takes at most 8 rows"):
        qkv_rope_append(**many, settings=s)
    with pytest.raises(ValueError, match="QkvRopeSettings.use_dot must be a bool"):
        QkvRopeSettings(BLOCK_K=16, split_k=1, num_warps=4, num_stages=1, use_dot=0)


@pytest.mark.parametrize("kw, match", [
    (dict(BLOCK_K=48), "BLOCK_K must be a power of two"),
    (dict(BLOCK_K=0), "BLOCK_K must be a positive int"),
    (dict(BLOCK_K=8), "BLOCK_K must be >= 16"),
    (dict(BLOCK_K=True), "BLOCK_K must be a positive int"),
    (dict(split_k=2.0), "split_k must be a positive int"),
    (dict(split_k=100), "split_k must be <= 16"),
    (dict(num_warps=3), "num_warps must be a power of two"),
    (dict(num_stages=0), "num_stages must be a positive int"),
])
def test_settings_refuse_bad_fields(kw, match):
    with pytest.raises(ValueError, match=match):
        QkvRopeSettings(**{**dict(BLOCK_K=16, split_k=1, num_warps=4, num_stages=1), **kw})


def test_overlapping_outputs_and_caches_refused(monkeypatch):
    """q_out with overlapping rows or over an input, caches that overlap each other or
    themselves, K = 0, an eps that fp32 flushes to zero, a non-bool pdl: refused by name
    before any launch."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    a = _good()
    M, K = a["x"].shape
    HKV, D = a["k_cache"].shape[2], a["k_cache"].shape[3]
    HQ = a["wqkv"].shape[0] // D - 2 * HKV
    expanded = torch.empty(1, HQ, D, dtype=a["x"].dtype).expand(M, HQ, D)
    cases = [
        (dict(q_out=expanded), "q_out's elements overlap"),
        (dict(v_cache=a["k_cache"]), "k_cache and v_cache must not overlap"),
        (dict(k_cache=a["k_cache"][:, :, :1].expand(a["k_cache"].shape)), "k_cache's elements overlap"),
        (dict(norm_eps=1e-50), "norm_eps .*fp32's normal range"),
        (dict(pdl=1), "pdl must be None, True or False"),
    ]
    cases.append((dict(q_out=a["wqkv"].view(-1)[:M * HQ * D].view(M, HQ, D)),
                  "q_out must not overlap wqkv"))
    for change, match in cases:
        with pytest.raises(ValueError, match=match):
            qkv_rope_append(**{**a, **change})
    with pytest.raises(ValueError, match="hidden size 0 must be a positive multiple of 16"):
        qkv_rope_append(**{**a, "x": torch.empty(M, 0, dtype=a["x"].dtype),
                           "wqkv": torch.empty(a["wqkv"].shape[0], 0, dtype=a["x"].dtype)})


def test_workspace_refuses_bad_shapes():
    from wsattn.kernels.qkv_rope import qkv_rope_workspace

    s = QkvRopeSettings(BLOCK_K=16, split_k=2, num_warps=4, num_stages=1)
    for kw, match in ((dict(q_heads=0), "q_heads must be a positive int"),
                      (dict(q_heads=2.5), "q_heads must be a positive int"),
                      (dict(q_heads=3, kv_heads=2), "multiple of kv_heads"),
                      (dict(head_dim=100), "head_dim must be one of"),
                      (dict(head_dim=True), "head_dim must be one of")):
        args = {**dict(rows=4, q_heads=4, kv_heads=2, head_dim=64), **kw}
        with pytest.raises(ValueError, match=match):
            qkv_rope_workspace("cpu", settings=s, **args)
    with pytest.raises(ValueError, match="hidden must be a positive multiple of 16"):
        qkv_rope_workspace("cpu", 4, 4, 2, 64, hidden=0, dtype=torch.float16)
    with pytest.raises(ValueError, match="dtype must be one of"):
        qkv_rope_workspace("cpu", 4, 4, 2, 64, hidden=64, dtype=torch.int32)


def test_good_input_passes_validation():
    a = _good()
    assert qkv_rope._check(a["x"], a["wqkv"], None, None, None, 1e-5, None, a["inv_freq"],
                           a["positions"], a["k_cache"], a["v_cache"], a["block_table"], None,
                           None, None) == (4, 2, 64)


# --------------------------------------------------------------------------- sm_90 builds


def _compile(**kw):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    s = qkv_rope.compile_spec(90, **kw)
    src = ASTSource(s["fn"], s["signature"], s["constexprs"], s["attrs"])
    return s, triton.compile(src, target=GPUTarget("cuda", 90, 32), options=s["options"])


def _ptxas_spills(kernel):
    import triton
    ptx = kernel.asm["ptx"]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        log = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", "-o", os.devnull, f.name],
                             capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    st, ld = map(int, re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log).groups())
    return regs, st + ld


def _before_wait(spec, kernel, params):
    """What the sm_90 PTX does before its griddepcontrol.wait: (global loads, global loads
    whose address derives from one of the kernel arguments named in params, global
    stores). The derivation is followed through every instruction before the wait, in
    any order (a fixed point), so a register it may reach counts."""
    ptx = kernel.asm["ptx"]
    head = ptx[:ptx.index("griddepcontrol.wait")].splitlines()
    args = [n for n in spec["fn"].arg_names if spec["signature"][n] != "constexpr"]
    name = spec["fn"].__name__
    sources = {f"[{name}_param_{args.index(n)}]" for n in params}
    insn = re.compile(r"\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)\s+(.*);")
    tainted, changed = set(), True
    while changed:
        changed = False
        for line in head:
            m = insn.match(line)
            if not m or m.group(1).startswith(("st.", "bra")):
                continue
            dst, _, rest = m.group(2).partition(",")
            defs = set(re.findall(r"%\w+", dst))
            if (set(re.findall(r"%\w+", rest)) & tainted
                    or any(src in rest.replace(" ", "") for src in sources)):
                if not defs <= tainted:
                    tainted |= defs
                    changed = True
    loads = [line for line in head if re.search(r"\bld\.global", line)]
    derived = [line for line in loads
               if set(re.findall(r"%\w+", line.partition("[")[2])) & tainted]
    return loads, derived, [line for line in head if re.search(r"\bst\.global", line)]


@pytest.mark.parametrize("rows", [1, 8, 64])
@pytest.mark.parametrize("family", FUSED)
def test_sm90_llama8b_shape_compiles_without_spills(family, rows, record_property):
    """Llama-3.1-8B attention input (K 4096, Hq 32, Hkv 8, D 128), the fused kernel with
    its sm_90 settings (fused_settings)."""
    s, k = _compile(rows=rows, fused=True, **FAMILIES[family])
    regs, spills = _ptxas_spills(k)
    record_property("registers", regs)
    print(f"{family} M{rows}: {s['constexprs']} {s['options']}: {regs} registers, "
          f"{spills} spill bytes, {k.metadata.shared} shared")
    assert spills == 0, f"{spills} spill bytes ({regs} registers)"
    ptx = k.asm["ptx"]
    assert "ld.global.v4" in ptx, "weights should stream in 16-byte loads"
    assert re.search(r"cp\.async\.cg\.shared\.global.*, 0x10", ptx), "the loop should be pipelined"
    assert "cos.approx" not in ptx and "sin.approx" not in ptx  # angles reach ~1e5 rad
    assert "griddepcontrol" not in ptx  # PDL off


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("shape", [dict(q_heads=16, kv_heads=16, head_dim=128),   # OLMoE
                                   dict(q_heads=32, kv_heads=8, head_dim=64)])
def test_sm90_two_launch_kernel_compiles_without_spills(shape, family):
    """The two-launch path's second kernel (OLMoE's whole-projection QK-norm; the A/B path
    of the other families) at sm_90: no spills, and under PDL it reads the position side
    (positions, block table, inv_freq) before its wait and nothing of its input, the
    projection's output, and writes nothing there."""
    fam = dict(FAMILIES[family], settings=qkv_rope.TwoLaunchSettings())
    s, k = _compile(**fam, **shape)
    regs, spills = _ptxas_spills(k)
    assert spills == 0, (shape, regs)
    assert s["fn"] is qkv_rope._norm_rope_append_kernel
    c = s["constexprs"]
    assert (c["WHOLE"], c["QK_NORM"], c["BIAS"]) == (
        bool(fam.get("qk_norm_whole")), fam["qk_norm"], fam["bias"])
    loads, of_projection, stores = _before_wait(*_compile(**fam, pdl=True, **shape),
                                                ("qkv_ptr",))
    assert loads and not of_projection and not stores, (of_projection, stores)


@pytest.mark.parametrize("rows", [1, 2, 8, 64])
@pytest.mark.parametrize("shape", ["1B", "8B"])
def test_sm90_gemv_rope_builds_compile_without_spills(shape, rows):
    """The GEMV-epilogue path at the Llama-3.2-1B (K 2048, D 64) and Llama-3.1-8B (K 4096,
    D 128) shapes with bias, PDL on: both launches build without spills; the projection
    streams W in 16-byte loads, pipelined, loads its first W tile before the PDL wait and
    reads nothing else before it; the finish reads the position side before its wait and
    the partials only after it."""
    kw = dict(head_dim=64, hidden=2048) if shape == "1B" else dict(head_dim=128, hidden=4096)
    kw["settings"] = qkv_rope.GemvRopeSettings()  # the default picks by grid size
    s, k = _compile(rows=rows, bias=True, pdl=True, **kw)
    assert s["fn"] is qkv_rope._gemv_rope_kernel
    regs, spills = _ptxas_spills(k)
    assert spills == 0, (shape, rows, regs)
    ptx = k.asm["ptx"]
    assert "ld.global.v4" in ptx or "cp.async" in ptx
    assert "cos.approx" not in ptx and "sin.approx" not in ptx
    wait = ptx.index("griddepcontrol.wait")
    assert "ld.global" in ptx[:wait] or "cp.async" in ptx[:wait]  # the first W tile
    assert s["constexprs"]["BLOCK_N"] <= kw["head_dim"] and not s["constexprs"]["PDL_LATE"]
    fs, fk = _compile(rows=rows, bias=True, pdl=True, finish=True, **kw)
    assert _ptxas_spills(fk)[1] == 0, (shape, rows)
    loads, of_partials, stores = _before_wait(fs, fk, ("ws_ptr", "ss_ptr"))
    assert loads and not of_partials and not stores, (shape, rows, of_partials, stores)
    # per-head QK-norm: the finish holds a whole head; unsplit, BLOCK_N = D
    _, qk = _compile(rows=rows, qk_norm=True, pdl=True, finish=True, **kw)
    assert _ptxas_spills(qk)[1] == 0, (shape, rows, "qk_norm finish")
    if rows <= 2:
        from wsattn.kernels.gemv import GemvSettings
        whole = dict(kw, settings=qkv_rope.GemvRopeSettings(
            gemv=GemvSettings(kw["head_dim"], 32, 1, False, 4, 4)))
        _, qk1 = _compile(rows=rows, qk_norm=True, pdl=True, **whole)
        assert _ptxas_spills(qk1)[1] == 0, (shape, rows, "qk_norm unsplit")


def test_sm90_pdl_waits_before_reading_activations():
    _, on = _compile(pdl=True, fused=True)
    ptx = on.asm["ptx"]
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
    # the first weight tile's loads come before the wait
    assert ptx.index("ld.global.v4") < ptx.index("griddepcontrol.wait")


@pytest.mark.parametrize("rows", [1, 4, 8])
@pytest.mark.parametrize("shape", ["1B", "8B"])
def test_sm90_fma_builds_compile_without_spills(shape, rows):
    """The FMA path (use_dot=False) at the 1B (K 2048, D 64) and 8B (K 4096, D 128)
    shapes, one pass and split K: no MMA, no spills, weights in 16-byte loads."""
    kw = dict(head_dim=64, hidden=2048) if shape == "1B" else dict(head_dim=128, hidden=4096)
    # 8 warps: at 4 the [D/2, BLOCK_K] products of both halves spill at M 4-8 (ptxas -v on
    # the CPU: 255 registers); BLOCK_K 256 spills at the 8B shape
    for bk in ((64, 128) if shape == "1B" else (64,)):
        st = QkvRopeSettings(BLOCK_K=bk, split_k=4, num_warps=8, num_stages=4,
                             use_dot=False)
        s, k = _compile(rows=rows, settings=st, **kw)
        regs, spills = _ptxas_spills(k)
        ptx = k.asm["ptx"]
        assert spills == 0, f"{shape} M{rows} {st}: {spills} spill bytes ({regs} registers)"
        assert "mma" not in ptx and "ld.global.v4" in ptx or "cp.async" in ptx, st
        assert s["constexprs"]["BLOCK_M"] == max(1, 1 << (rows - 1).bit_length())


def test_sm90_d64_and_d256_build():
    for kw in (dict(head_dim=64, hidden=2048), dict(head_dim=256, rows=64, qk_norm=True)):
        _, k = _compile(fused=True, **kw)
        assert _ptxas_spills(k)[1] == 0, kw


def test_fused_settings_split_k_to_fill_the_gpu():
    """Hq + 2 Hkv = 48 heads are fewer than 132 SMs: the fused kernel's settings split K so
    the launch has >= 132 programs, and the split's reduction path (counter atomics,
    fences) is compiled in."""
    s, k = _compile(fused=True)
    assert s["constexprs"]["SPLIT_K"] * 48 >= 132
    assert "atom" in k.asm["ptx"] and "fence.acq_rel.gpu" in k.asm["ptx"]


# --------------------------------------------------------------------------- workspace

WS_CHILD = textwrap.dedent(r'''
    import json
    import torch
    from wsattn.kernels import qkv_rope
    from wsattn.kernels.qkv_rope import (QkvRopeSettings, QkvRopeWorkspace, qkv_rope_append,
                                         qkv_rope_workspace, rope_inv_freq, workspace_size)
    from wsattn.testing import rel_err, tol
''') + HELPERS + textwrap.dedent(r'''
    out = {}
    fam = dict(norm=True, bias=True, qk_norm=True)
    M, K, Hq, Hkv, D = 5, 64, 8, 2, 64
    s = QkvRopeSettings(BLOCK_K=16, split_k=3, num_warps=4, num_stages=1)
    inp = make_inputs(fam, M, K, Hq, Hkv, D, torch.float32, "cpu")
    results = []
    for use in ("cached", "explicit", "explicit-again"):
        kc, vc, bt, _, _ = make_caches(M, Hkv, D, torch.float32, "cpu")
        ws = None if use == "cached" else qkv_rope_workspace("cpu", 8, Hq, Hkv, D, s)
        if use == "explicit-again":  # the same workspace, twice: counters left at 0
            qkv_rope_append(**inp, k_cache=kc.clone(), v_cache=vc.clone(), block_table=bt,
                            settings=s, workspace=ws)
        q = qkv_rope_append(**inp, k_cache=kc, v_cache=vc, block_table=bt, settings=s,
                            workspace=ws)
        results.append((bits(q), bits(kc), bits(vc)))
        if ws is not None:
            out[use + "-counters-zero"] = bool((ws.counters == 0).all())
    out["bitwise"] = all(torch.equal(a, b) for r in results[1:] for a, b in zip(results[0], r))
    out["sizes"] = list(workspace_size(M, Hq, Hkv, D, s))
    out["split1"] = list(workspace_size(M, Hq, Hkv, D, QkvRopeSettings(16, 1, 4, 1)))
    d = qkv_rope_workspace("cpu", 64, 32, 8, 128, hidden=4096, dtype=torch.float16)
    out["default_interp"] = [t.numel() for t in d]  # the interpreter's settings: no split

    def refused(ws):
        kc, vc, bt, _, _ = make_caches(M, Hkv, D, torch.float32, "cpu")
        kc0 = kc.clone()
        launched = []
        orig = qkv_rope._qkv_rope_kernel.run
        qkv_rope._qkv_rope_kernel.run = lambda *a, **k: launched.append(1)
        try:
            qkv_rope_append(**inp, k_cache=kc, v_cache=vc, block_table=bt, settings=s,
                            workspace=ws)
        except ValueError as e:
            return str(e), bool(launched), torch.equal(bits(kc), bits(kc0))
        finally:
            qkv_rope._qkv_rope_kernel.run = orig
        return None, bool(launched), True

    full = qkv_rope_workspace("cpu", M, Hq, Hkv, D, s)
    out["too_small"] = refused(QkvRopeWorkspace(full.partials[:-1], full.ss, full.counters))
    out["bad_dtype"] = refused(QkvRopeWorkspace(full.partials, full.ss, full.counters.long()))
    out["bad_type"] = refused((full.partials, full.ss, full.counters))
    print("RESULT " + json.dumps(out))
''')


def test_explicit_workspace_is_bitwise_the_cached_one_and_checked():
    """Split K through a caller's workspace gives the bits the cached per-device one gives,
    and leaves its counters at 0 (reusable, graph-safe); a workspace too small for the
    launch, of the wrong dtype or not a QkvRopeWorkspace is refused naming it before any
    launch, the cache untouched."""
    r = interpreter_child(WS_CHILD)
    assert r["bitwise"] and r["explicit-counters-zero"] and r["explicit-again-counters-zero"], r
    heads = 8 + 2 * 2
    assert r["sizes"] == [heads * 3 * 16 * 64, heads * 3 * 16, heads], r  # one 16-row block
    assert r["split1"] == [0, 0, 0] and r["default_interp"] == [1, 1, 1], r
    msg, launched, untouched = r["too_small"]
    assert msg and "workspace.partials holds" in msg and not launched and untouched, r
    msg, launched, _ = r["bad_dtype"]
    assert msg and "workspace.counters must be" in msg and not launched, r
    msg, launched, _ = r["bad_type"]
    assert msg and "workspace must be a QkvRopeWorkspace" in msg and not launched, r


# --------------------------------------------------------------------------- CUDA


def _same_bits(a, b):
    """Bitwise equality: the caches hold NaN-poisoned slots, and NaN != NaN in torch.equal."""
    return not bits_report(a, b)


def _gpu_ns():
    ns = {"qkv_rope_append": qkv_rope_append, "rope_inv_freq": rope_inv_freq,
          "QkvRopeSettings": QkvRopeSettings}
    from wsattn.testing import rel_err, tol
    ns.update(rel_err=rel_err, tol=tol)
    exec(HELPERS, ns)
    return ns


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8, 64])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_gpu_bf16_against_float64(family, M):
    ns = _gpu_ns()
    m = min(M, 8)  # POSITIONS has 8 rows; larger M repeats the pattern through seeds
    r = ns["run_case"](FAMILIES[family], m, 4096, 32, 8, 128, torch.bfloat16, "cuda", seed=M)
    assert all(r[k] <= r["tol"] for k in ("q", "k", "v")), r
    assert r["untouched"] and r["paged_eq_contig"], r


def test_sm90_default_paths():
    """On sm_90 a call without settings takes the GEMV-epilogue path without QK-norm and
    the two-launch path with it (notes/decode_step.md); the compile spec follows, and
    fused=True builds the fused kernel. Other targets keep the fused kernel."""
    from wsattn.target import Target
    kw = dict(rows=8, hidden=4096, heads=48, head_dim=128, dtype=torch.bfloat16)
    h200 = Target("cuda", 90, 132)
    assert qkv_rope.default_settings(h200, **kw) == qkv_rope.GemvRopeSettings()
    # QK-norm: where K is split (8 rows here: each finish program holds a head), not at one
    # row (16-column programs, K whole)
    assert qkv_rope.default_settings(h200, **kw, qk_norm=True) == qkv_rope.GemvRopeSettings()
    assert qkv_rope.default_settings(h200, **dict(kw, rows=1, hidden=2048, head_dim=64),
                                     qk_norm=True) == qkv_rope.TwoLaunchSettings()
    # one row of Llama-3.1-8B: 384 projection programs of 16 columns, more than two an SM
    # (measured slower there): two launches; Llama-3.2-1B's 192 take the GEMV epilogue
    one = dict(kw, rows=1)
    assert qkv_rope.default_settings(h200, **one) == qkv_rope.TwoLaunchSettings()
    assert qkv_rope.default_settings(h200, **dict(one, hidden=2048, head_dim=64)) == \
        qkv_rope.GemvRopeSettings()
    for cc in (80, 100, 120):
        t = Target("cuda", cc, 132)
        assert qkv_rope.default_settings(t, **kw) == qkv_rope.fused_settings(t, **kw)
    assert qkv_rope.compile_spec(90, rows=8)["fn"] is qkv_rope._gemv_rope_kernel
    assert qkv_rope.compile_spec(90, rows=8, finish=True)["fn"] is qkv_rope._rope_finish_kernel
    assert qkv_rope.compile_spec(90)["fn"] is qkv_rope._norm_rope_append_kernel  # 384 programs
    assert qkv_rope.compile_spec(90, rows=1, hidden=2048, head_dim=64, qk_norm=True)["fn"] is \
        qkv_rope._norm_rope_append_kernel
    assert qkv_rope.compile_spec(90, fused=True)["fn"] is qkv_rope._qkv_rope_kernel
    assert qkv_rope.compile_spec(100)["fn"] is qkv_rope._qkv_rope_kernel


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8, 64])
@pytest.mark.parametrize("family", FUSED)
def test_gpu_fused_kernel_against_float64(family, M):
    """The fused one-launch kernel with its own settings (fused_settings; not the sm_90
    default) at the Llama-3.1-8B shape, bf16: within tolerance of float64, caches untouched
    elsewhere, paged equal to contiguous."""
    from wsattn.target import target_of
    ns = _gpu_ns()
    m = min(M, 8)
    s = qkv_rope.fused_settings(target_of(torch.device("cuda")), rows=m, hidden=4096,
                                heads=48, head_dim=128, dtype=torch.bfloat16)
    r = ns["run_case"](FAMILIES[family], m, 4096, 32, 8, 128, torch.bfloat16, "cuda",
                       settings=s, seed=M)
    assert all(r[k] <= r["tol"] for k in ("q", "k", "v")), r
    assert r["untouched"] and r["paged_eq_contig"], r


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 4, 8])
@pytest.mark.parametrize("family", FUSED)
def test_gpu_fma_path_against_float64(family, M):
    """use_dot=False (the per-row FMA reduction) at the 1B shape (K 2048, Hq 32, Hkv 8,
    D 64), split K, bf16: within tolerance of float64, caches untouched elsewhere."""
    ns = _gpu_ns()
    s = QkvRopeSettings(BLOCK_K=64, split_k=4, num_warps=8, num_stages=4, use_dot=False)
    r = ns["run_case"](FAMILIES[family], min(M, 8), 2048, 32, 8, 64, torch.bfloat16, "cuda",
                       settings=s, seed=M)
    assert all(r[k] <= r["tol"] for k in ("q", "k", "v")), r
    assert r["untouched"] and r["paged_eq_contig"], r


def _assert_graph_replays_bitwise(inp, kc, q0, k0, **kw):
    """qkv_rope_append(**inp, **kw) captured in a CUDA graph into a fresh q_out: three
    replays each give q0 and leave the cache k0, bit for bit."""
    q_out = torch.empty_like(q0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qkv_rope_append(**inp, **kw, q_out=q_out)
    for _ in range(3):
        q_out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert _same_bits(q_out, q0) and _same_bits(kc, k0)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8])
@pytest.mark.parametrize("family", FUSED)
def test_gpu_two_launch_against_float64(family, M):
    """TwoLaunchSettings (gemv, then one program per row and head) at the Llama-3.1-8B
    shape, bf16: within tolerance of float64, caches untouched elsewhere, paged equal to
    contiguous; reruns and a CUDA-graph replay under PDL bit-identical."""
    ns = _gpu_ns()
    s = qkv_rope.TwoLaunchSettings()
    r = ns["run_case"](FAMILIES[family], M, 4096, 32, 8, 128, torch.bfloat16, "cuda",
                       settings=s, seed=M)
    assert all(r[k] <= r["tol"] for k in ("q", "k", "v")), r
    assert r["untouched"] and r["paged_eq_contig"], r
    pdl = torch.cuda.get_device_capability()[0] >= 9
    inp = ns["make_inputs"](FAMILIES[family], M, 4096, 32, 8, 128, torch.bfloat16, "cuda")
    kc, vc, bt, _, _ = ns["make_caches"](M, 8, 128, torch.bfloat16, "cuda")
    q0 = qkv_rope_append(**inp, k_cache=kc, v_cache=vc, block_table=bt, pdl=pdl, settings=s)
    _assert_graph_replays_bitwise(inp, kc, q0, kc.clone(), k_cache=kc, v_cache=vc,
                                  block_table=bt, pdl=pdl, settings=s)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2, 8, 64])
@pytest.mark.parametrize("shape", ["1B", "8B"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_gpu_gemv_rope_against_float64_and_two_launch(family, shape, M):
    """The GEMV-epilogue path at the Llama-3.2-1B and Llama-3.1-8B shapes, bf16, with its
    default settings (split K at 8 and 64 rows; with QK-norm at 1 and 2 rows, where the
    defaults do not split, a whole head a program, BLOCK_N = D): within tolerance of
    float64, caches untouched elsewhere, paged equal to contiguous; q and the cache bit
    for bit the two-launch path's without QK-norm when that path's projection runs the
    same GEMV settings (the same tiles and K split, so the same sums: the two paths'
    own defaults differ at 3-32 rows, where plain GEMVs take the deep one-wave rule and
    the epilogue path keeps the split one, and then differ by bf16 rounding), within
    bf16 rounding with QK-norm (the head's sum of squares reduces over another tile
    shape: [rows, D/2] across 4-8 warps against one row across 2); a CUDA-graph replay
    under PDL bit-identical to the eager call."""
    from wsattn.kernels.gemv import GemvSettings
    from wsattn.target import target_of
    ns = _gpu_ns()
    K, Hq, Hkv, D = (2048, 32, 8, 64) if shape == "1B" else (4096, 32, 8, 128)
    fam = FAMILIES[family]
    m = min(M, 8)
    s = qkv_rope.GemvRopeSettings()
    if fam["qk_norm"] and M <= 2:
        s = qkv_rope.GemvRopeSettings(gemv=GemvSettings(D, 32, 1, False, 4, 4))
    r = ns["run_case"](fam, m, K, Hq, Hkv, D, torch.bfloat16, "cuda", settings=s, seed=M)
    assert all(r[k] <= r["tol"] for k in ("q", "k", "v")), r
    assert r["untouched"] and r["paged_eq_contig"], r
    pdl = torch.cuda.get_device_capability()[0] >= 9
    g = torch.Generator(device="cuda").manual_seed(M)
    inp = ns["make_inputs"](fam, m, K, Hq, Hkv, D, torch.bfloat16, "cuda", seed=M)
    inp["x"] = torch.randn(M, K, generator=g, device="cuda").to(torch.bfloat16)
    inp["positions"] = torch.randint(0, 64, (M,), generator=g, device="cuda",
                                     dtype=torch.int32)
    pages = M * 4 + 3
    bt = torch.randperm(pages, device="cuda")[:M * 4].to(torch.int32).view(M, 4)
    outs = []
    two = qkv_rope.TwoLaunchSettings()
    if not fam["qk_norm"]:
        two = qkv_rope.TwoLaunchSettings(gemv=qkv_rope.gemv_rope_settings(
            target_of(torch.device("cuda")), M, K, Hq + 2 * Hkv, D, torch.bfloat16, s.gemv))
    for st in (two, s):
        kc = torch.full((pages, 16, Hkv, D), float("nan"), dtype=torch.bfloat16, device="cuda")
        vc = kc.clone()
        q = qkv_rope_append(**inp, k_cache=kc, v_cache=vc, block_table=bt, pdl=pdl, settings=st)
        outs.append((q, kc, vc))
    if fam["qk_norm"]:
        for a, b in zip(*outs):
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2,
                                       equal_nan=True)
    else:
        for name, a, b in zip(("q", "k cache", "v cache"), *outs):
            assert not bits_report(a, b), f"{name} differs from the two-launch path: " \
                                          f"{bits_report(a, b)}"
    q0, kc, vc = outs[1]
    _assert_graph_replays_bitwise(inp, kc, q0, kc.clone(), k_cache=kc, v_cache=vc,
                                  block_table=bt, pdl=pdl, settings=s)


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
def test_gpu_split_k_is_deterministic_and_graph_safe(pdl):
    """Split-K reduces in a fixed order and resets its counters: reruns and CUDA-graph
    replays are bit-identical to the eager call."""
    if pdl and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90+")
    ns = _gpu_ns()
    fam = FAMILIES["qwen3"]
    inp = ns["make_inputs"](fam, 8, 4096, 32, 8, 128, torch.bfloat16, "cuda")
    kc, vc, bt, _, _ = ns["make_caches"](8, 8, 128, torch.bfloat16, "cuda")
    s = QkvRopeSettings(BLOCK_K=128, split_k=4, num_warps=4, num_stages=4)
    q0 = qkv_rope_append(**inp, k_cache=kc, v_cache=vc, block_table=bt, pdl=pdl, settings=s)
    k0 = kc.clone()
    q_out = torch.empty_like(q0)
    for _ in range(3):
        qkv_rope_append(**inp, k_cache=kc, v_cache=vc, block_table=bt, pdl=pdl, settings=s,
                        q_out=q_out)
        assert _same_bits(q_out, q0) and _same_bits(kc, k0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qkv_rope_append(**inp, k_cache=kc, v_cache=vc, block_table=bt, pdl=pdl, settings=s,
                        q_out=q_out)
    q_out.zero_()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert _same_bits(q_out, q0) and _same_bits(kc, k0)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["two-launch", "gemv-rope-split"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_gpu_pdl_epilogue_reads_positions_written_two_launches_back(family, path):
    """The two-launch path's epilogue kernel and the GEMV-epilogue path's split-K finish
    read the positions and the block table before their PDL wait. As in the engine's step,
    a kernel just before the projection writes the positions (seqlens - 1) inside the
    captured graph; replays with new seqlens each give the caches and q of an eager call
    without PDL at those positions, bit for bit (Llama-3.1-8B shape, 8 rows, bf16)."""
    from wsattn.kernels import gemv as _gemv
    from wsattn.target import target_of
    if torch.cuda.get_device_capability()[0] < 9:
        # griddepcontrol is sm_90 PTX: there is no PDL to test below it (the launchers
        # refuse pdl=True there by name)
        pytest.skip("PDL needs sm_90+")
    ns = _gpu_ns()
    fam = FAMILIES[family]
    M, K, Hq, Hkv, D = 8, 4096, 32, 8, 128
    if path == "two-launch":
        s = qkv_rope.TwoLaunchSettings()
    else:
        s = qkv_rope.GemvRopeSettings()
        g = qkv_rope.gemv_rope_settings(target_of(torch.device("cuda")), M, K, Hq + 2 * Hkv,
                                        D, torch.bfloat16)
        assert _gemv.launch_split(K, g) > 1  # the finish kernel runs
    inp = ns["make_inputs"](fam, M, K, Hq, Hkv, D, torch.bfloat16, "cuda")
    kc, vc, bt, _, _ = ns["make_caches"](M, Hkv, D, torch.bfloat16, "cuda")
    seqlens = (inp["positions"] + 1).contiguous()
    positions = torch.empty_like(seqlens)
    q_out = torch.empty(M, Hq, D, dtype=torch.bfloat16, device="cuda")
    call = dict(inp, positions=positions, block_table=bt, settings=s)
    torch.sub(seqlens, 1, out=positions)  # builds before the capture
    qkv_rope_append(**call, k_cache=kc, v_cache=vc, q_out=q_out, pdl=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.sub(seqlens, 1, out=positions)
        qkv_rope_append(**call, k_cache=kc, v_cache=vc, q_out=q_out, pdl=True)
    g = torch.Generator(device="cuda").manual_seed(5)
    for _ in range(4):
        pos = torch.randint(0, 64, (M,), generator=g, device="cuda", dtype=torch.int32)
        kr, vr = kc.clone(), vc.clone()
        q_ref = qkv_rope_append(**dict(call, positions=pos), k_cache=kr, v_cache=vr,
                                pdl=False)
        seqlens.copy_(pos + 1)
        q_out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert _same_bits(q_out, q_ref) and _same_bits(kc, kr) and _same_bits(vc, vr)


@pytest.mark.gpu
def test_gpu_explicit_workspace_matches_cached_and_replays():
    """bf16 at the Llama-3.1-8B shape with split K: an owned workspace gives the cached
    one's bits, eager and replayed from a CUDA graph captured with it."""
    ns = _gpu_ns()
    fam = FAMILIES["llama"]
    inp = ns["make_inputs"](fam, 8, 4096, 32, 8, 128, torch.bfloat16, "cuda")
    kc, vc, bt, _, _ = ns["make_caches"](8, 8, 128, torch.bfloat16, "cuda")
    s = QkvRopeSettings(BLOCK_K=128, split_k=4, num_warps=4, num_stages=4)
    ws = qkv_rope.qkv_rope_workspace("cuda", 64, 32, 8, 128, s)
    q0 = qkv_rope_append(**inp, k_cache=kc, v_cache=vc, block_table=bt, settings=s)
    k0 = kc.clone()
    q1 = qkv_rope_append(**inp, k_cache=kc, v_cache=vc, block_table=bt, settings=s, workspace=ws)
    assert _same_bits(q1, q0) and _same_bits(kc, k0)
    _assert_graph_replays_bitwise(inp, kc, q0, k0, k_cache=kc, v_cache=vc, block_table=bt,
                                  settings=s, workspace=ws)
