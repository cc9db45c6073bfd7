"""Chunked prefill against a paged KV cache: ``wsattn.attention_paged``.

On the CPU the Triton kernel runs through the interpreter (the kernel module rebuilds its
kernel as the kind a launch needs, so the ``interpret`` fixture can set TRITON_INTERPRET
whatever was imported before, as in test_prefill_triton.py). Every cache is laid out to
catch a wrong read: its pages are shuffled, the slots past each sequence's keys, the
spare pages and the pages unused block-table entries point to all hold NaN, and outputs
start as NaN (conftest). The GPU tests (``gpu`` marker) run the same shapes in bf16 and
fp16, rerun bit for bit and replay a CUDA graph.
"""

import numpy as np
import pytest
import torch
import triton

import wsattn
from wsattn import dispatch, reference
from wsattn._triton_compat import patch_interpreter
from wsattn.kernels import prefill_paged
from wsattn.kernels.prefill_paged import PagedPrefillSettings
from wsattn.target import Target, UnsupportedTargetError

from conftest import assert_close, assert_lse_close

F16, F32, BF16 = torch.float16, torch.float32, torch.bfloat16


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    patch_interpreter()


def _cu(lens, device="cpu"):
    return torch.tensor([0] + list(np.cumsum(lens)), dtype=torch.int32, device=device)


def paged_inputs(lq, lk, Hq, Hkv, D, page, dtype, device="cpu", seed=0):
    """q [sum(lq), Hq, D] and a paged cache holding lk[b] keys for sequence b, plus the
    same keys packed contiguously ([sum(lk), Hkv, D]) for attention_varlen.

    Pages are handed out in a shuffled order; block-table entries past a sequence's last
    page point to a NaN page, and the cache slots past lk[b] in its last page are NaN."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    B = len(lq)
    per_seq = [-(-n // page) for n in lk]
    width = max(per_seq + [0]) + 2  # spare entries past the longest sequence
    num_pages = sum(per_seq) + 3  # spare pages, never referenced by a used entry
    order = torch.randperm(num_pages, generator=g).tolist()
    nan_page = order[-1]
    k_cache = torch.full((num_pages, page, Hkv, D), float("nan"), dtype=dtype)
    v_cache = torch.full((num_pages, page, Hkv, D), float("nan"), dtype=dtype)
    table = torch.full((B, width), nan_page, dtype=torch.int32)
    k, v = rnd(sum(lk), Hkv, D), rnd(sum(lk), Hkv, D)
    start, nxt = 0, 0
    for b in range(B):
        for j in range(per_seq[b]):
            p = order[nxt]
            nxt += 1
            table[b, j] = p
            n = min(page, lk[b] - j * page)
            k_cache[p, :n] = k[start + j * page:start + j * page + n]
            v_cache[p, :n] = v[start + j * page:start + j * page + n]
        start += lk[b]
    q = rnd(sum(lq), Hq, D)
    dev = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
    q, k_cache, v_cache, table, k, v = dev(q, k_cache, v_cache, table, k, v)
    seqlens_k = torch.tensor(lk, dtype=torch.int32, device=device)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, cu_seqlens_q=_cu(lq, device),
                seqlens_k=seqlens_k, block_table=table, k=k, v=v, cu_seqlens_k=_cu(lk, device))


def _args(x):
    return (x["q"], x["k_cache"], x["v_cache"], x["cu_seqlens_q"], x["seqlens_k"],
            x["block_table"])


# (chunk lengths lq, keys lk (the chunk's own included), Hq, Hkv, D, page, causal): chunk
# lengths 1, 5, 17, 64, 65 and an empty chunk; key counts ending mid-page; GQA 7:1 and 4:1;
# a sequence with no key at all (not causal: its queries give 0 and -inf).
CASES = {
    "lq1_5_0_17_65-lk1_37_9_50_100-H7-HKV1-D64-page16-causal":
        ([1, 5, 0, 17, 65], [1, 37, 9, 50, 100], 7, 1, 64, 16, True),
    "lq64_5_17_3-lk64_70_130_0-H8-HKV2-D64-page64-full":
        ([64, 5, 17, 3], [64, 70, 130, 0], 8, 2, 64, 64, False),
    "lq17_1_65-lk40_63_65-H8-HKV2-D128-page16-causal":
        ([17, 1, 65], [40, 63, 65], 8, 2, 128, 16, True),
    "lq5_17-lk5_81-H4-HKV1-D128-page64-full":
        ([5, 17], [5, 81], 4, 1, 128, 64, False),
}
# each case in one interpreter dtype, the first in both (the interpreter's time grows with D)
INTERP = [pytest.param(c, F16, id=f"{n}-fp16") for n, c in CASES.items()] + \
         [pytest.param(CASES[n], F32, id=f"{n}-fp32") for n in list(CASES)[:2]]


def _check(out, lse, x, case, dtype, scale=None):
    lq, lk, Hq, Hkv, D, page, causal = case
    ref, ref_lse = reference.attention_paged(*_args(x), causal, scale)
    assert out.dtype == dtype and out.shape == (sum(lq), Hq, D)
    assert lse.dtype == torch.float32 and lse.shape == (Hq, sum(lq))
    assert_close(out, ref, dtype)
    assert_lse_close(lse, ref_lse, dtype)
    for b, (nq, nk) in enumerate(zip(lq, lk)):  # queries of a sequence without keys
        if nk == 0 and nq:
            rows = slice(sum(lq[:b]), sum(lq[:b + 1]))
            assert torch.equal(out[rows].float().cpu(), torch.zeros_like(out[rows].float().cpu()))
            assert torch.isneginf(lse[:, rows]).all()


# --------------------------------------------------------------------------- interpreter

@pytest.mark.parametrize("case,dtype", INTERP)
def test_interpreter_matches_float64(interpret, case, dtype):
    lq, lk, Hq, Hkv, D, page, causal = case
    x = paged_inputs(lq, lk, Hq, Hkv, D, page, dtype, seed=sum(lq) + sum(lk))
    out, lse = wsattn.attention_paged(*_args(x), causal=causal, return_lse=True, impl="triton")
    _check(out, lse, x, case, dtype)


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_reference_equals_varlen_reference_on_contiguous_keys(case):
    """The paged reference reads exactly the keys attention_varlen's reference gets packed."""
    lq, lk, Hq, Hkv, D, page, causal = case
    x = paged_inputs(lq, lk, Hq, Hkv, D, page, F32, seed=3)
    out, lse = reference.attention_paged(*_args(x), causal, 0.1)
    ref, ref_lse = reference.attention_varlen(x["q"], x["k"], x["v"], x["cu_seqlens_q"],
                                              x["cu_seqlens_k"], causal, 0.1)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_kernel_equals_varlen_kernel_on_contiguous_keys(interpret):
    """Same keys, laid out paged or packed: the two kernels agree within tolerance."""
    lq, lk = [1, 17, 65], [30, 17, 90]
    x = paged_inputs(lq, lk, 8, 2, 64, 16, F16, seed=5)
    out, lse = wsattn.attention_paged(*_args(x), causal=True, return_lse=True, impl="triton")
    ref, ref_lse = wsattn.attention_varlen(x["q"], x["k"], x["v"], x["cu_seqlens_q"],
                                           x["cu_seqlens_k"], causal=True, return_lse=True,
                                           impl="triton")
    assert_close(out, ref, F16)
    assert_lse_close(lse, ref_lse, F16)


