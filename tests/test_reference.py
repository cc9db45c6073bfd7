"""The reference against itself: independent formulations must agree."""

import math

import pytest
import torch

from wsattn import reference


def _naive(q, k, v, causal, scale):
    """Dense softmax with an explicit mask matrix, one head at a time."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    out = torch.zeros_like(q)
    for b in range(B):
        for h in range(Hq):
            s = q[b, :, h] @ k[b, :, h // (Hq // Hkv)].T * scale
            if causal:
                i = torch.arange(Sq)[:, None] + Sk - Sq
                s = s.masked_fill(torch.arange(Sk)[None] > i, -math.inf)
            out[b, :, h] = torch.softmax(s, -1) @ v[b, :, h // (Hq // Hkv)]
    return out


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("Sq,Sk", [(1, 1), (17, 17), (5, 33)], ids=lambda x: str(x))
def test_attention_matches_naive(causal, Sq, Sk):
    g = torch.Generator().manual_seed(Sq * 100 + Sk)
    q = torch.randn(2, Sq, 4, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, Sk, 2, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, Sk, 2, 16, generator=g, dtype=torch.float64)
    out, lse = reference.attention(q, k, v, causal, 0.3)
    assert torch.allclose(out, _naive(q, k, v, causal, 0.3), atol=1e-12)
    assert lse.shape == (2, 4, Sq)


def test_merge_of_split_equals_whole():
    """Attention over keys split in three, merged by LSE, equals attention over all keys."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 7, 4, 32, generator=g, dtype=torch.float64)
    k = torch.randn(1, 30, 4, 32, generator=g, dtype=torch.float64)
    v = torch.randn(1, 30, 4, 32, generator=g, dtype=torch.float64)
    whole, whole_lse = reference.attention(q, k, v)
    parts = [reference.attention(q, k[:, a:b], v[:, a:b]) for a, b in ((0, 9), (9, 10), (10, 30))]
    out, lse = reference.merge_states(torch.stack([p[0] for p in parts]),
                                      torch.stack([p[1].transpose(1, 2) for p in parts]))
    assert torch.allclose(out, whole, atol=1e-12)
    assert torch.allclose(lse, whole_lse.transpose(1, 2), atol=1e-12)


def test_merge_empty_parts_no_nan():
    """An empty part (lse=-inf) contributes nothing; all-empty gives (0, -inf), no NaN."""
    o = torch.randn(3, 2, 8, dtype=torch.float64)
    s = torch.tensor([[1.0, -math.inf], [-math.inf, -math.inf], [0.5, -math.inf]], dtype=torch.float64)
    out, lse = reference.merge_states(o, s)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert lse[1] == -math.inf and torch.all(out[1] == 0)
    w = torch.softmax(torch.tensor([1.0, 0.5], dtype=torch.float64), 0)
    assert torch.allclose(out[0], w[0] * o[0, 0] + w[1] * o[2, 0])


def test_decode_paged_equals_contiguous():
    g = torch.Generator().manual_seed(1)
    B, L, Hkv, D, page = 3, 40, 2, 16, 16
    k = torch.randn(B, L, Hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, L, Hkv, D, generator=g, dtype=torch.float64)
    q = torch.randn(B, 2, 8, D, generator=g, dtype=torch.float64)
    seqlens = torch.tensor([40, 17, 2], dtype=torch.int32)
    n_pages = 3
    perm = torch.randperm(B * n_pages, generator=g)
    block_table = perm.view(B, n_pages).to(torch.int32)
    kp = torch.zeros(B * n_pages, page, Hkv, D, dtype=torch.float64)
    vp = torch.zeros_like(kp)
    padded_k = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, n_pages * page - L))
    padded_v = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, n_pages * page - L))
    kp[block_table.long()] = padded_k.view(B, n_pages, page, Hkv, D)
    vp[block_table.long()] = padded_v.view(B, n_pages, page, Hkv, D)
    a = reference.decode(q, k, v, seqlens)
    b = reference.decode(q, kp, vp, seqlens, block_table)
    assert torch.allclose(a[0], b[0]) and torch.allclose(a[1], b[1])
    # token t of sequence 1 sees keys 0..seqlen-T+t: compare to prefill over the prefix
    pre, _ = reference.attention(q[1:2], k[1:2, :17], v[1:2, :17], causal=True)
    assert torch.allclose(a[0][1], pre[0])


def test_bits_report_names_what_differs():
    """wsattn.testing.bits_report: empty for the same bits, NaN-poisoned slots included
    (torch.equal calls those unequal); otherwise the count, the largest difference and
    where, down to the last dimension's indices."""
    from wsattn.testing import bits_report
    a = torch.full((2, 3, 8), float("nan"), dtype=torch.bfloat16)
    a[0, 1] = torch.arange(8, dtype=torch.bfloat16)
    b = a.clone()
    assert bits_report(a, b) == "" and not torch.equal(a, b)
    b[0, 1, 5] += 0.5
    b[1, 2, 7] = 1.0  # a NaN slot written
    r = bits_report(a, b)
    assert r.startswith("2 of 48 elements differ, max |difference| 0.5")
    assert "[[0, 1, 5], [1, 2, 7]]" in r and "last-dimension indices [5, 7]" in r
    assert bits_report(a, b[:1]).startswith("shape / dtype (2, 3, 8)")
    assert bits_report(torch.tensor([1, 2]), torch.tensor([1, 3])).startswith("1 of 2")
    z = torch.zeros(4)
    assert bits_report(z, -z).startswith("4 of 4 elements differ, max |difference| 0")  # -0.0
