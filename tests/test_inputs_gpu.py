"""The input classes of tests/test_inputs.py on the GPU, through the compiled kernels, and
the default decode / varlen calls proven free of host synchronisation."""

from __future__ import annotations

import pytest
import torch

import wsattn
from wsattn import reference
from wsattn.testing import rel_err, tol

pytestmark = pytest.mark.gpu

DT = torch.bfloat16


def _paged(lens, page, Hkv, D, spare=5, device="cuda"):
    pages_per = [-(-n // page) for n in lens]
    total = sum(pages_per) + spare
    perm = torch.randperm(total).to(torch.int32)
    bt = torch.zeros(len(lens), max(pages_per) + 2, dtype=torch.int32)
    at = 0
    for b, n in enumerate(pages_per):
        bt[b, :n] = perm[at:at + n]
        at += n
    kc = torch.randn(total, page, Hkv, D, dtype=DT, device=device)
    return kc, torch.randn_like(kc), bt.to(device)


@pytest.mark.parametrize("page", [16, 64])
def test_strided_index_tensors_gpu(page):
    """Index views with a stride (column of [B, 2], column-major block table) on CUDA."""
    lens = [1000, 7, 333, 64]
    kc, vc, bt = _paged(lens, page, 8, 128)
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    sl_wide = torch.stack([sl, sl * 5 + 1], dim=1)
    q = torch.randn(len(lens), 32, 128, dtype=DT, device="cuda")
    out = wsattn.decode(q, kc, vc, sl_wide[:, 0], bt.t().contiguous().t())
    ref, _ = reference.decode(q, kc, vc, sl, bt)
    assert rel_err(out, ref) <= tol(DT)
    # varlen
    lens_q = [100, 0, 513, 64]
    cu = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32,
                      device="cuda")
    wide = torch.stack([cu, cu + 11], dim=1)
    T = int(cu[-1])
    qv = torch.randn(T, 16, 128, dtype=DT, device="cuda")
    kv, vv = torch.randn(T, 4, 128, dtype=DT, device="cuda"), torch.randn(T, 4, 128, dtype=DT,
                                                                              device="cuda")
    out = wsattn.attention_varlen(qv, kv, vv, wide[:, 0], wide[:, 0], causal=True)
    ref, _ = reference.attention_varlen(qv, kv, vv, cu, cu, True)
    assert rel_err(out, ref) <= tol(DT)


def test_default_calls_do_not_synchronise():
    """decode and attention_varlen read index values on the host by default (a sync per
    layer): with torch's sync debug mode set to error, the default calls now pass and
    validate=True is what syncs."""
    lens = [300, 45]
    kc, vc, bt = _paged(lens, 16, 8, 128)
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(2, 32, 128, dtype=DT, device="cuda")
    T = 64
    cu = torch.tensor([0, 20, T], dtype=torch.int32, device="cuda")
    qv = torch.randn(T, 16, 128, dtype=DT, device="cuda")
    kv = torch.randn(T, 4, 128, dtype=DT, device="cuda")
    wsattn.decode(q, kc, vc, sl, bt)  # compile outside the checked region
    wsattn.attention_varlen(qv, kv, kv, cu, cu, causal=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = wsattn.decode(q, kc, vc, sl, bt)
        outv = wsattn.attention_varlen(qv, kv, kv, cu, cu, causal=True)
        with pytest.raises(RuntimeError):
            wsattn.decode(q, kc, vc, sl, bt, validate=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert rel_err(out, reference.decode(q, kc, vc, sl, bt)[0]) <= tol(DT)
    assert rel_err(outv, reference.attention_varlen(qv, kv, kv, cu, cu, True)[0]) <= tol(DT)


def test_merge_rules_gpu():
    inf, nan = float("inf"), float("nan")
    o = torch.randn(3, 6, 128, device="cuda", dtype=DT)
    s = torch.randn(3, 6, device="cuda")
    s[1, 0] = nan
    s[2, 1] = inf
    s[0, 2] = -inf
    o[0, 2] = nan
    s[:, 3] = -inf
    out, lse = wsattn.merge_states(o, s)
    ref_out, ref_lse = reference.merge_states(o, s)
    assert torch.equal(torch.isnan(lse.cpu()), torch.isnan(ref_lse.cpu()))
    assert torch.equal(torch.isnan(out.float().cpu()), torch.isnan(ref_out.cpu()))
    assert torch.isnan(lse[:2]).all() and torch.isfinite(lse[2]) and lse[3] == -inf
    ok = torch.isfinite(ref_lse)
    assert rel_err(out[ok], ref_out[ok]) <= tol(DT)


def test_degenerate_sizes_gpu():
    q = torch.randn(0, 128, 16, 128, dtype=DT, device="cuda")
    k = torch.randn(0, 128, 4, 128, dtype=DT, device="cuda")
    out, lse = wsattn.attention(q, k, k, causal=True, return_lse=True)
    assert out.shape == q.shape and lse.shape == (0, 16, 128)
    o, s = torch.randn(4, 33, 96, dtype=DT, device="cuda"), torch.randn(4, 33, device="cuda")
    assert rel_err(wsattn.merge_states(o, s)[0], reference.merge_states(o, s)[0]) <= tol(DT)
    kc = torch.randn(2, 300, 8, 128, dtype=DT, device="cuda")
    sl = torch.tensor([300, 5], dtype=torch.int32, device="cuda")
    qd = torch.randn(2, 32, 128, dtype=DT, device="cuda")
    out = wsattn.decode(qd, kc, kc, sl, num_splits=128)
    assert rel_err(out, reference.decode(qd, kc, kc, sl)[0]) <= tol(DT)
