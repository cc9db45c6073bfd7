"""decode_triton.decode_qkv: decode attention with the QKV projection's epilogue (bias,
QK-norm, RoPE, the new key and value's cache append) inside the decode launch.

Against a float64 reference of the whole thing (epilogue, append, attention) through the
Triton interpreter on CPU (fp32 / fp16), or on CUDA where there is a GPU; the cache rows
the call may not read (past each sequence's end, and the new token's own slot, which the
kernel writes) hold NaN before the call. sm_90 builds compile without spills. Bad
arguments are refused by name before any launch.
"""

import math
import re

import pytest
import torch

from wsattn.rope import rope_inv_freq
from wsattn.testing import rel_err

from test_decode import kernel_device  # noqa: F401  (the fixture)

EPS = 1e-6


def reference(qkv, k_cache, v_cache, seqlens, table, heads, inv_freq, bias, q_norm, k_norm):
    """float64: (out [B, heads, D], the new keys [B, Hkv, D], the new values)."""
    B = qkv.shape[0]
    hkv, D = k_cache.shape[2], k_cache.shape[3]
    half, group = D // 2, heads // hkv
    outs, new_k, new_v = [], [], []
    for b in range(B):
        x = qkv[b].double()
        if bias is not None:
            x = x + bias.double()
        x = x.view(heads + 2 * hkv, D)
        q, k, v = x[:heads], x[heads:heads + hkv], x[heads + hkv:]
        if q_norm is not None:
            q = q / torch.sqrt((q * q).mean(-1, keepdim=True) + EPS) * q_norm.double()
            k = k / torch.sqrt((k * k).mean(-1, keepdim=True) + EPS) * k_norm.double()
        pos = int(seqlens[b]) - 1
        # the angle an fp32 product, as transformers (and the kernels) form it
        ang = (torch.tensor(float(pos)) * inv_freq.cpu()).double()
        c, s = torch.cos(ang), torch.sin(ang)

        def rot(t):
            lo, hi = t[:, :half], t[:, half:]
            return torch.cat([lo * c - hi * s, hi * c + lo * s], -1)
        q, k = rot(q), rot(k)
        if table is None:
            K, V = k_cache[b, :pos + 1].double().clone(), v_cache[b, :pos + 1].double().clone()
        else:
            ps = k_cache.shape[1]
            rows = [int(table[b, j // ps]) * ps + j % ps for j in range(pos + 1)]
            K = k_cache.reshape(-1, hkv, D)[rows].double().clone()
            V = v_cache.reshape(-1, hkv, D)[rows].double().clone()
        K[pos], V[pos] = k, v
        o = torch.stack([torch.softmax(K[:, h // group] @ q[h] / math.sqrt(D), 0) @ V[:, h // group]
                         for h in range(heads)])
        outs.append(o)
        new_k.append(k)
        new_v.append(v)
    return torch.stack(outs), torch.stack(new_k), torch.stack(new_v)


def _inputs(device, dtype, B, heads, hkv, D, lens, page, capacity, bias, norm, seed=0):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(dtype)  # noqa: E731
    width = (heads + 2 * hkv) * D
    qkv = rnd(B, width)
    b = rnd(width, scale=0.3) if bias else None
    qn = (torch.rand(D, generator=g) + 0.5).to(dtype) if norm else None
    kn = (torch.rand(D, generator=g) + 0.5).to(dtype) if norm else None
    if page is None:
        k, v = rnd(B, capacity, hkv, D), rnd(B, capacity, hkv, D)
        table = None
    else:
        per_seq = -(-capacity // page)
        pages = B * per_seq + 2
        k, v = rnd(pages, page, hkv, D), rnd(pages, page, hkv, D)
        table = torch.randperm(pages, generator=g)[:B * per_seq].view(B, per_seq).int()
    # NaN where the call must not read: past each sequence's end and the new token's slot
    for bi, n in enumerate(lens):
        for j in range(n - 1, capacity):
            if table is None:
                k[bi, j], v[bi, j] = float("nan"), float("nan")
            else:
                p = int(table[bi, j // page])
                k[p, j % page], v[p, j % page] = float("nan"), float("nan")
    seqlens = torch.tensor(lens, dtype=torch.int32)
    inv = rope_inv_freq(D, 10000.0, {"rope_type": "llama3", "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 16})
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return tuple(map(to, (qkv, k, v, seqlens, table, inv, b, qn, kn)))


# (B, heads, Hkv, lens, page or None, capacity, splits (0 = auto)): length 1 (only the
# new key), lengths not multiples of the interpreter's 16-key tile, the new key at a
# split's first and last position, GQA 7:1 and 4:1, pages of 4 and 16 (a page holding
# whole tiles), one split and several, splits left empty by a short sequence
CASES = {
    "contig-split1": (3, 8, 2, [5, 1, 17], None, 20, 1),
    "contig-split3": (3, 8, 2, [33, 1, 17], None, 40, 3),
    "paged4-split3-gqa7": (2, 14, 2, [23, 16], 4, 24, 3),
    "paged16-auto": (3, 4, 1, [49, 2, 32], 16, 64, 0),
    "paged4-split8-empty": (2, 4, 1, [40, 3], 4, 40, 8),
}


# fp32 with every epilogue, fp16 with two (each interpreted case costs CI time)
PARAMS = [pytest.param(c, e, torch.float32, id=f"{c}-{e}-fp32")
          for c in CASES for e in ("rope", "bias", "qk_norm", "bias_qk_norm")] + \
         [pytest.param(c, e, torch.float16, id=f"{c}-{e}-fp16")
          for c in CASES for e in ("rope", "bias_qk_norm")]


@pytest.mark.parametrize("case,epi,dtype", PARAMS)
def test_decode_qkv_matches_float64(kernel_device, case, epi, dtype):  # noqa: F811
    from wsattn.kernels import decode_triton
    B, heads, hkv, lens, page, cap, splits = CASES[case]
    D = 32 if kernel_device == "cpu" else 128
    qkv, k, v, seqlens, table, inv, bias, qn, kn = _inputs(
        kernel_device, dtype, B, heads, hkv, D, lens, page, cap, "bias" in epi, "norm" in epi)
    k0, v0 = k.clone(), v.clone()
    ref, ref_k, ref_v = reference(qkv.cpu(), k0.cpu(), v0.cpu(), seqlens.cpu(),
                                  None if table is None else table.cpu(), heads, inv, bias,
                                  qn, kn)
    out, lse = decode_triton.decode_qkv(qkv, k, v, seqlens, table, 1 / math.sqrt(D), splits,
                                        heads=heads, inv_freq=inv, bias=bias, q_norm=qn,
                                        k_norm=kn, qk_eps=EPS if qn is not None else None)
    assert out.shape == (B, heads, D) and lse.shape == (B, heads)
    assert not out.isnan().any() and not lse.isnan().any()
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    assert rel_err(out.cpu(), ref) <= tol
    # the new key and value at each sequence's last position; every other row untouched
    for b, n in enumerate(lens):
        pos = n - 1
        where = (b, pos) if table is None else (int(table[b, pos // page]), pos % page)
        assert rel_err(k[where].cpu(), ref_k[b]) <= tol and rel_err(v[where].cpu(), ref_v[b]) <= tol
        k[where], v[where] = k0[where], v0[where]
    assert torch.equal(k.isnan(), k0.isnan()) and torch.equal(v.isnan(), v0.isnan())
    assert torch.equal(torch.nan_to_num(k), torch.nan_to_num(k0))
    assert torch.equal(torch.nan_to_num(v), torch.nan_to_num(v0))


def _compile(**kw):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from wsattn.kernels import decode_triton
    s = decode_triton.compile_spec(90, qkv=True, **kw)
    src = ASTSource(s["fn"], s["signature"], s["constexprs"], s["attrs"])
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=s["options"])


@pytest.mark.parametrize("kw", [dict(head_dim=64, paged=True, page_size=16, bias=True),
                                dict(head_dim=128, paged=True, page_size=16, qk_norm=True,
                                     pdl=True),
                                dict(head_dim=128, group=8)],
                         ids=["d64-paged-bias", "d128-paged-qknorm-pdl", "d128-contig-gqa8"])
def test_sm90_qkv_build_compiles_without_spills(kw):
    from test_prefill_compile import _ptxas_usage
    k = _compile(**kw)
    regs, stores, loads = _ptxas_usage(k)
    assert stores == 0 and loads == 0, (regs, stores, loads)
    ptx = k.asm["ptx"]
    assert re.search(r"\bsin\.approx|\bcos\.approx|sin|cos", ptx)  # RoPE in the kernel
    if kw.get("pdl"):
        wait = ptx.index("griddepcontrol.wait")
        assert wait < ptx.index("ld.global")  # every load after the wait


def _valid():
    D, heads, hkv = 32, 4, 1
    qkv = torch.randn(2, (heads + 2 * hkv) * D)
    k = torch.randn(2, 8, hkv, D)
    return dict(qkv=qkv, k_cache=k, v_cache=k.clone(),
                seqlens=torch.tensor([3, 1], dtype=torch.int32), block_table=None,
                sm_scale=0.1, heads=heads, inv_freq=rope_inv_freq(D, 10000.0))


BAD = {
    "heads-zero": (ValueError, "heads must be a positive multiple", dict(heads=0)),
    "qkv-width": (ValueError, r"qkv must be \[B, \(heads \+ 2 \* Hkv\) \* D\]",
                  dict(qkv=torch.randn(2, 100))),
    "qkv-dtype": (TypeError, "share one dtype", dict(qkv=torch.randn(2, 192).half())),
    "seqlens-int64": (ValueError, "seqlens must be int32", dict(seqlens=torch.tensor([3, 1]))),
    "inv-freq-shape": (ValueError, "inv_freq must be float32", dict(inv_freq=torch.ones(8))),
    "bias-shape": (ValueError, "bias must be a contiguous", dict(bias=torch.ones(10))),
    "norm-without-eps": (ValueError, "go together", dict(q_norm=torch.ones(32),
                                                         k_norm=torch.ones(32))),
    "table-batch": (ValueError, "block_table must be int32",
                    dict(block_table=torch.zeros(3, 2, dtype=torch.int32))),
    "pdl-not-bool": (ValueError, "pdl must be True or False", dict(pdl="yes")),
}


@pytest.mark.parametrize("error,match,over", list(BAD.values()), ids=list(BAD))
def test_decode_qkv_bad_input_raises_before_any_kernel(monkeypatch, error, match, over):
    from wsattn.kernels import decode_triton

    def no_kernel(*a, **k):
        raise AssertionError("a kernel was launched for invalid input")
    monkeypatch.setattr(decode_triton, "_launch", no_kernel)
    args = {**_valid(), **over}
    with pytest.raises(error, match=match):
        decode_triton.decode_qkv(args.pop("qkv"), args.pop("k_cache"), args.pop("v_cache"),
                                 args.pop("seqlens"), args.pop("block_table"),
                                 args.pop("sm_scale"), 0, **args)


@pytest.mark.gpu
@pytest.mark.parametrize("epi", ["rope", "bias_qk_norm"])
def test_gpu_bf16_decode_qkv_matches_float64_and_reruns(epi):
    """bf16 on the GPU: within tolerance of float64; a rerun on a fresh copy of the cache,
    with PDL, bit-identical (output, LSE and the appended rows)."""
    from wsattn.kernels import decode_triton
    dt, dev, D, heads, hkv = torch.bfloat16, "cuda", 128, 32, 8
    lens, page, cap = [4096, 1, 777, 2048], 16, 4096
    inp = _inputs(dev, dt, 4, heads, hkv, D, lens, page, cap, "bias" in epi, "norm" in epi)
    qkv, k, v, seqlens, table, inv, bias, qn, kn = inp
    kw = dict(heads=heads, inv_freq=inv, bias=bias, q_norm=qn, k_norm=kn,
              qk_eps=EPS if qn is not None else None)
    ref, ref_k, ref_v = reference(qkv.cpu(), k.cpu(), v.cpu(), seqlens.cpu(), table.cpu(),
                                  heads, inv.cpu(), None if bias is None else bias.cpu(),
                                  None if qn is None else qn.cpu(),
                                  None if kn is None else kn.cpu())
    k1, v1, k2, v2 = k.clone(), v.clone(), k.clone(), v.clone()
    o1, l1 = decode_triton.decode_qkv(qkv, k1, v1, seqlens, table, D ** -0.5, 0, **kw)
    o2, l2 = decode_triton.decode_qkv(qkv, k2, v2, seqlens, table, D ** -0.5, 0, pdl=True, **kw)
    torch.cuda.synchronize()
    assert rel_err(o1.float().cpu(), ref) <= 2e-2
    # the appended row of each sequence (its last position), against float64
    page = k.shape[1]
    for b, n in enumerate(lens):
        p, r = int(table[b, (n - 1) // page]), (n - 1) % page
        assert rel_err(k1[p, r].float().cpu(), ref_k[b]) <= 1e-2
        assert rel_err(v1[p, r].float().cpu(), ref_v[b]) <= 1e-2
    # bits, not values: the poisoned rows past each sequence hold NaN (NaN != NaN)
    bits = lambda t: t.view(torch.int16)  # noqa: E731
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    assert torch.equal(bits(k1), bits(k2)) and torch.equal(bits(v1), bits(v2))


def test_ladder_entry_climbs_to_structure_with_interpreter_numerics():
    """The `decode_qkv` ladder entry: compiles for sm_90, forms its structure, and its
    interpreter numerics (fp16, fp32) pass against the float64 torch reference; its torch
    peer agrees with that reference."""
    from wsattn.evidence import ladder, library
    spec = library.get("decode_qkv")
    r = ladder.climb(spec, "sm_90", ladder.Config(interpreter_shapes=1))
    assert r.highest_gate == 2, r.verdict
    assert [g.status for g in r.gates] == ["pass", "pass", "pass", "not run"], r.verdict
    assert [g.status for g in r.extra if g.name == "numerics"] == ["pass"], r.extra
    import random
    run = spec.run
    inp = run.build(run.draw_shape(random.Random(1), True), "fp32", "cpu",
                    torch.Generator().manual_seed(1))
    assert rel_err(run.baseline(inp), run.reference(inp)) <= 1e-5
