"""The keys of a paged KV cache copied into one packed contiguous buffer, on the device.

Chunked prefill reads every key of a sequence once per query tile of its chunk: with a
chunk of 2048 queries a key is read 16 times or more, so prefill over a paged prefix is
compute-bound, and one extra pass over the prefix's K/V costs little next to the
attention (8 sequences x 34k keys x 8 KV heads x D 128 in bf16: 1.1 GB, ~0.3 ms at HBM
rate, against ~20 ms of attention). ``gather_kv`` makes that pass, so that the paged call
can run the packed-varlen kernels (the Triton one, and the sm_90 Gluon one, which reads
K/V by TMA and cannot follow a page table) on keys laid out as ``attention_varlen``
takes them: sequence b's keys at rows cu_seqlens_k[b]:cu_seqlens_k[b+1].

No host read: the kernel finds each sequence's first row by summing seqlens_k itself and
writes cu_seqlens_k as it goes (no prefix-sum launches before it), and the buffer is sized
from host metadata only (batch x block_table width x page_size rows, plus PAD_ROWS), so a
call can be captured in a CUDA graph. The rows past the last sequence's keys are not
written except the PAD_ROWS after them, which are zeroed: an attention kernel's key tile
that starts inside the last sequence may read up to a tile past its end without a mask
(a TMA box), and must find finite numbers there, not whatever the allocation held
(0 x NaN in P V is NaN).

Reads top to bottom: jit kernel, launcher.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ..target import target_of
from ..testing import dtype_name
from ._alloc import empty
from ._intmath import cdiv
from ._rebuild import rebuild
from ._softmax import _sum_combine  # noqa: F401 (_JIT_NAMES)

# Zeroed rows after the packed keys: at least the largest key tile of the attention
# kernels that read the buffer (BLOCK_N <= 128 in prefill_triton and prefill_gluon).
PAD_ROWS = 128
ROWS = 64  # key rows a program copies (every KV head of them, K and V)
# seqlens_k entries a program sums at a time for its sequence's start (one pass up to 128
# sequences; a larger pack pays one more L2 round trip per 128 before each program's copy)
SEQ_CHUNK = 128


@triton.jit
def _keys_before(SEQLENS_K, b, SEQ_CHUNK: tl.constexpr):
    # keys of sequences 0 .. b-1: the first packed row of sequence b (b == B: the total)
    i = tl.arange(0, SEQ_CHUNK)
    total = 0
    for c0 in range(0, b, SEQ_CHUNK):
        n = tl.load(SEQLENS_K + c0 + i, mask=c0 + i < b, other=0)
        total += tl.reduce(n, 0, _sum_combine)
    return total


@triton.jit
def _gather_kernel(KC, VC, KO, VO, SEQLENS_K, CU_K, BT, B, HKV,
                   stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                   stride_btb,
                   D: tl.constexpr, PAGE_SIZE: tl.constexpr, ROWS: tl.constexpr,
                   PAD: tl.constexpr, SEQ_CHUNK: tl.constexpr):
    # program (b, c): keys c*ROWS .. c*ROWS + ROWS - 1 of sequence b; b == B zeroes the PAD
    # rows after the last sequence's keys. Output rows are [HKV * D] contiguous. Program
    # (b, 0) writes CU_K[b + 1] (and (0, 0) CU_K[0]); nothing here reads CU_K, every
    # program sums the key counts before its own sequence (the later launches read it).
    b = tl.program_id(0)
    c = tl.program_id(1)
    r = c * ROWS + tl.arange(0, ROWS)  # [ROWS]
    d = tl.arange(0, D)  # [D]
    if b == B:
        if c == 0:
            tl.store(CU_K, 0)
        total = _keys_before(SEQLENS_K, B, SEQ_CHUNK)
        live = r < PAD
        dst = (total + r).to(tl.int64) * HKV * D  # [ROWS]
        # no tl.zeros: a standard-library jit helper, which _rebuild's kernels avoid
        zero = ((r[:, None] + d[None, :]) * 0).to(KO.dtype.element_ty)  # [ROWS, D]
        for h in range(HKV):
            tl.store(KO + dst[:, None] + h * D + d[None, :], zero, mask=live[:, None])
            tl.store(VO + dst[:, None] + h * D + d[None, :], zero, mask=live[:, None])
    else:
        n = tl.load(SEQLENS_K + b)
        if c == 0:
            tl.store(CU_K + b + 1, _keys_before(SEQLENS_K, b, SEQ_CHUNK) + n)
        if c * ROWS < n:
            start = _keys_before(SEQLENS_K, b, SEQ_CHUNK)
            live = r < n
            page = tl.load(BT + b.to(tl.int64) * stride_btb + r // PAGE_SIZE, mask=live,
                           other=0).to(tl.int64)  # [ROWS]
            slot = (r % PAGE_SIZE).to(tl.int64)
            k_src = page * stride_kp + slot * stride_ks  # [ROWS]
            v_src = page * stride_vp + slot * stride_vs
            dst = (start + r).to(tl.int64) * HKV * D
            for h in range(HKV):
                k = tl.load(KC + k_src[:, None] + h * stride_kh + d[None, :],
                            mask=live[:, None])
                v = tl.load(VC + v_src[:, None] + h * stride_vh + d[None, :],
                            mask=live[:, None])
                tl.store(KO + dst[:, None] + h * D + d[None, :], k, mask=live[:, None])
                tl.store(VO + dst[:, None] + h * D + d[None, :], v, mask=live[:, None])


_JIT_NAMES = ("_sum_combine", "_keys_before", "_gather_kernel")


def _kernel(interpret: bool):
    """``_gather_kernel`` built for the interpreter or for the compiler, whatever the
    process (why and how: ``_rebuild``)."""
    return rebuild(globals(), _JIT_NAMES, "_gather_kernel", interpret)


def buffer_rows(batch: int, max_pages: int, page_size: int) -> int:
    """Rows of gather_kv's buffers: every sequence at the block table's full width, plus
    the zeroed PAD_ROWS (host metadata only; the keys actually packed are sum(seqlens_k))."""
    return batch * max_pages * page_size + PAD_ROWS


def gather_kv(k_cache, v_cache, seqlens_k, block_table):
    """Copy each sequence's keys and values out of the paged cache, packed (inputs
    validated by ``wsattn.api``: the index values as attention_paged requires them).

    Args:
        k_cache, v_cache: [num_pages, page_size, Hkv, D], last dim contiguous, one dtype.
        seqlens_k: int32 [B] contiguous, keys per sequence (at most max_pages * page_size).
        block_table: int32 [B, max_pages], last dim contiguous.

    Returns:
        (k [R, Hkv, D], v [R, Hkv, D] contiguous in the cache's dtype, cu_seqlens_k int32
        [B + 1], max_seqlen_k = max_pages * page_size, an upper bound), R = buffer_rows:
        sequence b's key j at row cu_seqlens_k[b] + j, PAD_ROWS zero rows after the last
        key, the rest unwritten.

    Example (CPU, TRITON_INTERPRET=1):
        >>> kc = vc = torch.randn(3, 16, 2, 64)
        >>> k, v, cu, max_k = gather_kv(kc, vc, torch.tensor([20], dtype=torch.int32),
        ...                             torch.tensor([[2, 0]], dtype=torch.int32))
        >>> torch.equal(k[:16], kc[2]) and torch.equal(k[16:20], kc[0, :4]), cu.tolist()
        (True, [0, 20])
    """
    num_pages, page, hkv, D = k_cache.shape
    B, max_pages = block_table.shape
    cap = max_pages * page
    rows = buffer_rows(B, max_pages, page)
    k = empty((rows, hkv, D), k_cache.dtype, k_cache.device)
    v = empty((rows, hkv, D), v_cache.dtype, v_cache.device)
    cu = empty((B + 1,), torch.int32, k_cache.device)  # every entry written by the kernel
    grid = (B + 1, max(cdiv(cap, ROWS), cdiv(PAD_ROWS, ROWS)))
    interpret = target_of(k_cache.device).backend == "interpreter"
    with contextlib.nullcontext() if interpret else torch.cuda.device(k_cache.device):
        _kernel(interpret)[grid](
            k_cache, v_cache, k, v, seqlens_k, cu, block_table, B, hkv,
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
            D=D, PAGE_SIZE=page, ROWS=ROWS, PAD=PAD_ROWS, SEQ_CHUNK=SEQ_CHUNK, num_warps=4)
    return k, v, cu, cap


def compile_spec(cc: int, head_dim: int = 128, dtype: str = "bf16",
                 page_size: int = 16) -> dict:
    """What ``triton.compile`` needs to build the gather kernel for compute capability cc
    (as prefill_paged.compile_spec): {"fn", "signature", "constexprs", "attrs", "options"}."""
    ty = dtype_name(dtype)
    ptr = "*" + ty
    fn = _kernel(False)
    signature = {"KC": ptr, "VC": ptr, "KO": ptr, "VO": ptr, "SEQLENS_K": "*i32",
                 "CU_K": "*i32", "BT": "*i32", "B": "i32", "HKV": "i32"}
    strides = [n for n in fn.arg_names if n.startswith("stride_")]
    signature.update({n: "i32" for n in strides})
    constexprs = {"D": head_dim, "PAGE_SIZE": page_size, "ROWS": ROWS, "PAD": PAD_ROWS,
                  "SEQ_CHUNK": SEQ_CHUNK}
    signature.update({n: "constexpr" for n in constexprs})
    # a launch specializes the tensor pointers and the cache strides (multiples of D)
    aligned = ["KC", "VC", "KO", "VO", "SEQLENS_K", "CU_K", "BT",
               *(n for n in strides if n != "stride_btb")]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return {"fn": fn, "signature": signature, "constexprs": constexprs,
            "options": {"num_warps": 4}, "attrs": attrs}
