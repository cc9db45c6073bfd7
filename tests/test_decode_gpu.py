"""Split-KV decode on a GPU: realistic sizes in bf16/fp16, paged against contiguous,
bit-identical reruns, CUDA-graph replay. (Speed is measured by `wsattn bench`, not here.)

Skipped with a reason on machines without a GPU (conftest).
"""

import pytest
import torch

import wsattn
from wsattn import reference

from conftest import assert_close, assert_lse_close

pytestmark = pytest.mark.gpu

DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


def _inputs(B, T, Hq, Hkv, D, L, dtype, lens=None, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, T, Hq, D, device="cuda", generator=g, dtype=dtype)
    k = torch.randn(B, L, Hkv, D, device="cuda", generator=g, dtype=dtype)
    v = torch.randn(B, L, Hkv, D, device="cuda", generator=g, dtype=dtype)
    if lens is None:  # mixed lengths, one full, one of exactly T
        lens = torch.randint(T, L + 1, (B,), device="cuda", generator=g)
        lens[0] = L
        lens[-1] = T if B > 1 else L
    seqlens = torch.as_tensor(lens, device="cuda").to(torch.int32)
    return q, k, v, seqlens


def _to_paged(cache, page, seed=0):
    """The same keys as a paged cache: shuffled pages, a few spare ones, any page size."""
    B, L, Hkv, D = cache.shape
    per_seq = -(-L // page)
    padded = torch.zeros(B, per_seq * page, Hkv, D, dtype=cache.dtype, device=cache.device)
    padded[:, :L] = cache
    num_pages = B * per_seq + 5
    g = torch.Generator(device="cuda").manual_seed(seed)
    table = torch.randperm(num_pages, device="cuda", generator=g)[: B * per_seq].reshape(B, per_seq)
    pages = torch.randn(num_pages, page, Hkv, D, dtype=cache.dtype, device=cache.device)
    pages[table.flatten()] = padded.reshape(B * per_seq, page, Hkv, D)
    return pages, table.to(torch.int32)


# (B, T, Hq, Hkv, D, L): the benchmark shapes and odd ones
SHAPES = {
    "B64-T1-H32-HKV8-D128-L8192": (64, 1, 32, 8, 128, 8192),
    "B1-T1-H32-HKV8-D128-L131072": (1, 1, 32, 8, 128, 131072),
    "B8-T1-H32-HKV8-D128-L65536": (8, 1, 32, 8, 128, 65536),
    "B4-T4-H32-HKV4-D128-L3000": (4, 4, 32, 4, 128, 3000),
    "B16-T1-H16-HKV2-D64-L1027": (16, 1, 16, 2, 64, 1027),
    "B3-T2-H8-HKV1-D256-L777": (3, 2, 8, 1, 256, 777),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_decode_gpu_matches_reference(shape, dtype):
    B, T, Hq, Hkv, D, L = shape
    q, k, v, seqlens = _inputs(B, T, Hq, Hkv, D, L, dtype, seed=L)
    out, lse = wsattn.decode(q, k, v, seqlens, return_lse=True, impl="triton")
    ref, ref_lse = reference.decode(q, k, v, seqlens)
    assert_close(out, ref, dtype)
    assert_lse_close(lse, ref_lse, dtype)


@pytest.mark.parametrize("page", [1, 7, 16, 64])
@pytest.mark.parametrize("splits", [1, 5])
def test_paged_equals_contiguous_bitwise(page, splits):
    """Paged and contiguous caches holding the same keys give bit-identical results."""
    q, k, v, seqlens = _inputs(6, 1, 32, 8, 128, 2000, torch.bfloat16, seed=page)
    kp, table = _to_paged(k, page, seed=1)
    vp, _ = _to_paged(v, page, seed=1)
    a = wsattn.decode(q, k, v, seqlens, num_splits=splits, return_lse=True, impl="triton")
    b = wsattn.decode(q, kp, vp, seqlens, table, num_splits=splits, return_lse=True, impl="triton")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    ref, _ = reference.decode(q, k, v, seqlens)
    assert_close(b[0], ref, torch.bfloat16)


@pytest.mark.parametrize("shape", ["B64-T1-H32-HKV8-D128-L8192", "B1-T1-H32-HKV8-D128-L131072"])
def test_decode_reruns_bit_identical(shape):
    q, k, v, seqlens = _inputs(*SHAPES[shape], torch.bfloat16, seed=3)
    first = wsattn.decode(q, k, v, seqlens, return_lse=True, impl="triton")
    for _ in range(5):
        again = wsattn.decode(q, k, v, seqlens, return_lse=True, impl="triton")
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def test_decode_cuda_graph_replay():
    """Captured once (validate=False: no host read), replayed after seqlens change in place."""
    q, k, v, seqlens = _inputs(2, 1, 32, 8, 128, 16384, torch.bfloat16, lens=[16384, 900])
    run = lambda: wsattn.decode(q, k, v, seqlens, return_lse=True, impl="triton", validate=False)
    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = run()
    seqlens.copy_(torch.tensor([77, 16000], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    ref, ref_lse = reference.decode(q, k, v, seqlens)
    assert_close(out, ref, torch.bfloat16)
    assert_lse_close(lse, ref_lse, torch.bfloat16)




@pytest.mark.parametrize("page", [None, 16, 64])
@pytest.mark.parametrize("splits", [1, 5, 0])
def test_decode_pdl_equals_no_pdl_bitwise(page, splits):
    """PDL launches (decode and combine) give bit for bit what plain launches give, eager
    and replayed from a CUDA graph after a PDL-launched producer of q."""
    from wsattn.kernels import decode_triton
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90+")
    q, k, v, seqlens = _inputs(4, 1, 32, 8, 128, 4096, torch.bfloat16, seed=11)
    table = None
    if page is not None:
        k, table = _to_paged(k, page, seed=2)
        v, _ = _to_paged(v, page, seed=2)
    scale = 128 ** -0.5
    base = decode_triton.decode(q, k, v, seqlens, table, scale, splits)
    on = decode_triton.decode(q, k, v, seqlens, table, scale, splits, pdl=True)
    assert torch.equal(base[0], on[0]) and torch.equal(base[1], on[1])
    q2 = torch.empty_like(q)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.mul(q, 1.0, out=q2)  # a producer the decode kernel must wait for
        out, lse = decode_triton.decode(q2, k, v, seqlens, table, scale, splits, pdl=True)
    for _ in range(3):
        q2.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, base[0]) and torch.equal(lse, base[1])