def test_gather_packs_each_sequences_keys_and_zeroes_the_pad(interpret):
    """paged_gather.gather_kv: sequence b's keys at rows cu_seqlens_k[b].., exactly the
    packed keys attention_varlen takes (from shuffled pages whose unused slots, spare
    pages and spare table entries hold NaN), then PAD_ROWS zero rows; nothing else read."""
    from wsattn.kernels import paged_gather
    for case in CASES.values():
        lq, lk, Hq, Hkv, D, page, causal = case
        x = paged_inputs(lq, lk, Hq, Hkv, D, page, F16, seed=11)
        k, v, cu, max_k = paged_gather.gather_kv(x["k_cache"], x["v_cache"], x["seqlens_k"],
                                                 x["block_table"])
        total = sum(lk)
        B, width = x["block_table"].shape
        assert k.shape == (paged_gather.buffer_rows(B, width, page), Hkv, D) and v.shape == k.shape
        assert max_k == width * page and torch.equal(cu, x["cu_seqlens_k"])
        assert torch.equal(k[:total], x["k"]) and torch.equal(v[:total], x["v"])
        pad = slice(total, total + paged_gather.PAD_ROWS)
        assert not k[pad].any() and not v[pad].any()


def test_gather_writes_every_sequence_start_past_one_summing_chunk(interpret, monkeypatch):
    """gather_kv's cu_seqlens_k comes from the kernel alone (each program sums the key
    counts before its sequence, SEQ_CHUNK at a time; no prefix-sum launch): with more
    sequences than one chunk (the chunk made small here, so the interpreter stays quick),
    empty ones among them, and the buffer it returns handed out full of garbage, every
    entry is the running sum and every key lands at its row."""
    from wsattn.kernels import paged_gather
    monkeypatch.setattr(paged_gather, "SEQ_CHUNK", 16)
    real_empty = paged_gather.empty

    def garbage(shape, dtype, device):  # what an uninitialised allocation may hold
        t = real_empty(shape, dtype, device)
        return t.fill_(-7) if dtype == torch.int32 else t
    monkeypatch.setattr(paged_gather, "empty", garbage)
    g = torch.Generator().manual_seed(4)
    n_seq = paged_gather.SEQ_CHUNK * 2 + 5
    lk = torch.randint(0, 6, (n_seq,), generator=g).tolist()
    lk[0], lk[paged_gather.SEQ_CHUNK] = 0, 0
    x = paged_inputs([1] * n_seq, lk, 2, 1, 16, 4, F32, seed=12)
    k, v, cu, _ = paged_gather.gather_kv(x["k_cache"], x["v_cache"], x["seqlens_k"],
                                         x["block_table"])
    assert torch.equal(cu, x["cu_seqlens_k"])
    total = sum(lk)
    assert torch.equal(k[:total], x["k"]) and torch.equal(v[:total], x["v"])
    assert not k[total:total + paged_gather.PAD_ROWS].any()


@pytest.mark.parametrize("case,dtype", INTERP[:4])
def test_interpreter_gather_matches_float64_and_the_varlen_kernel(interpret, case, dtype):
    """gather=True: the gather, then the Triton varlen kernel on the packed keys; within
    tolerance of float64 and bit for bit attention_varlen on the same keys packed."""
    lq, lk, Hq, Hkv, D, page, causal = case
    x = paged_inputs(lq, lk, Hq, Hkv, D, page, dtype, seed=sum(lq) + sum(lk))
    out, lse = wsattn.attention_paged(*_args(x), causal=causal, return_lse=True, impl="triton",
                                      gather=True)
    _check(out, lse, x, case, dtype)
    ref, ref_lse = wsattn.attention_varlen(x["q"], x["k"], x["v"], x["cu_seqlens_q"],
                                           x["cu_seqlens_k"], causal=causal, return_lse=True,
                                           impl="triton")
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


# Both K/V load paths at pages of 16 (one page a tile at BLOCK_N 16, a gathered tile at 32),
# and a 64-key page holding two 32-key tiles under 32-row query tiles.
SETTINGS = [
    pytest.param(PagedPrefillSettings(16, 16, 4, 1), 16, id="M16-N16-page16-onepage"),
    pytest.param(PagedPrefillSettings(16, 64, 4, 1), 16, id="M16-N64-page16-gather"),
    pytest.param(PagedPrefillSettings(32, 32, 4, 1), 64, id="M32-N32-page64-onepage"),
    # the TMA switch: one descriptor load a tile, at a page of one tile and of two
    pytest.param(PagedPrefillSettings(16, 16, 4, 1, use_tma=True), 16, id="M16-N16-page16-tma"),
    pytest.param(PagedPrefillSettings(32, 32, 4, 1, use_tma=True), 64, id="M32-N32-page64-tma"),
]


@pytest.mark.parametrize("settings,page", SETTINGS)
def test_settings_variants_match_float64(interpret, settings, page):
    case = ([5, 40, 0, 33], [21, 40, 3, 77], 4, 1, 64, page, True)
    x = paged_inputs(*case[:6], F16, seed=11)
    out, lse = prefill_paged.prefill_paged(*_args(x), None, True, 0.125, settings=settings)
    _check(out, lse, x, case, F16, scale=0.125)


def test_tma_switch_refuses_what_it_cannot_read(interpret):
    """use_tma reads a tile as one page's rows through a descriptor: pages that do not
    hold whole tiles, or caches whose rows are not contiguous across pages, are refused
    by name before any launch."""
    case = ([5, 40], [21, 40], 4, 1, 64, 16, True)
    x = paged_inputs(*case[:6], F16, seed=11)
    with pytest.raises(ValueError, match="page_size 16 is not a multiple of BLOCK_N 32"):
        prefill_paged.prefill_paged(*_args(x), None, True, 0.125,
                                    settings=PagedPrefillSettings(16, 32, 4, 1, use_tma=True))
    args = list(_args(x))
    args[1] = args[2] = torch.cat([args[1], args[1]])[::2]  # every other page of a pool
    with pytest.raises(ValueError, match="rows contiguous across pages"):
        prefill_paged.prefill_paged(*args, None, True, 0.125,
                                    settings=PagedPrefillSettings(16, 16, 4, 1, use_tma=True))
    sm80 = prefill_paged.Target("cuda", 80, 108)
    assert "sm_90" in prefill_paged.tma_unsupported(
        sm80, x["k_cache"], x["v_cache"], PagedPrefillSettings(16, 16, 4, 1, use_tma=True))


