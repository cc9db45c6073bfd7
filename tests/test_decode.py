"""Split-KV decode through ``wsattn.decode(impl="triton")`` against the float64 reference.

With no GPU the kernels run through the Triton interpreter. Triton 3.6 reads
TRITON_INTERPRET inside ``@triton.jit``, i.e. when a module is imported: for
triton.language's own jit helpers (tl.max, tl.sum, tl.zeros, tl.cdiv) at ``import triton``
and for our kernels at import of the kernel module; wsattn's dispatch reads it again at
call time. In a whole-suite run triton is usually imported long before these tests, so
the ``kernel_device`` fixture makes the tests independent of import order: it sets the
variable, imports fresh interpreter builds of merge.py and decode_triton.py (the
originals come back after the test), lets an already-compiled-mode Triton helper run
through the interpreter, and works around numpy >= 2.4 (see _patch_interpreter). With a
GPU the same tests run on CUDA instead.
"""

import dataclasses
import importlib
import sys

import pytest
import torch

import wsattn
import wsattn.ops
from wsattn import reference
from wsattn._triton_compat import patch_interpreter
from wsattn.target import Target

from conftest import assert_close, assert_lse_close

D = 64  # the interpreter's cost grows with D; D = 128 runs in the GPU tests
KERNEL_MODULES = ("wsattn.kernels.merge", "wsattn.kernels.decode_triton",
                  "wsattn.kernels.state_exchange")


def _patch_interpreter(monkeypatch):
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    patch_interpreter()

    # triton.language's helpers were built in compiled mode if triton was imported
    # without TRITON_INTERPRET; called from interpreted code they refuse to run, so run
    # their Python source through the interpreter, as an interpreting import would have.
    # (tl.max/tl.sum keep their identity, so the interpreter still reduces with numpy.)
    builds = {}

    def call_interpreted(self, *args, **kwargs):
        if self.fn not in builds:
            builds[self.fn] = interpreter.InterpretedFunction(self.fn)
        return builds[self.fn](*args, **kwargs)

    monkeypatch.setattr(JITFunction, "__call__", call_interpreted)


@pytest.fixture
def kernel_device(monkeypatch):
    """"cuda" where there is a GPU; else "cpu" with fresh interpreter builds of the kernels."""
    if torch.cuda.is_available():
        return "cuda"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _patch_interpreter(monkeypatch)
    package = importlib.import_module("wsattn.kernels")
    for name in KERNEL_MODULES:
        # setitem remembers the entry, or its absence, so teardown puts back the compiler
        # build (or drops the interpreter build): a later compile-only test in this worker
        # must not find interpreted kernels in sys.modules
        monkeypatch.setitem(sys.modules, name, None)
        del sys.modules[name]
        monkeypatch.delattr(package, name.rsplit(".", 1)[1], raising=False)
    for name in KERNEL_MODULES:  # merge first: decode_triton imports its helpers
        module = importlib.import_module(name)
        monkeypatch.setattr(package, name.rsplit(".", 1)[1], module, raising=False)
    return "cpu"


DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.float32, id="fp32")]