def test_max_seqlen_q_and_strided_index_views_give_the_same_bits(interpret):
    """A grid bounded by max_seqlen_q, and index tensors given as strided views, change
    nothing: the same tiles run the same code."""
    lq, lk = [3, 33, 1], [20, 40, 70]
    x = paged_inputs(lq, lk, 4, 2, 64, 16, F16, seed=13)
    base = wsattn.attention_paged(*_args(x), causal=True, impl="triton")
    bounded = wsattn.attention_paged(*_args(x), max_seqlen_q=33, causal=True, impl="triton")
    wide = torch.zeros(x["block_table"].shape[0], x["block_table"].shape[1] * 2,
                       dtype=torch.int32)
    wide[:, ::2] = x["block_table"]  # every other column: stride 2 along the pages
    cu2 = torch.zeros(2 * len(x["cu_seqlens_q"]), dtype=torch.int32)
    cu2[::2] = x["cu_seqlens_q"]
    strided = wsattn.attention_paged(x["q"], x["k_cache"], x["v_cache"], cu2[::2],
                                     x["seqlens_k"], wide[:, ::2], causal=True, impl="triton")
    assert torch.equal(base, bounded) and torch.equal(base, strided)


def test_sm_scale_is_applied(interpret):
    case = ([5, 9], [16, 30], 2, 1, 64, 16, True)
    x = paged_inputs(*case[:6], F32, seed=17)
    out, lse = wsattn.attention_paged(*_args(x), causal=True, sm_scale=0.37, return_lse=True,
                                      impl="triton")
    _check(out, lse, x, case, F32, scale=0.37)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_empty_batch_and_empty_chunks(interpret, impl):
    """An empty batch, or chunks that are all empty, give empty outputs (no kernel)."""
    Hq, D = 4, 64
    kc = torch.randn(2, 16, 2, D, dtype=F16)
    for cu, lens, table in (
            (torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
             torch.zeros(0, 3, dtype=torch.int32)),
            (torch.zeros(3, dtype=torch.int32), torch.tensor([5, 0], dtype=torch.int32),
             torch.zeros(2, 1, dtype=torch.int32))):
        out, lse = wsattn.attention_paged(torch.zeros(0, Hq, D, dtype=F16), kc, kc, cu, lens,
                                          table, causal=True, return_lse=True, impl=impl)
        assert out.shape == (0, Hq, D) and lse.shape == (Hq, 0) and lse.dtype == torch.float32


def test_reference_impl_takes_any_head_dim():
    """The reference runs where the kernel does not (head dim 48)."""
    case = ([3, 4], [10, 4], 2, 2, 48, 4, True)
    x = paged_inputs(*case[:6], F32, seed=19)
    out = wsattn.attention_paged(*_args(x), causal=True, impl="reference")
    ref = reference.attention_varlen(x["q"], x["k"], x["v"], x["cu_seqlens_q"],
                                     x["cu_seqlens_k"], True)[0]
    assert_close(out, ref, F32)


# --------------------------------------------------------------------------- k_new / v_new

def _chunk_of(x, lq, lk):
    """(k_new, v_new): each sequence's last lq[b] keys, packed as q is; and a copy of the
    caches with those slots NaN (the prefix alone, as before the chunk's append)."""
    cu_k = x["cu_seqlens_k"].tolist()
    rows = torch.cat([torch.arange(cu_k[b] + lk[b] - lq[b], cu_k[b] + lk[b])
                      for b in range(len(lq))]).to(x["k"].device)
    k_new, v_new = x["k"][rows].contiguous(), x["v"][rows].contiguous()
    kc, vc = x["k_cache"].clone(), x["v_cache"].clone()
    reference.append_paged_kv(torch.full_like(k_new, float("nan")),
                              torch.full_like(v_new, float("nan")), kc, vc,
                              x["cu_seqlens_q"], x["seqlens_k"], x["block_table"])
    return k_new, v_new, kc, vc


def _same_bits(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


# chunks of 0, 1, 17, 33 and 65 rows over prefixes ending mid-page, GQA 7:1, page 16 / 64;
# 130 sequences, so the kernel's search for a row's sequence takes two passes
APPEND_CASES = {
    "lq1_5_0_17_65-page16": ([1, 5, 0, 17, 65], [1, 37, 9, 50, 100], 7, 1, 64, 16),
    "lq33_3-page64-D128": ([33, 3], [97, 3], 4, 2, 128, 64),
    "130-sequences": ([1, 0, 2] * 43 + [5], [3, 1, 2] * 43 + [70], 2, 1, 64, 16),
}


@pytest.mark.parametrize("dtype", [F16, BF16, F32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("case", list(APPEND_CASES.values()), ids=list(APPEND_CASES))
def test_append_kernel_writes_what_indexing_writes(interpret, case, dtype):
    """paged_append.append_kv: the chunk's rows land where the reference's indexing puts
    them, bit for bit in every cache dtype (a copy, no arithmetic), and every other slot of
    the caches (NaN or a prefix key) is as it was."""
    from wsattn.kernels import paged_append
    lq, lk, Hq, Hkv, D, page = case
    x = paged_inputs(lq, lk, Hq, Hkv, D, page, dtype, seed=43)
    k_new, v_new, kc, vc = _chunk_of(x, lq, lk)
    paged_append.append_kv(k_new, v_new, kc, vc, x["cu_seqlens_q"], x["seqlens_k"],
                           x["block_table"])
    _same_bits(kc, x["k_cache"])
    _same_bits(vc, x["v_cache"])


@pytest.mark.parametrize("impl, gather", [("triton", False), ("triton", True),
                                          ("reference", None)],
                         ids=["in_place", "gather", "reference"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_attention_paged_appends_the_chunk_then_attends(interpret, impl, gather, causal):
    """k_new / v_new: the call writes the chunk into the caller's caches first, then gives
    the bits of the same call over caches that already held it (prefix-only caches whose
    chunk slots are NaN, so an attention that read before the append would be NaN)."""
    lq, lk = [17, 0, 1, 65], [40, 5, 63, 65]
    x = paged_inputs(lq, lk, 8, 2, 64, 16, F16, seed=47)
    k_new, v_new, kc, vc = _chunk_of(x, lq, lk)
    kw = dict(causal=causal, return_lse=True, impl=impl, gather=gather)
    want, want_lse = wsattn.attention_paged(*_args(x), **kw)
    got, got_lse = wsattn.attention_paged(x["q"], kc, vc, x["cu_seqlens_q"], x["seqlens_k"],
                                          x["block_table"], k_new=k_new, v_new=v_new, **kw)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    _same_bits(kc, x["k_cache"])
    _same_bits(vc, x["v_cache"])


# --------------------------------------------------------------------------- validation

def _good():
    return paged_inputs([3, 5], [10, 5], 4, 2, 64, 4, F16, seed=23)


def _bad_cases():
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    cases = {}

    def case(name, exc, match, **changes):
        cases[name] = (exc, match, changes)

    case("q-2d", ValueError, r"q must be 3-D", q=lambda x: x["q"][0])
    case("q-not-tensor", TypeError, r"q must be a torch.Tensor", q=lambda x: x["q"].numpy())
    case("k_cache-3d", ValueError, r"k_cache must be 4-D paged",
         k_cache=lambda x: x["k_cache"][0])
    case("v_cache-dtype", TypeError, r"v_cache has dtype torch.float32",
         v_cache=lambda x: x["v_cache"].float())
    case("v_cache-shape", ValueError, r"k_cache and v_cache must have the same shape",
         v_cache=lambda x: x["v_cache"][:-1])
    case("k_cache-head-dim", ValueError, r"k_cache must be \[num_pages, page_size, Hkv, D=64\]",
         k_cache=lambda x: x["k_cache"][..., :32], v_cache=lambda x: x["v_cache"][..., :32])
    case("page-size-0", ValueError, r"page_size \(shape\[1\]\) >= 1",
         k_cache=lambda x: x["k_cache"][:, :0], v_cache=lambda x: x["v_cache"][:, :0])
    case("gqa", ValueError, r"query heads \(q: 4\) must be a positive multiple of the number "
         r"of KV heads \(k_cache: 3\)",
         k_cache=lambda x: torch.zeros(9, 4, 3, 64, dtype=F16),
         v_cache=lambda x: torch.zeros(9, 4, 3, 64, dtype=F16))
    case("q-last-dim", ValueError, r"q must have a contiguous last dimension",
         q=lambda x: x["q"].transpose(-1, -2).contiguous().transpose(-1, -2))
    case("k_cache-not-float", TypeError, r"k_cache must be a floating-point tensor",
         k_cache=lambda x: x["k_cache"].to(torch.int16))
    case("cu-int64", TypeError, r"cu_seqlens_q must be int32",
         cu_seqlens_q=lambda x: x["cu_seqlens_q"].long())
    case("cu-empty", ValueError, r"cu_seqlens_q must hold batch \+ 1 offsets",
         cu_seqlens_q=lambda x: i32())
    case("cu-last", ValueError, r"cu_seqlens_q\[-1\] must equal the number of packed tokens \(8\)",
         cu_seqlens_q=lambda x: i32(0, 3, 7))
    case("cu-decreasing", ValueError, r"cu_seqlens_q must be non-decreasing",
         cu_seqlens_q=lambda x: i32(0, 9, 8))
    case("seqlens_k-int64", TypeError, r"seqlens_k must be int32",
         seqlens_k=lambda x: x["seqlens_k"].long())
    case("seqlens_k-batch", ValueError, r"seqlens_k must be \[batch=2\]",
         seqlens_k=lambda x: i32(10, 5, 1))
    case("block_table-1d", ValueError, r"block_table must be a 2-D int32 tensor",
         block_table=lambda x: x["block_table"][0])
    case("block_table-batch", ValueError, r"block_table must be \[batch=2, max_pages\]",
         block_table=lambda x: x["block_table"][:1])
    case("block_table-width", ValueError, r"seqlens_k\[0\]=10 must lie in \[0, 8\] \(the block "
         r"table's capacity: block_table.shape\[1\]=2 pages of page_size=4\)",
         block_table=lambda x: x["block_table"][:, :2].contiguous())
    case("seqlens_k-negative", ValueError, r"seqlens_k\[1\]=-1 must lie in",
         seqlens_k=lambda x: i32(10, -1), causal=False)
    case("causal-short", ValueError, r"sequence 1 has seqlens_k 4 < q_len 5",
         seqlens_k=lambda x: i32(10, 4))
    case("page-out-of-range", ValueError, r"block_table\[0\] holds page 99, outside \[0, 8\) \(num_pages of k_cache\)",
         block_table=lambda x: x["block_table"].index_fill(1, torch.tensor([0]), 99))
    case("max_seqlen_q-short", ValueError, r"max_seqlen_q=4 is shorter than the longest query "
         r"sequence \(5\)", max_seqlen_q=4)
    case("max_seqlen_q-type", TypeError, r"max_seqlen_q must be a non-negative int",
         max_seqlen_q=2.5)
    case("causal-type", TypeError, r"causal must be a bool", causal=1)
    case("validate-type", TypeError, r"validate must be True, False or None", validate="yes")
    case("return_lse-type", TypeError, r"return_lse must be a bool", return_lse="no")
    case("sm_scale", ValueError, r"sm_scale must be a positive finite number", sm_scale=-1.0)
    case("impl", ValueError, r"impl must be one of", impl="cuda")
    # impl="gluon", gathered or in place: refused here for the device, as a varlen call is
    case("impl-gluon", ValueError, r"impl='gluon' runs on sm_90 \(Hopper\) only", impl="gluon")
    case("impl-gluon-in-place", ValueError, r"impl='gluon' runs on sm_90 \(Hopper\) only",
         impl="gluon", gather=False)
    case("gather-reference", ValueError, r"gather=True runs the packed-varlen kernels",
         impl="reference", gather=True)
    case("gather-type", TypeError, r"gather must be True, False or None", gather="yes")
    case("kernel-head-dim", ValueError, r"head dim .* one of \(64, 128, 256\) for impl='triton'",
         q=lambda x: x["q"][..., :48], k_cache=lambda x: x["k_cache"][..., :48].contiguous(),
         v_cache=lambda x: x["v_cache"][..., :48].contiguous())
    case("kernel-dtype", TypeError, r"q dtype must be one of float16, bfloat16, float32",
         q=lambda x: x["q"].double(), k_cache=lambda x: x["k_cache"].double(),
         v_cache=lambda x: x["v_cache"].double())
    new = lambda x, *shape: torch.zeros(*(shape or (8, 2, 64)), dtype=F16)  # noqa: E731
    case("k_new-alone", ValueError, r"k_new and v_new must be given together",
         k_new=lambda x: new(x))
    case("v_new-shape", ValueError, r"v_new must be \[Tq=8, Hkv=2, D=64\]",
         k_new=lambda x: new(x), v_new=lambda x: new(x, 8, 1, 64))
    case("k_new-2d", ValueError, r"k_new must be 3-D", k_new=lambda x: new(x, 8, 128),
         v_new=lambda x: new(x))
    case("k_new-dtype", TypeError, r"k_new has dtype torch.float32",
         k_new=lambda x: new(x).float(), v_new=lambda x: new(x))
    case("k_new-last-dim", ValueError, r"k_new must have a contiguous last dimension",
         k_new=lambda x: new(x, 8, 64, 2).transpose(1, 2), v_new=lambda x: new(x))
    case("append-short", ValueError, r"k_new / v_new append the chunk .* sequence 1 has "
         r"seqlens_k 4 < q_len 5", seqlens_k=lambda x: i32(10, 4), causal=False,
         k_new=lambda x: new(x), v_new=lambda x: new(x))
    # the append writes both caches: aliased caches, or two sequences' new rows mapped to
    # one cache row, would overwrite keys (shared prefix pages that are only read are fine)
    case("append-caches-aliased", ValueError, r"k_cache and v_cache must not overlap when "
         r"k_new / v_new append", v_cache=lambda x: x["k_cache"],
         k_new=lambda x: new(x), v_new=lambda x: new(x))
    case("append-rows-shared", ValueError, r"two sequences' appended rows land on the same "
         r"cache row", block_table=lambda x: x["block_table"][:1].expand(2, -1).contiguous(),
         seqlens_k=lambda x: i32(10, 10), validate=True,
         k_new=lambda x: new(x), v_new=lambda x: new(x))
    case("append-k_new-in-the-cache", ValueError, r"k_new must not overlap k_cache",
         k_new=lambda x: x["k_cache"].view(-1, 2, 64)[:8], v_new=lambda x: new(x))
    case("sm_scale-flushes-to-zero", ValueError, r"sm_scale must be a positive finite number "
         r"with sm_scale \* log2\(e\) in fp32's normal range", sm_scale=1e-40)
    case("sm_scale-overflows", ValueError, r"in fp32's normal range", sm_scale=1e39)
    case("q-heads-zero", ValueError, r"query heads \(q: 0\) must be a positive multiple",
         q=lambda x: x["q"][:, :0], k_new=lambda x: new(x), v_new=lambda x: new(x))
    return cases


BAD = _bad_cases()
POSITIONAL = ("q", "k_cache", "v_cache", "cu_seqlens_q", "seqlens_k", "block_table")


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_refused_by_name_before_any_kernel(interpret, monkeypatch, name):
    exc, match, changes = BAD[name]
    launched = []

    def launch(q, *args, **kw):
        launched.append(q)
        return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0])

    monkeypatch.setattr(prefill_paged, "prefill_paged", launch)
    x = _good()
    args = [changes[n](x) if n in changes else x[n] for n in POSITIONAL]
    kw = dict(causal=True, impl="triton")
    kw.update({k: v(x) if callable(v) else v for k, v in changes.items()
               if k not in POSITIONAL})
    before = args[1].clone(), args[2].clone()
    with pytest.raises(exc, match=match):
        wsattn.attention_paged(*args, **kw)
    if "return_lse" not in kw:  # the twin runs the same checks (it returns no LSE)
        with pytest.raises(exc, match=match):
            wsattn.api.check_attention_paged(*args, **kw)
    assert not launched
    # nothing appended either
    if args[1].shape == before[0].shape and args[1].dtype == before[0].dtype:
        _same_bits(args[1], before[0])
        _same_bits(args[2], before[1])
    wsattn.attention_paged(*_args(x), causal=True, impl="triton")  # the hook does catch a launch
    assert len(launched) == 1


def test_validate_false_reads_no_values():
    """validate=False leaves index values to the caller (what a default CUDA call does);
    validate=None on CPU tensors checks them."""
    x = _good()
    table = x["block_table"].index_fill(1, torch.tensor([0]), 99)
    args = (x["q"], x["k_cache"], x["v_cache"], x["cu_seqlens_q"], x["seqlens_k"], table)
    wsattn.api.check_attention_paged(*args, causal=True, impl="reference", validate=False)
    with pytest.raises(ValueError, match=r"block_table\[0\] holds page 99"):
        wsattn.api.check_attention_paged(*args, causal=True, impl="reference")


def test_dispatch_resolves_paged_prefill(monkeypatch):
    call = dispatch.Call("prefill_paged", torch.device("cpu"), F16, 64, True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert dispatch.resolve("auto", call) == "reference"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.resolve("auto", call) == "triton"
    assert "sm_90" in dispatch.reason("gluon", call)
    assert "attention_paged" in wsattn.__all__ and wsattn.attention_paged is wsattn.api.attention_paged
    # the gather policy: CUDA only, and only while the buffer fits the limit, at pages and
    # chunks the Gluon kernel does not read in place (the next test)
    monkeypatch.setattr(dispatch, "PAGED_GATHER_MAX_BYTES", 1 << 20)
    cuda = dispatch.Call("prefill_paged", torch.device("cuda"), F16, 64, True, seqlen_q=2048,
                         page_size=16, tma_pages=True)
    assert dispatch.paged_gather(cuda, 1 << 20) and not dispatch.paged_gather(cuda, (1 << 20) + 1)
    assert not dispatch.paged_gather(call, 0)


def test_dispatch_reads_large_pages_in_place_with_the_gluon_kernel(monkeypatch):
    """Where the Gluon kernel runs (faked: no sm_90 device here), gather=None reads pages
    of 64 rows or more (at D128 of 16 or more) in place with it, gathers smaller pages
    (impl="gluon" too), and
    gathers any page size the Gluon kernel cannot box or a cache TMA cannot read; "auto"
    gathers a chunk the varlen rule gives to Triton (none causal: short causal chunks
    take the Gluon kernel's one-consumer build, in place); gather=False ranks the Gluon
    in-place build first, with the reason named where it cannot take the call."""
    from wsattn.kernels import prefill_gluon
    monkeypatch.setattr(prefill_gluon, "device_supported", lambda device: True)
    dev = torch.device("cuda")

    def call(page, tma=True, dtype=torch.bfloat16, d=128, chunk=2048, causal=True, keys=4096):
        return dispatch.Call("prefill_paged", dev, dtype, d, causal, seqlen_q=chunk,
                             seqlen_k=keys, page_size=page, tma_pages=tma)
    assert dispatch.PAGED_IN_PLACE_FROM_PAGE == {64: 64, 128: 16}
    for impl in ("auto", "gluon"):
        assert not dispatch.paged_gather(call(64), 1, impl)
        assert not dispatch.paged_gather(call(256), 1, impl)
        # at D128 pages of 16 and 32 in place, pages of 8 gathered; at D64 from 64 rows
        assert not dispatch.paged_gather(call(16), 1, impl)
        assert not dispatch.paged_gather(call(32), 1, impl)
        assert dispatch.paged_gather(call(8), 1, impl)
        assert dispatch.paged_gather(call(16, d=64), 1, impl)
        assert dispatch.paged_gather(call(32, d=64), 1, impl)
        assert not dispatch.paged_gather(call(64, d=64), 1, impl)
        assert dispatch.paged_gather(call(64, tma=False), 1, impl)
        assert dispatch.paged_gather(call(48), 1, impl)  # 48 neither tiles nor is tiled by 128
    assert dispatch.paged_gather(call(64), 1, "triton")  # Triton's own rule: the gather
    # the varlen rule as a gathered call would take it: a causal chunk of any length (the
    # shortest on the one-consumer build) and a pack of short sequences in place; D64
    # without a mask up to the table's limit gathers for the Triton kernel
    for chunk in (1, 64, 65, 255):
        assert not dispatch.paged_gather(call(64, chunk=chunk), 1, "auto")
    assert not dispatch.paged_gather(call(64, chunk=64, keys=64), 1, "auto")
    short = dispatch.VARLEN_TRITON_FASTER_UP_TO[(64, False)]
    assert dispatch.paged_gather(call(64, d=64, causal=False, chunk=short), 1, "auto")
    assert not dispatch.paged_gather(call(64, d=64, causal=False, chunk=short + 1), 1, "auto")
    assert not dispatch.paged_gather(call(64, d=64, causal=False, chunk=short), 1, "gluon")
    # chunks of at most PAGED_IN_PLACE_CHUNK_UP_TO queries read pages of 16 in place too
    assert dispatch.PAGED_IN_PLACE_CHUNK_UP_TO == 1024
    for impl in ("auto", "gluon"):
        for d in (64, 128):
            assert not dispatch.paged_gather(call(16 if d == 64 else 8, d=d, chunk=1024), 1, impl)
            assert not dispatch.paged_gather(call(16 if d == 64 else 8, d=d, chunk=256), 1, impl)
        assert dispatch.paged_gather(call(16, d=64, chunk=1025), 1, impl)
        assert dispatch.paged_gather(call(8, chunk=1025), 1, impl)
        assert dispatch.paged_gather(call(16, chunk=256, tma=False), 1, impl)
    # ... where the varlen rule gives the chunk to Gluon: others gather for Triton
    for chunk in (1, 64, 255):
        assert not dispatch.paged_gather(call(16, d=64, chunk=chunk), 1, "auto")
    assert dispatch.paged_gather(call(16, d=64, causal=False, chunk=short), 1, "auto")
    assert not dispatch.paged_gather(call(16, d=64, causal=False, chunk=short), 1, "gluon")
    assert not dispatch.paged_gather(call(16, d=64), 1 << 40, "auto")  # too large: in place
    assert dispatch.paged_gather(call(16, d=64), 1 << 40, "gluon")  # the only other Gluon route
    assert dispatch.resolve("auto", call(16)) == "gluon"  # in place, page 16 boxes
    assert dispatch.resolve("auto", call(64, dtype=torch.float32)) == "triton"
    assert dispatch.resolve("auto", call(48)) == "triton"
    assert "page_size 48" in dispatch.reason("gluon", call(48))
    assert "16-byte aligned" in dispatch.reason("gluon", call(64, tma=False))
    assert dispatch.reason("gluon", call(8)) is None


def test_auto_gathers_only_where_the_policy_says(interpret, monkeypatch):
    """gather=None asks dispatch.paged_gather with the buffer's bytes (batch x table width
    x page_size rows of K and V at Hkv x D), and runs the path it names."""
    from wsattn.kernels import paged_gather
    x = _good()
    asked, ran = [], []
    monkeypatch.setattr(dispatch, "paged_gather",
                        lambda call, nbytes, impl: asked.append(nbytes) or True)
    real = paged_gather.gather_kv
    monkeypatch.setattr(paged_gather, "gather_kv", lambda *a: ran.append(1) or real(*a))
    out = wsattn.attention_paged(*_args(x), causal=True, impl="triton")
    B, width = x["block_table"].shape
    rows = B * width * x["k_cache"].shape[1] + paged_gather.PAD_ROWS
    assert asked == [2 * rows * 2 * 64 * 2] and ran == [1]
    ref = reference.attention_paged(*_args(x), True)[0]
    assert_close(out, ref, F16)
    monkeypatch.setattr(dispatch, "paged_gather", lambda call, nbytes, impl: False)
    wsattn.attention_paged(*_args(x), causal=True, impl="triton")
    assert ran == [1]  # in place: no gather


# --------------------------------------------------------------------------- settings, compile

def test_default_settings_per_target():
    h200 = Target("cuda", 90, 132)
    assert prefill_paged.default_settings(h200, 128, BF16) == PagedPrefillSettings(128, 64, 8, 3)
    assert prefill_paged.default_settings(h200, 64, F16) == PagedPrefillSettings(128, 64, 8, 3)
    assert prefill_paged.default_settings(h200, 128, F32).BLOCK_N == 32
    assert prefill_paged.default_settings(Target("cuda", 80, 108), 128, F16).BLOCK_N == 32
    assert prefill_paged.default_settings(Target("interpreter", 0), 64, F16).BLOCK_M == 16
    with pytest.raises(UnsupportedTargetError, match="sm_75"):
        prefill_paged.default_settings(Target("cuda", 75, 40), 128, F16)


def test_grid_bound_covers_every_tile():
    """The launch's tile count bound is never below the real count, for any split of Tq."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        B, bm = int(rng.integers(1, 9)), int(rng.choice([16, 64, 128]))
        lens = rng.integers(0, 300, B)
        tiles = int(sum(-(-int(n) // bm) for n in lens))
        cu = _cu(lens.tolist())
        assert prefill_paged._tile_offsets(cu, bm).tolist()[-1] == tiles
        assert prefill_paged.num_tiles_bound(int(lens.sum()), B, bm, None) >= tiles
        assert prefill_paged.num_tiles_bound(int(lens.sum()), B, bm, int(lens.max())) >= tiles


def _compile(head_dim, page):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    spec = prefill_paged.compile_spec(90, head_dim, "bf16", causal=True, page_size=page)
    src = ASTSource(spec["fn"], spec["signature"], spec["constexprs"], spec["attrs"])
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=spec["options"]), spec


@pytest.mark.parametrize("page", [16, 64], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"D{d}")
def test_sm90_default_build_does_not_spill(head_dim, page, record_property):
    from test_prefill_compile import SMEM_LIMIT, _ptxas_usage
    kernel, spec = _compile(head_dim, page)
    regs, stores, loads = _ptxas_usage(kernel)
    row = (f"sm90 D{head_dim} page{page} bf16 causal {spec['settings']}: {regs} registers, "
           f"spills {stores}/{loads}, shared {kernel.metadata.shared}")
    print(row)
    record_property(f"sm90-D{head_dim}-page{page}.registers", regs)
    record_property(f"sm90-D{head_dim}-page{page}.spill_bytes", stores + loads)
    assert stores + loads == 0, row
    assert kernel.metadata.shared <= SMEM_LIMIT[90], row
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx, row
    assert "cp.async.bulk.tensor" not in ptx, "pointer loads only (no TMA)"


@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"D{d}")
def test_sm90_tma_build_loads_by_tma_without_spills(head_dim):
    """The use_tma switch at pages of 64 on sm_90: K/V tiles by TMA, no spills."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from test_prefill_compile import SMEM_LIMIT, _ptxas_usage
    base = prefill_paged.default_settings(prefill_paged.Target("cuda", 90, 132), head_dim, BF16)
    settings = PagedPrefillSettings(base.BLOCK_M, base.BLOCK_N, base.num_warps,
                                    base.num_stages, use_tma=True)
    spec = prefill_paged.compile_spec(90, head_dim, "bf16", causal=True, page_size=64,
                                      settings=settings)
    src = ASTSource(spec["fn"], spec["signature"], spec["constexprs"], spec["attrs"])
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=spec["options"])
    regs, stores, loads = _ptxas_usage(kernel)
    ptx = kernel.asm["ptx"]
    assert "cp.async.bulk.tensor" in ptx and stores + loads == 0, (regs, stores, loads)
    assert kernel.metadata.shared <= SMEM_LIMIT[90]


@pytest.mark.parametrize("module", ["paged_gather", "paged_append"])
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"D{d}")
def test_sm90_copy_builds_copy_16_bytes_a_load_without_spills(module, head_dim):
    """The gather and append kernels on sm_90: no spills, 16-byte loads and stores."""
    import importlib

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from test_prefill_compile import _ptxas_usage
    spec = importlib.import_module(f"wsattn.kernels.{module}").compile_spec(
        90, head_dim, "bf16", page_size=16)
    src = ASTSource(spec["fn"], spec["signature"], spec["constexprs"], spec["attrs"])
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=spec["options"])
    regs, stores, loads = _ptxas_usage(kernel)
    ptx = kernel.asm["ptx"]
    assert stores + loads == 0, (regs, stores, loads)
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx, "16-byte copies"


# --------------------------------------------------------------------------- GPU

GPU_CASES = [pytest.param(c, id=n) for n, c in CASES.items()] + [
    pytest.param(([1, 300, 17, 0, 129], [4000, 300, 1000, 5, 129], 32, 8, 128, 16, True),
                 id="long-lq1_300_17_0_129-H32-HKV8-D128-page16-causal"),
    pytest.param(([128, 64], [1000, 64], 16, 16, 64, 64, True),
                 id="lq128_64-H16-HKV16-D64-page64-causal"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", GPU_CASES)
@pytest.mark.parametrize("impl, gather", [("triton", False), ("auto", False), ("auto", None)],
                         ids=["triton-in_place", "in_place", "auto"])
def test_gpu_matches_float64_and_reruns_bitwise(case, dtype, impl, gather):
    """The Triton in-place kernel, the in-place default (the Gluon paged build on sm_90)
    and the default (the dispatch's rule: in place from PAGED_IN_PLACE_FROM_PAGE rows a page
    for the head dim, or for chunks of at most 1024 queries, else the gather)."""
    lq, lk, Hq, Hkv, D, page, causal = case
    x = paged_inputs(lq, lk, Hq, Hkv, D, page, dtype, device="cuda", seed=29)
    out, lse = wsattn.attention_paged(*_args(x), causal=causal, return_lse=True, gather=gather,
                                      impl=impl)
    _check(out, lse, x, case, dtype)
    again, lse2 = wsattn.attention_paged(*_args(x), causal=causal, return_lse=True,
                                         gather=gather, impl=impl)
    assert torch.equal(out, again) and torch.equal(lse, lse2)
    ref = wsattn.attention_varlen(x["q"], x["k"], x["v"], x["cu_seqlens_q"], x["cu_seqlens_k"],
                                  causal=causal)
    assert_close(out, ref, dtype, what="paged vs varlen kernel")


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"D{d}")
def test_gpu_tma_switch_matches_float64_and_reruns_bitwise(head_dim):
    """The use_tma switch on sm_90 (pages of 64, NaN in the pages' unused rows): numerics
    against float64 and bit-identical reruns, before any benchmark of it counts."""
    if torch.cuda.get_device_capability()[0] < 9:
        # the switch is refused below sm_90 (tested on the CPU): nothing to run there
        pytest.skip("use_tma needs sm_90 or later")
    case = ([1, 300, 17, 0, 129], [4000, 300, 1000, 5, 129], 32, 8, head_dim, 64, True)
    x = paged_inputs(*case[:6], BF16, device="cuda", seed=37)
    base = prefill_paged.default_settings(prefill_paged.target_of(x["q"].device), head_dim, BF16)
    settings = PagedPrefillSettings(base.BLOCK_M, base.BLOCK_N, base.num_warps,
                                    base.num_stages, use_tma=True)
    out, lse = prefill_paged.prefill_paged(*_args(x), None, True, head_dim ** -0.5,
                                           settings=settings)
    _check(out, lse, x, case, BF16, scale=head_dim ** -0.5)
    again, lse2 = prefill_paged.prefill_paged(*_args(x), None, True, head_dim ** -0.5,
                                              settings=settings)
    assert torch.equal(out, again) and torch.equal(lse, lse2)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "gluon"])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_gather_matches_float64_and_the_varlen_kernel_bitwise(case, dtype, impl):
    """gather=True on the GPU: within tolerance of float64, bit-identical reruns, and bit
    for bit attention_varlen (same backend) on the same keys laid out packed, given the
    bounds the gathered call has (all query rows; the block table's width in keys), from
    which the Gluon launcher picks its build."""
    lq, lk, Hq, Hkv, D, page, causal = case
    why = dispatch.reason(impl, dispatch.Call("prefill_varlen", torch.device("cuda"), dtype, D,
                                              causal))
    if why is not None:  # the Gluon kernel: sm_90 only, D 64 / 128
        pytest.skip(why)
    x = paged_inputs(lq, lk, Hq, Hkv, D, page, dtype, device="cuda", seed=41)
    kw = dict(causal=causal, return_lse=True, impl=impl, gather=True)
    out, lse = wsattn.attention_paged(*_args(x), **kw)
    _check(out, lse, x, case, dtype)
    again, lse2 = wsattn.attention_paged(*_args(x), **kw)
    assert torch.equal(out, again) and torch.equal(lse, lse2)
    cap = x["block_table"].shape[1] * page
    ref, ref_lse = wsattn.attention_varlen(x["q"], x["k"], x["v"], x["cu_seqlens_q"],
                                           x["cu_seqlens_k"], max_seqlen_q=x["q"].shape[0],
                                           max_seqlen_k=cap, causal=causal, return_lse=True,
                                           impl=impl)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", [pytest.param(c, id=n) for n, c in APPEND_CASES.items()] + [
    pytest.param(([1, 300, 17, 0, 129], [4000, 300, 1000, 5, 129], 32, 8, 128, 16),
                 id="long-H32-HKV8-D128-page16")])