def _cache(B, T, Hq, Hkv, lens, page, capacity, dtype, device, seed):
    """Random q and a KV cache holding `lens`; paged (shuffled pages, spare pages) if page."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(dtype)
    q = rnd(B, T, Hq, D)
    if page is None:
        k, v = rnd(B, capacity, Hkv, D), rnd(B, capacity, Hkv, D)
        table = None
    else:
        per_seq = -(-capacity // page)
        num_pages = B * per_seq + 3
        k, v = rnd(num_pages, page, Hkv, D), rnd(num_pages, page, Hkv, D)
        table = torch.randperm(num_pages, generator=g)[: B * per_seq].reshape(B, per_seq).int()
        table = table.to(device)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    return q.to(device), k.to(device), v.to(device), seqlens, table


# (B, T, Hq, Hkv, seqlens, page size or None, capacity, num_splits or None = auto).
# Lengths not multiples of the interpreter's 16-key tile, length 1 (= T), GQA 4:1 and
# 8:1, pages of 16 and 7 (neither divides the lengths) and 1, splits that are empty for
# the short sequences.
CASES = {
    "B3-T1-H8-HKV2-L70-contig-split1": (3, 1, 8, 2, [70, 1, 33], None, 70, 1),
    "B3-T1-H4-HKV1-L70-contig-split3": (3, 1, 4, 1, [70, 1, 33], None, 70, 3),
    "B2-T3-H8-HKV1-L50-contig-split3": (2, 3, 8, 1, [50, 3], None, 50, 3),
    "B2-T1-H4-HKV1-L40-contig-split8-empty": (2, 1, 4, 1, [40, 5], None, 40, 8),
    "B2-T1-H4-HKV1-L300-contig-auto": (2, 1, 4, 1, [300, 17], None, 300, None),
    "B3-T1-H4-HKV1-page16-auto": (3, 1, 4, 1, [70, 1, 17], 16, 80, None),
    "B3-T3-H8-HKV1-page7-split3": (3, 3, 8, 1, [45, 3, 20], 7, 49, 3),
    "B2-T1-H8-HKV2-page7-split1": (2, 1, 8, 2, [33, 1], 7, 35, 1),
    # pages of 2 tiles: the one-page-per-tile load path (PAGE_SIZE % BLOCK_N == 0)
    "B2-T1-H4-HKV1-page32-split2": (2, 1, 4, 1, [70, 33], 32, 96, 2),
    "B2-T3-H4-HKV1-page1-split2": (2, 3, 4, 1, [19, 4], 1, 20, 2),
    # many splits: one combine tile of 64 with 24 rows past the splits, and two tiles
    # (64 + 36)
    "B2-T1-H4-HKV1-L700-contig-split40": (2, 1, 4, 1, [700, 37], None, 700, 40),
    "B1-T1-H4-HKV1-page16-split100": (1, 1, 4, 1, [1700], 16, 1792, 100),
}
# fp16 everywhere; fp32 on a few shapes (each interpreted case costs ~1 s of CI time)
FP32_CASES = ("B3-T1-H4-HKV1-L70-contig-split3", "B3-T3-H8-HKV1-page7-split3",
              "B2-T1-H4-HKV1-L300-contig-auto")
PARAMS = [pytest.param(case, torch.float16, id=f"{name}-fp16") for name, case in CASES.items()] + \
         [pytest.param(CASES[name], torch.float32, id=f"{name}-fp32") for name in FP32_CASES]


@pytest.mark.parametrize("case,dtype", PARAMS)
def test_decode_matches_reference(kernel_device, case, dtype):
    B, T, Hq, Hkv, lens, page, capacity, splits = case
    q, k, v, seqlens, table = _cache(B, T, Hq, Hkv, lens, page, capacity, dtype, kernel_device,
                                     seed=sum(lens) + 7 * T)
    out, lse = wsattn.decode(q, k, v, seqlens, table, num_splits=splits, return_lse=True,
                             impl="triton")
    ref, ref_lse = reference.decode(q, k, v, seqlens, table)
    assert out.shape == (B, T, Hq, D) and out.dtype == dtype
    assert lse.shape == (B, T, Hq) and lse.dtype == torch.float32
    assert_close(out, ref, dtype)
    assert_lse_close(lse, ref_lse, dtype)


def test_decode_single_token_shape(kernel_device):
    """q [B, Hq, D] (one token) gives out [B, Hq, D] and lse [B, Hq]."""
    q, k, v, seqlens, _ = _cache(2, 1, 4, 1, [9, 30], None, 30, torch.float16, kernel_device, 3)
    out, lse = wsattn.decode(q[:, 0], k, v, seqlens, num_splits=2, return_lse=True, impl="triton")
    ref, ref_lse = reference.decode(q[:, 0], k, v, seqlens)
    assert out.shape == (2, 4, D) and lse.shape == (2, 4)
    assert_close(out, ref, torch.float16)
    assert_lse_close(lse, ref_lse, torch.float16)


def test_decode_settings_override(kernel_device):
    """An explicit DecodeSettings (other tile, 4 splits) gives the same answer."""
    from wsattn.kernels import decode_triton

    q, k, v, seqlens, _ = _cache(2, 2, 8, 2, [45, 2], None, 45, torch.float32, kernel_device, 5)
    settings = decode_triton.DecodeSettings(BLOCK_N=32, num_warps=4, num_stages=1, num_splits=4)
    out, lse = decode_triton.decode(q, k, v, seqlens, None, D ** -0.5, 0, settings=settings)
    ref, ref_lse = reference.decode(q, k, v, seqlens)
    assert_close(out, ref, torch.float32)
    assert_lse_close(lse, ref_lse, torch.float32)


@pytest.mark.parametrize("page, splits", [(7, 1), (7, 3), (1, 2), (5, 4)],
                         ids=["page7-split1", "page7-split3", "page1-split2", "page5-split4"])
def test_decode_block_table_preload(kernel_device, page, splits):
    """bt_preload (each split's block-table entries read once before the loop) gives the
    reference's answer and the same bits as the per-tile table reads."""
    from wsattn.kernels import decode_triton

    q, k, v, seqlens, table = _cache(3, 2, 8, 2, [70, 2, 33], page, 75, torch.float16,
                                     kernel_device, 11)
    base = decode_triton.DecodeSettings(BLOCK_N=16, num_warps=4, num_stages=1,
                                        num_splits=splits)
    pre = dataclasses.replace(base, bt_preload=True)
    assert decode_triton.bt_chunk(pre, table.shape[1] * page, page) > 0  # the switch applies
    out, lse = decode_triton.decode(q, k, v, seqlens, table, D ** -0.5, 0, settings=pre)
    ref, ref_lse = reference.decode(q, k, v, seqlens, table)
    assert_close(out, ref, torch.float16)
    assert_lse_close(lse, ref_lse, torch.float16)
    out0, lse0 = decode_triton.decode(q, k, v, seqlens, table, D ** -0.5, 0, settings=base)
    assert torch.equal(out, out0) and torch.equal(lse, lse0)


def test_bt_chunk_covers_a_split_and_stays_small():
    from wsattn.kernels.decode_triton import BT_PRELOAD_MAX, DecodeSettings, bt_chunk

    s = DecodeSettings(BLOCK_N=64, num_warps=8, num_stages=4, num_splits=64, bt_preload=True)
    # B=1 L=131072 page 16: 32 tiles of 64 keys a split = 128 pages, +1 for a straddle
    assert bt_chunk(s, 131072, 16) == 256
    assert bt_chunk(dataclasses.replace(s, bt_preload=False), 131072, 16) == 0
    assert bt_chunk(s, 131072, 64) == 0  # whole-tile pages read one entry per tile already
    assert bt_chunk(dataclasses.replace(s, num_splits=1), 8192, 16) == 0  # 513 > the cap
    assert bt_chunk(dataclasses.replace(s, num_splits=32), 131072, 16) == 0
    assert bt_chunk(s, 131072, 7) == 0  # 2048 keys / 7 + 1 = 294 entries -> 512 > the cap
    assert bt_chunk(s, 65536, 7) == 256 <= BT_PRELOAD_MAX  # 1024 keys: 148 entries


def test_default_settings_preload_the_table_where_it_fits_on_sm90():
    """sm_90, pages shorter than a tile: the block table is preloaded (4 stages) where a
    split's entries fit BT_PRELOAD_MAX (B=1, 64 splits), not where they do not (B=64, one
    split of 513 entries: 7 stages as before); whole-tile pages and other targets keep the
    per-tile reads."""
    from wsattn.kernels.decode_triton import bt_chunk, default_settings

    def settings(cc, batch, capacity, page):
        return default_settings(Target("cuda", cc, 132), batch=batch, kv_heads=8, head_dim=128,
                                capacity=capacity, dtype=torch.bfloat16, paged=True,
                                page_size=page)
    long = settings(90, 1, 131072, 16)
    assert long.bt_preload and long.num_stages == 4 and bt_chunk(long, 131072, 16) == 256
    wide = settings(90, 64, 8192, 16)
    assert not wide.bt_preload and wide.num_stages == 7
    assert not settings(90, 1, 131072, 64).bt_preload  # one table entry per tile already
    assert not settings(100, 1, 131072, 16).bt_preload  # measured on sm_90 only


@pytest.mark.parametrize("splits", [3, 40, 100])
def test_combine_edge_states_as_merge_states(kernel_device, splits):
    """The combine's block merge (merge_parts) against merge_states' one-part steps
    (merge_step) on the same partial states: empty parts (lse -inf, NaN in their output)
    contribute nothing, an all-empty row gives (0, -inf), a NaN or +inf lse makes its row
    NaN; one tile (3, 40 splits) and two (100)."""
    from wsattn.kernels import decode_triton, merge
    rows, D = 6, 64
    g = torch.Generator().manual_seed(splits)
    o = torch.randn(rows, splits, D, generator=g)
    lse = torch.randn(rows, splits, generator=g) * 4
    empty = torch.rand(rows, splits, generator=g) < 0.3
    empty[1] = True  # an all-empty row
    lse[empty] = float("-inf")
    o[empty] = float("nan")
    lse[2, splits // 2] = float("nan")
    lse[3, splits - 1] = float("inf")
    ws_o, ws_lse = o.to(kernel_device), lse.to(kernel_device)
    out = torch.full((rows, D), 7.0, device=kernel_device)
    out_lse = torch.full((rows,), 7.0, device=kernel_device)
    decode_triton._combine_kernel[(rows, D // 32)](
        ws_o, ws_lse, out, out_lse, D=D, NUM_SPLITS=splits, BLOCK_D=32,
        BLOCK_S=decode_triton.combine_block_s(splits), num_warps=1)
    want, want_lse = merge.merge_states(ws_o.transpose(0, 1).contiguous(),
                                        ws_lse.t().contiguous())
    out, out_lse, want, want_lse = (t.cpu() for t in (out, out_lse, want, want_lse))
    assert torch.equal(out[1], torch.zeros(D)) and out_lse[1] == float("-inf")
    for r in (2, 3):
        assert out[r].isnan().all() and out_lse[r].isnan(), r
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out_lse.isnan(), want_lse.isnan())
    ok = [0, 4, 5]
    torch.testing.assert_close(out[ok], want[ok], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_lse[ok], want_lse[ok], rtol=1e-6, atol=1e-5)


def test_sm90_combine_build_does_not_grow_with_the_splits():
    """The combine merges its splits a [BLOCK_S, BLOCK_D] tile at a time (merge_parts), so
    its build is the same size at any split count: two loads (lse, o) in one loop, no
    unrolled chain (unrolled, 64 splits built in ~12 s and 128 in ~90 s on one CPU
    core), no spills."""
    import triton
    from test_prefill_compile import _ptxas_usage
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from wsattn.kernels import decode_triton

    def build(splits):
        st = decode_triton.DecodeSettings(BLOCK_N=64, num_warps=4, num_stages=4,
                                          num_splits=splits)
        s = decode_triton.compile_spec(90, head_dim=64, settings=st, kernel="combine")
        return triton.compile(ASTSource(s["fn"], s["signature"], constexprs=s["constexprs"],
                                        attrs=s["attrs"]),
                              target=GPUTarget("cuda", 90, 32), options=s["options"])

    sizes = {}
    for splits in (2, 17, 33, 64, 128):
        k = build(splits)
        ttir, ptx = k.asm["ttir"], k.asm["ptx"]
        assert ttir.count("tt.load") == 2, splits
        assert _ptxas_usage(k)[1:] == (0, 0), splits  # no spill stores or loads
        sizes[splits] = len(ptx.splitlines())
    assert decode_triton.combine_block_s(128) == decode_triton.COMBINE_BLOCK_S == 64
    assert decode_triton.combine_block_s(17) == 32 and decode_triton.combine_block_s(1) == 1
    # the tile grows with the splits up to COMBINE_BLOCK_S, the build no further
    assert sizes[128] < 1.1 * sizes[64] and sizes[64] < 2.5 * sizes[2], sizes


def test_sm90_bt_preload_pipelines_like_the_contiguous_cache():
    """With the block table read before the loop, the K/V loads no longer wait on a load of
    the same iteration: at 4 stages the pipeliner keeps 3 K/V buffers (per-tile reads: 1)
    and no block-table buffer, in the same shared memory as the contiguous build."""
    import re
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from wsattn.kernels import decode_triton

    def build(paged, preload):
        s = decode_triton.compile_spec(90, paged=paged)
        st = decode_triton.DecodeSettings(BLOCK_N=64, num_warps=s["options"]["num_warps"],
                                          num_stages=4, num_splits=s["constexprs"]["NUM_SPLITS"],
                                          bt_preload=preload)
        s = decode_triton.compile_spec(90, paged=paged, settings=st)
        k = triton.compile(ASTSource(s["fn"], s["signature"], constexprs=s["constexprs"],
                                     attrs=s["attrs"]),
                           target=GPUTarget("cuda", 90, 32), options=s["options"])
        allocs = re.findall(r"ttg\.local_alloc.*?!ttg\.memdesc<([0-9x]+)x(bf16|i32)", k.asm["ttgir"])
        return allocs, k.metadata.shared

    per_tile, _ = build(True, False)
    preload, smem = build(True, True)
    _, contiguous_smem = build(False, False)
    assert ("1x64x128", "bf16") in per_tile and any(t == "i32" for _, t in per_tile)
    assert preload.count(("3x64x128", "bf16")) == 2 and not any(t == "i32" for _, t in preload)
    assert smem == contiguous_smem


def test_auto_splits_fill_the_gpu_without_reading_seqlens():
    """Auto splits: B=1 Hkv=8 L=128k fills 132 SMs with one wave of resident programs;
    B=64 L=8k does not split."""
    from wsattn.kernels.decode_triton import RESIDENT_PER_SM, auto_splits, default_settings

    h200 = Target("cuda", 90, 132)
    long = default_settings(h200, batch=1, kv_heads=8, head_dim=128, capacity=131072,
                            dtype=torch.bfloat16)
    # one wave of resident programs: the rule's floor division by the 8 programs a split
    # leaves fewer than 8 of the 264 slots empty (33 splits here fill all 264)
    assert 1 * 8 * long.num_splits >= RESIDENT_PER_SM * 132 - 8
    assert 131072 / long.num_splits >= 8 * long.BLOCK_N  # each split streams >= 8 tiles
    wide = default_settings(h200, batch=64, kv_heads=8, head_dim=128, capacity=8192,
                            dtype=torch.bfloat16)
    assert wide.num_splits == 1
    # two waves of whole sequences on sm_90: 64-key tiles at D64 too (128 while split)
    wide64 = default_settings(h200, batch=64, kv_heads=8, head_dim=64, capacity=1024,
                              dtype=torch.bfloat16)
    assert (wide64.BLOCK_N, wide64.num_splits) == (64, 1)
    assert default_settings(h200, batch=8, kv_heads=8, head_dim=64, capacity=4096,
                            dtype=torch.bfloat16).BLOCK_N == 128
    assert default_settings(Target("cuda", 100, 148), batch=64, kv_heads=8, head_dim=64,
                            capacity=1024, dtype=torch.bfloat16).BLOCK_N == 128
    assert auto_splits(8, 8, 65536, 64, 132) > 1
    # few programs (B * Hkv <= SMs / 4): about one program per SM, down to one tile a
    # split (latency-bound launches), never more splits than tiles
    assert auto_splits(1, 8, 256, 64, 132) == 4
    assert auto_splits(1, 8, 1024, 128, 132) == 8
    assert auto_splits(1, 8, 4096, 128, 132) == 16
    assert auto_splits(1, 8, 4096 + 64, 128, 132) == 17  # 2 tiles a split, not 3
    # at most one program an SM: 4 KV heads at B=1, ~4k keys take 33 splits of 2 tiles,
    # not 64-65 of one (whose combine cost more, notes/decode_triton.md)
    assert auto_splits(1, 4, 4096, 64, 132) == 33
    assert auto_splits(1, 4, 4096 + 64, 64, 132) == 33
    assert auto_splits(1, 4, 1024, 64, 132) == 16  # fewer tiles than SMs: one a split
    assert auto_splits(1, 2, 4096, 64, 132) == 64  # 66 SMs a head: one tile a split fits
    assert auto_splits(8, 8, 4096, 128, 132) == 4  # 64 programs: the wave rule as before
    # where B * Hkv programs fit one wave of resident programs (2 per SM), the splits do
    # too: B=8 Hkv=8 takes 4 splits (256 programs), not 8 (264 + 248); long B=1 32, not 64
    assert auto_splits(8, 8, 4096 + 64, 64, 132) == 4
    assert auto_splits(8, 8, 65536, 64, 132) == 4
    assert auto_splits(1, 8, 32768, 64, 132) == 32
    assert auto_splits(8, 4, 4096 + 64, 64, 132) == 8  # Qwen3-30B-A3B's 4 heads: 256
    slots = RESIDENT_PER_SM * 132
    for B in range(1, 33):
        total = B * 8 * auto_splits(B, 8, 65536, 64, 132)
        assert total <= slots or total == B * 8, B  # one wave, or no split at all
    assert default_settings(h200, batch=1, kv_heads=8, head_dim=128, capacity=8192,
                            dtype=torch.bfloat16, num_splits=5).num_splits == 5


# --------------------------------------------------------------------------- bad input

def _valid(device="cpu"):
    q = torch.randn(2, 8, 64, dtype=torch.float16, device=device)
    k = torch.randn(2, 32, 2, 64, dtype=torch.float16, device=device)
    return q, k, k.clone(), torch.tensor([32, 5], dtype=torch.int32, device=device)


def _paged():
    k = torch.randn(6, 16, 2, 64, dtype=torch.float16)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    return k, table


BAD = {
    "q-rank-2": (ValueError, lambda q, k, v, s: (q[0], k, v, s, None)),
    "q-rank-5": (ValueError, lambda q, k, v, s: (q[:, None, None], k, v, s, None)),
    "cache-rank-3": (ValueError, lambda q, k, v, s: (q, k[0], v[0], s, None)),
    "Hq-not-multiple-of-Hkv": (ValueError, lambda q, k, v, s: (q[:, :7], k, v, s, None)),
    "seqlens-over-capacity": (ValueError, lambda q, k, v, s: (q, k, v, s + 1, None)),
    "seqlens-below-T": (ValueError, lambda q, k, v, s: (q, k, v, s * 0, None)),
    "seqlens-int64": (TypeError, lambda q, k, v, s: (q, k, v, s.long(), None)),
    "seqlens-wrong-batch": (ValueError, lambda q, k, v, s: (q, k, v, s[:1], None)),
    "k-v-shapes-differ": (ValueError, lambda q, k, v, s: (q, k, v[:, :16], s, None)),
    "block-table-page-out-of-range": (ValueError, lambda q, k, v, s: (q, _paged()[0], _paged()[0], s,
                                                                      _paged()[1] + 4)),
    "block-table-int64": (TypeError, lambda q, k, v, s: (q, _paged()[0], _paged()[0], s,
                                                         _paged()[1].long())),
    "block-table-too-short": (ValueError, lambda q, k, v, s: (q, _paged()[0], _paged()[0], s,
                                                              _paged()[1][:, :1])),
}


@pytest.mark.parametrize("error,make", list(BAD.values()), ids=list(BAD))
def test_decode_bad_input_raises_before_any_kernel(monkeypatch, error, make):
    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel was launched for invalid input")

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # so that impl="triton" accepts CPU tensors
    monkeypatch.setattr(wsattn.ops, "decode", no_kernel)
    with pytest.raises(error):
        wsattn.decode(*make(*_valid()), impl="triton")


def test_decode_bad_num_splits_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(wsattn.ops, "decode", None)
    with pytest.raises(ValueError, match="num_splits"):
        wsattn.decode(*_valid(), num_splits=0, impl="triton")


# --------------------------------------------------------------------------- compile-only

_COMPILE_SCRIPT = r"""
import json, re, triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from wsattn.kernels import decode_triton, merge
specs = {"contiguous": decode_triton.compile_spec(90), "paged": decode_triton.compile_spec(90, paged=True),
         "combine": decode_triton.compile_spec(90, kernel="combine"), "merge": merge.compile_spec(90)}
facts = {}
for name, s in specs.items():
    k = triton.compile(ASTSource(s["fn"], s["signature"], constexprs=s["constexprs"], attrs=s["attrs"]),
                       target=GPUTarget("cuda", 90, 32), options=s["options"])
    ptx = k.asm["ptx"]
    facts[name] = {"cp_async_16": len(re.findall(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10", ptx)),
                   "ld_b16": len(re.findall(r"ld\.global(\.\w+)*\.b16", ptx)),
                   "ld_v4": len(re.findall(r"ld\.global(\.\w+)*\.v4", ptx)),
                   "mma": len(re.findall(r"mma\.sync", ptx)), "shared": k.metadata.shared}
print(json.dumps(facts))
"""


def test_compile_spec_sm90_streams_with_16_byte_async_copies():
    """compile_spec marks pointers/strides 16-divisible as a launch does; without that the
    sm_90 build fell back to 2-byte loads and no pipelining (the bug this pins)."""
    import json
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a compiler build
    done = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("contiguous", "paged"):
        assert facts[name]["cp_async_16"] > 0 and facts[name]["ld_b16"] == 0, facts[name]
        assert facts[name]["mma"] > 0, facts[name]
        assert facts[name]["shared"] <= 227 * 1024 // 2, f"{name}: two programs no longer fit an SM"
    assert facts["merge"]["ld_v4"] > 0, facts["merge"]


def test_empty_batch(kernel_device):
    """B=0 returned empty outputs (was a ZeroDivisionError in the automatic split count)."""
    q = torch.randn(0, 4, D, dtype=torch.float16, device=kernel_device)
    kc = torch.randn(0, 8, 2, D, dtype=torch.float16, device=kernel_device)
    seqlens = torch.zeros(0, dtype=torch.int32, device=kernel_device)
    out, lse = wsattn.decode(q, kc, kc, seqlens, return_lse=True, impl="triton")
    assert out.shape == (0, 4, D) and lse.shape == (0, 4)


# --------------------------------------------------------------------------- PDL


_PDL_SCRIPT = r"""
import json, re, triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from wsattn.kernels import decode_triton
BUILDS = {"contiguous": {}, "paged-16": dict(paged=True, page_size=16),
          "paged-64": dict(paged=True, page_size=64), "combine": dict(kernel="combine")}
LOAD = re.compile(r"\b(ld\.global|cp\.async|ld\.volatile|ld\.relaxed|ld\.acquire)")
facts = {}
for name, kw in BUILDS.items():
    for pdl in (True, False):
        s = decode_triton.compile_spec(90, pdl=pdl, **kw)
        k = triton.compile(ASTSource(s["fn"], s["signature"], constexprs=s["constexprs"],
                                     attrs=s["attrs"]),
                           target=GPUTarget("cuda", 90, 32), options=s["options"])
        ptx = k.asm["ptx"]
        find = lambda text: ptx.index(text) if text in ptx else -1
        facts[f"{name}-{'on' if pdl else 'off'}"] = {
            "griddepcontrol": ptx.count("griddepcontrol"),
            "wait": ptx.count("griddepcontrol.wait"), "wait_at": find("griddepcontrol.wait"),
            "launch": ptx.count("griddepcontrol.launch_dependents"),
            "launch_at": find("griddepcontrol.launch_dependents"),
            "first_load_at": min((m.start() for m in LOAD.finditer(ptx)), default=-1),
            "launch_pdl": bool(k.metadata.launch_pdl)}
print(json.dumps(facts))
"""


def test_sm90_pdl_waits_before_any_load_and_releases_dependents():
    """PDL on: griddepcontrol.wait comes before the first global load (q, seqlens, the
    block table, K/V; the combine's workspace), launch_dependents right after it, and the
    kernel is marked for a PDL launch; contiguous, paged (pages shorter than a tile and
    of whole tiles) and the combine. Off: neither instruction, no PDL launch."""
    import json
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a compiler build
    done = subprocess.run([sys.executable, "-c", _PDL_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(facts) == 8
    for name, f in facts.items():
        if name.endswith("-on"):
            assert f["wait"] == 1 and f["launch"] == 1 and f["launch_pdl"], (name, f)
            assert 0 <= f["wait_at"] < f["first_load_at"], f"{name}: a load before the wait"
            assert f["wait_at"] < f["launch_at"], (name, f)
        else:
            assert f["griddepcontrol"] == 0 and not f["launch_pdl"], (name, f)
            assert f["first_load_at"] >= 0, (name, f)


def test_compile_spec_pdl_off_is_the_default_build():
    """pdl=False adds no PDL constexpr and no launch option: the default build (and its
    SASS) is the one the library had before the switch existed."""
    from wsattn.kernels import decode_triton
    for kw in ({}, dict(paged=True), dict(kernel="combine")):
        s = decode_triton.compile_spec(90, **kw)
        assert "PDL" not in s["constexprs"] and "launch_pdl" not in s["options"]
        assert s == decode_triton.compile_spec(90, pdl=False, **kw)


def test_decode_pdl_refused_off_sm90_before_any_kernel(kernel_device, monkeypatch):
    """pdl=True needs griddepcontrol (CUDA sm_90+): refused by name elsewhere (the
    interpreter here), before a launch; a non-bool refused too."""
    from wsattn.kernels import decode_triton
    from wsattn.target import UnsupportedTargetError
    if kernel_device == "cuda" and torch.cuda.get_device_capability()[0] >= 9:
        pytest.skip("this GPU takes PDL (test_decode_gpu.py covers it)")
    q, k, v, seqlens, _ = _cache(2, 1, 4, 1, [20, 5], None, 20, torch.float16, kernel_device, 0)

    def no_kernel(*a, **kw):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(decode_triton._decode_kernel, "run", no_kernel)
    with pytest.raises(UnsupportedTargetError, match="pdl=True needs CUDA sm_90"):
        decode_triton.decode(q, k, v, seqlens, None, 0.125, 2, pdl=True)
    with pytest.raises(UnsupportedTargetError, match="pdl=True needs CUDA sm_90"):
        wsattn.ops.decode(q, k, v, seqlens, None, 0.125, 2, pdl=True)
    with pytest.raises(ValueError, match="pdl must be True or False"):
        decode_triton.decode(q, k, v, seqlens, None, 0.125, 2, pdl=None)


@pytest.mark.parametrize("page", [None, 7])
def test_decode_pdl_off_equals_the_default_call(kernel_device, page):
    """pdl=False through the launcher and through ops.decode is bit for bit the call
    without the argument (split and unsplit)."""
    from wsattn.kernels import decode_triton
    q, k, v, seqlens, table = _cache(2, 1, 8, 2, [40, 9], page, 42, torch.float16,
                                     kernel_device, 4)
    for splits in (1, 3):
        base = decode_triton.decode(q, k, v, seqlens, table, 0.125, splits)
        for got in (decode_triton.decode(q, k, v, seqlens, table, 0.125, splits, pdl=False),
                    wsattn.ops.decode(q, k, v, seqlens, table, 0.125, splits, pdl=False)):
            assert torch.equal(got[0], base[0]) and torch.equal(got[1], base[1])
        ref, ref_lse = reference.decode(q, k, v, seqlens, table, 0.125)
        assert_close(base[0], ref, torch.float16)


@pytest.mark.parametrize("module,kw", [
    ("decode_triton", dict(head_dim=64)), ("prefill_triton", dict(head_dim=64)),
    ("prefill_paged", dict(head_dim=64)), ("gemv", dict(M=8, N=256, K=256)),
    ("qkv_rope", dict(rows=8, fused=True))], ids=lambda v: v if isinstance(v, str) else "")
def test_sm90_fp32_dots_keep_fp32_accuracy(module, kw):
    """fp32 operands: every tl.dot of the library's Triton kernels asks for three TF32
    products (tf32x3, kernels/_precision.py), not Triton's default single TF32 product
    (a 10-bit mantissa: fp32 decode's LSE was off by up to 4e-4 relative on the H200);
    16-bit builds are unchanged by it (their operands ignore the precision)."""
    import importlib
    import re
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    mod = importlib.import_module(f"wsattn.kernels.{module}")

    def dots(dtype):
        s = mod.compile_spec(90, dtype=dtype, **kw)
        k = triton.compile(ASTSource(s["fn"], s["signature"], constexprs=s["constexprs"],
                                     attrs=s["attrs"]),
                           target=GPUTarget("cuda", 90, 32), options=s["options"])
        return re.findall(r"tt\.dot .*", k.asm["ttir"])

    fp32 = dots("fp32")
    assert fp32 and all("inputPrecision = tf32x3" in d for d in fp32), fp32
    assert dots("bf16")