def test_gpu_append_equals_indexing_and_the_call_over_appended_caches(case, dtype):
    """On the GPU: the append kernel writes the reference's bits and nothing else; a
    default call with k_new / v_new (the dispatch's route) gives the bits of the same call
    over caches that held the chunk already; a rerun gives the same bits."""
    from wsattn.kernels import paged_append
    lq, lk, Hq, Hkv, D, page = case
    x = paged_inputs(lq, lk, Hq, Hkv, D, page, dtype, device="cuda", seed=53)
    k_new, v_new, kc0, vc0 = _chunk_of(x, lq, lk)
    kc, vc = kc0.clone(), vc0.clone()
    paged_append.append_kv(k_new, v_new, kc, vc, x["cu_seqlens_q"], x["seqlens_k"],
                           x["block_table"])
    _same_bits(kc, x["k_cache"])
    _same_bits(vc, x["v_cache"])
    want = wsattn.attention_paged(*_args(x), causal=True, return_lse=True)
    for _ in range(2):  # each from the prefix-only caches
        kc, vc = kc0.clone(), vc0.clone()
        got = wsattn.attention_paged(x["q"], kc, vc, x["cu_seqlens_q"], x["seqlens_k"],
                                     x["block_table"], causal=True, return_lse=True,
                                     k_new=k_new, v_new=v_new)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        _same_bits(kc, x["k_cache"])


@pytest.mark.gpu
@pytest.mark.parametrize("gather", [False, True, None], ids=["in_place", "gather", "auto"])
def test_gpu_cuda_graph_replay_equals_eager(gather):
    """A default call (validate=None) reads no index value on the host, in place or through
    gathered keys, so it captures; replays with new q values and new key counts equal
    eager calls bit for bit."""
    lq, lk = [17, 1, 64], [100, 33, 64]
    x = paged_inputs(lq, lk, 16, 2, 128, 16, BF16, device="cuda", seed=31)
    args = _args(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (compile) outside the capture
        wsattn.attention_paged(*args, causal=True, gather=gather)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = wsattn.attention_paged(*args, causal=True, gather=gather)
    for seed in range(2):
        x["q"].copy_(torch.randn_like(x["q"], dtype=torch.float32).to(BF16))
        if seed:  # fewer keys for the second sequence: read on the device, not the host
            x["seqlens_k"][1] = 20
        graph.replay()
        torch.cuda.synchronize()
        eager = wsattn.attention_paged(*args, causal=True, gather=gather)
        assert torch.equal(static_out, eager)
        ref = reference.attention_paged(*args, True)[0]
        assert_close(static_out, ref, BF16)


# --------------------------------------------------------------------------- the ladder

@pytest.mark.parametrize("name", ["prefill_paged", "prefill_paged_append"])
def test_ladder_entry_compiles_everywhere_and_its_interpreter_numerics_pass(name):
    """`prefill_paged` (and `prefill_paged_append`, whose chunk slots start NaN until the
    call appends them) on the evidence ladder: compiles for every known target, gates 0-2
    on sm_90 on the CPU, interpreter numerics on small shapes (shuffled NaN-guarded
    pages); the GPU gates wait for a device."""
    from wsattn.evidence import ladder, library
    from wsattn.evidence.compile_gate import compile_kernel
    from wsattn.target import KNOWN_CCS
    spec = library.get(name)
    assert name in library.NAMES and not spec.unavailable, spec.unavailable
    assert spec.run.baseline is not None and len(spec.run.sanitizer_shapes) == 2
    for cc in KNOWN_CCS.values():
        cs = spec.compile_spec(cc)
        r = compile_kernel(cs["fn"], cs["signature"], dict(cs["constexprs"]),
                           dict(cs["options"]), cc, cs.get("attrs"))
        assert r.ok, f"sm_{cc}: {r.failed_stage}: {r.error}"
    r = ladder.climb(spec, "sm_90", ladder.Config(interpreter_shapes=2))
    assert r.highest_gate == 2, r.verdict
    (interp,) = r.extra
    assert interp.status == "pass", interp.detail
    assert "interpreter numerics pass (2 small shapes)" in r.verdict


def test_ladder_baseline_is_the_same_attention_over_contiguous_keys(monkeypatch):
    """The profile gate's baseline (varlen over the same keys laid out contiguously)
    computes what the paged kernel computes, so the ratio it reports compares like with
    like: both within tolerance of the float64 reference (interpreter, fp16)."""
    import random

    from wsattn.evidence import library
    from wsattn.testing import rel_err, tol
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run = library.get("prefill_paged").run
    shape = run.draw_shape(random.Random(3), True)
    inp = run.build(shape, "fp16", "cpu", torch.Generator().manual_seed(0))
    ref_out, _ = run.reference(inp)
    paged_out, _ = run.run(inp)
    contig = run.baseline(inp)
    assert rel_err(paged_out, ref_out) <= tol(torch.float16)
    assert rel_err(contig, ref_out) <= tol(torch.float16)


def test_appended_rows_shared_only_when_two_new_rows_meet():
    """Sequences may share prefix pages they only read; only the rows the append writes
    (each sequence's last q_len positions) must map to distinct (page, slot)s."""
    from wsattn.api import _appended_rows_shared

    i32 = lambda *rows: torch.tensor(rows, dtype=torch.int32)  # noqa: E731
    lens, page = i32(12, 12), 4
    shared_prefix = i32([0, 1, 2], [0, 1, 3])
    assert not bool(_appended_rows_shared(shared_prefix, lens, i32(3, 3), page))
    assert not bool(_appended_rows_shared(shared_prefix, lens, i32(5, 3), page))
    assert bool(_appended_rows_shared(shared_prefix, lens, i32(6, 6), page))  # page 1, slots 2-3
    assert bool(_appended_rows_shared(i32([0, 1, 2], [0, 1, 2]), lens, i32(1, 1), page))
    assert not bool(_appended_rows_shared(i32([0, 1, 2]), i32(12), i32(12), page))
